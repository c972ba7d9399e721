"""`pipedream-fast profile` and `plan`, run in-process through the real dispatcher."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pipedream_fast import cli
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.schedules import AUTOMATIC, SCHEDULE_NAMES, TRAINABLE, kind


@pytest.fixture(autouse=True)
def only_these_verbs(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests exercise profile and plan; other verbs are tested in their own files.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("profile", "plan"))


def run(*argv: str) -> int:
    return cli.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "mlp.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "COMMAND_MODULES", ("profile", "plan"))
        assert run("profile", "--model", "mlp", "--batch-size", "4", "--warmup", "0",
                   "--repeat", "1", "--quiet", "--out", path) == 0
    return path


def test_profile_then_plan_on_the_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run("profile", "--model", "cnn", "--batch-size", "2", "--warmup", "0", "--repeat", "1",
               "--optimizer", "momentum", "--out", profile) == 0
    out = capsys.readouterr().out
    assert "conv1" in out and "fc3" in out and f"wrote {profile}" in out
    loaded = Profile.load(profile)
    assert len(loaded.blocks) == 9 and loaded.model == "cnn" and loaded.extra["optimizer"] == "momentum"
    assert run("plan", "--profile", profile, "--topology", "2x1e9", "--out", plan) == 0
    out = capsys.readouterr().out
    for text in ("stage", "replicas", "predicted ms", "bottleneck:", "data parallel:",
                 "speedup vs data parallel:"):
        assert text in out
    made = Plan.load(plan)
    made.check_matches(loaded)
    assert made.workers <= 2 and made.extra["topology"]["levels"][0]["workers"] == 2


def test_profile_then_plan_on_the_skip_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run("profile", "--model", "skipnet", "--batch-size", "2", "--warmup", "0", "--repeat", "1",
               "--quiet", "--out", profile) == 0
    assert run("plan", "--profile", profile, "--topology", "2x1e10,2x1e9", "--schedule", "2bw",
               "--out", plan) == 0
    out = capsys.readouterr().out
    assert "res2" in out or "stem" in out
    made = Plan.load(plan)
    assert made.schedule == "2bw" and made.stages[-1].stop == 6


@pytest.mark.parametrize("extra", [["--straight"], ["--strategy", "time"], ["--strategy", "uniform"],
                                   ["--strategy", "data-parallel"], ["--schedule", "gpipe",
                                                                     "--chunks", "4"]])
def test_plan_options(mlp_profile: Path, tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "plan.json"
    assert run("plan", "--profile", mlp_profile, "--topology", "4x1e9", "--workers", "4",
               "--quiet", "--out", out, *extra) == 0
    plan = Plan.load(out)
    if "--straight" in extra:
        assert all(s.replicas == 1 for s in plan.stages)
    if "data-parallel" in extra:
        assert len(plan.stages) == 1 and plan.stages[0].replicas == 4


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_plan_plans_every_schedule_as_train_does(mlp_profile: Path, tmp_path: Path,
                                                 schedule: str) -> None:
    """Each schedule is planned with its own needs (`plan_for`: interleaved ones 2 stages per
    rank, data-parallel its strategy), as `train` plans it, and the plan names it."""
    from pipedream_fast.planner.choose import plan_for
    from pipedream_fast.topology import Topology

    out = tmp_path / "plan.json"
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--schedule", schedule,
               "--quiet", "--out", out) == 0
    plan = Plan.load(out)
    assert plan.schedule == schedule
    same = plan_for(schedule, Profile.load(mlp_profile), Topology.parse("2x1e9"),
                    straight=True, recompute="auto")  # as train plans (plan's default too)
    assert [(s.start, s.stop, s.ranks) for s in plan.stages] == \
        [(s.start, s.stop, s.ranks) for s in same.stages]
    if kind(schedule).planning.get("stages_per_rank") == 2:
        assert len(plan.stages) == 4


def test_plan_refuses_a_strategy_its_schedule_contradicts(mlp_profile: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    err = error_of(capsys, "plan", "--profile", mlp_profile, "--topology", "2x1e9",
                   "--schedule", "data-parallel", "--strategy", "uniform")
    assert len(err.strip().splitlines()) == 1
    assert "--schedule data-parallel is planned with --strategy data-parallel" in err


def test_plan_chooses_the_schedule(mlp_profile: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e8", "--schedule", "auto",
               "--out", out) == 0
    text = capsys.readouterr().out
    assert "schedules compared" in text and "chosen" in text
    plan = Plan.load(out)
    assert plan.schedule in TRAINABLE
    assert {r["schedule"] for r in plan.extra["schedule_choice"]} == set(AUTOMATIC)
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e8", "--stages-per-rank",
               "2", "--schedule", "1f1b", "--quiet", "--out", out) == 0
    looped = Plan.load(out)
    assert [s.ranks for s in looped.stages] == [(0,), (1,), (0,), (1,)]


def test_evaluate_an_existing_plan(mlp_profile: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--quiet", "--out", out) == 0
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--evaluate", out) == 0
    assert "bottleneck:" in capsys.readouterr().out


def test_user_factory_returning_a_bare_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_models.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "p.json"
    assert run("profile", "--model", "user_models:build", "--batch-size", "3", "--input-shape", "6",
               "--warmup", "0", "--repeat", "1", "--quiet", "--out", out) == 0
    assert [b.name for b in Profile.load(out).blocks] == ["0", "1", "2"]


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert run(*argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_bad_models(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = str(tmp_path / "p.json")
    assert "unknown model 'resnet9000'" in error_of(capsys, "profile", "--model", "resnet9000",
                                                    "--batch-size", "2", "--out", out)
    assert "cannot import 'no_such_pkg'" in error_of(capsys, "profile", "--model", "no_such_pkg:f",
                                                     "--batch-size", "2", "--out", out)
    (tmp_path / "bare.py").write_text("import torch\ndef build(): return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "--input-shape" in error_of(capsys, "profile", "--model", "bare:build", "--batch-size", "2",
                                       "--out", out)
    assert "has no attribute 'nope'" in error_of(capsys, "profile", "--model", "bare:nope",
                                                 "--batch-size", "2", "--out", out)
    assert "--batch-size must be a positive" in error_of(capsys, "profile", "--model", "mlp",
                                                         "--batch-size", "0", "--out", out)
    assert "--input-shape '3,a'" in error_of(capsys, "profile", "--model", "mlp", "--batch-size", "2",
                                             "--input-shape", "3,a", "--out", out)


def test_malformed_and_wrong_version_profiles(tmp_path: Path, mlp_profile: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert "not valid JSON" in error_of(capsys, "plan", "--profile", broken, "--topology", "2x1e9")
    old = tmp_path / "old.json"
    data = json.loads(mlp_profile.read_text())
    data["format"] = "pipedream_fast.profile/0"
    old.write_text(json.dumps(data))
    assert "expected 'pipedream_fast.profile/1'" in error_of(capsys, "plan", "--profile", old,
                                                             "--topology", "2x1e9")


def test_plan_for_another_profile(tmp_path: Path, mlp_profile: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--quiet", "--out", plan) == 0
    other = tmp_path / "other.json"
    data = json.loads(mlp_profile.read_text())
    data["batch_size"] = 64
    other.write_text(json.dumps(data))
    message = error_of(capsys, "plan", "--profile", other, "--topology", "2x1e9", "--evaluate", plan)
    assert "plan was made for model 'mlp' at batch size 4" in message


def test_bad_topologies(mlp_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = error_of(capsys, "plan", "--profile", mlp_profile, "--topology", "4x1e10,2x1e9",
                       "--workers", "6")
    assert "4 x 2 = 8 workers but --workers is 6" in message
    assert "bandwidth must be a positive" in error_of(capsys, "plan", "--profile", mlp_profile,
                                                      "--topology", "2x0")
    assert "bandwidth must be a positive" in error_of(capsys, "plan", "--profile", mlp_profile,
                                                      "--topology", "2x-5e9")
    assert "COUNTxBANDWIDTH" in error_of(capsys, "plan", "--profile", mlp_profile, "--topology", "two")
    assert "memory per worker must be positive" in error_of(
        capsys, "plan", "--profile", mlp_profile, "--topology", "2x1e9", "--memory-per-worker", "0")


def test_memory_too_small_reports_the_smallest_requirement(mlp_profile: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    message = error_of(capsys, "plan", "--profile", mlp_profile, "--topology", "2x1e9",
                       "--memory-per-worker", "1000")
    assert "smallest requirement of any plan is" in message
    need = int(message.split("to at least ")[1].split(",")[0])
    assert run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--quiet",
               "--memory-per-worker", str(need)) == 0


def test_unparseable_memory_is_an_argparse_error(mlp_profile: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--memory-per-worker", "lots")
    assert exit_info.value.code == 2


@pytest.mark.parametrize("bad", ["1e400", "nan", "inf"])
def test_infinite_memory_is_one_line(mlp_profile: Path, bad: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run("plan", "--profile", mlp_profile, "--topology", "2x1e9", "--memory-per-worker", bad)
    assert exit_info.value.code == 2
    assert "expected a finite number of bytes" in capsys.readouterr().err


def test_an_input_shape_the_model_does_not_take_is_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert run("profile", "--model", "cnn", "--input-shape", "5,5", "--batch-size", "2",
               "--out", tmp_path / "p.json") == 2
    err = capsys.readouterr().err
    assert "does not run on inputs of shape (2, 5, 5) (from --input-shape)" in err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()
