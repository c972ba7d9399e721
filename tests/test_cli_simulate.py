"""`pipedream-fast simulate` through the real dispatcher (`pipedream_fast.cli.main`)."""

from __future__ import annotations

import json

import pytest

from pipedream_fast import cli
from pipedream_fast.ir import Schedule
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import UnitCosts, simulate

from tests.test_sim import two_stage_plan


@pytest.fixture
def run(monkeypatch, capsys):
    # Only this command: the other command modules are written by others in parallel.
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("simulate",))

    def call(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["simulate", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err
    return call


def test_summary(run) -> None:
    code, out, _ = run("--schedule", "pipedream", "--stages", "4", "--microbatches", "16",
                       "--unit-cost")
    assert code == 0
    assert "makespan    38 units" in out
    assert "weight delay over steady state (microbatches 4..11): max 14" in out  # 4^2 - 4/2
    assert out.count("\n0     0") == 1  # one row per rank


def test_json_and_files(run, tmp_path) -> None:
    trace, png, ir = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "ir.json"
    code, out, _ = run("--schedule", "pipedream", "--stages", "4", "--microbatches", "16",
                       "--json", "--trace", str(trace), "--timeline", str(png),
                       "--save-schedule", str(ir))
    assert code == 0
    data = json.loads(out)
    for key in ("makespan", "throughput", "idle_fraction", "max_delay", "mean_delay",
                "peak_versions", "per_rank"):
        assert key in data
    assert data["makespan"] == 38 and data["peak_versions"] == [4, 3, 2, 1]
    assert data["throughput"] == pytest.approx(16 / 38)
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2, 3]
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert Schedule.load(ir) == make_schedule("pipedream", 4, 16)


def test_custom_costs_and_schedule_options(run) -> None:
    code, out, _ = run("--schedule", "1f1b", "--stages", "3", "--microbatches", "8",
                       "--replicas", "2,1,1", "--chunks", "4", "--forward-cost", "1",
                       "--backward-cost", "2", "--comm-cost", "0.5", "--json")
    expected = simulate(make_schedule("1f1b", 3, 8, replicas=[2, 1, 1], chunks=4),
                        UnitCosts(1, 2, 0.5))
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(expected.makespan)
    code, out, _ = run("--schedule", "localsgd", "--stages", "3", "--microbatches", "12",
                       "--local-steps", "2", "--model-replicas", "2", "--json")
    assert code == 0 and json.loads(out)["params"]["model_replicas"] == 2


def test_interleaved_stages_per_rank(run) -> None:
    code, out, _ = run("--schedule", "interleaved-1f1b", "--stages", "4", "--stages-per-rank",
                       "2", "--microbatches", "8", "--chunks", "4", "--forward-cost",
                       "0.5", "--backward-cost", "0.5", "--json")
    data = json.loads(out)
    assert code == 0 and [r["stages"] for r in data["per_rank"]] == [[0, 2], [1, 3]]
    assert data["makespan"] == pytest.approx(2 * 8 + 2 * (2 - 1) / 2 * 2)  # 2 steps, bubble / v
    code, _, err = run("--schedule", "1f1b", "--stages", "4", "--stages-per-rank", "2",
                       "--replicas", "1,1,1,1", "--microbatches", "8")
    assert code == 2 and "not both" in err


def test_profile_and_plan(run, tmp_path) -> None:
    profile, plan = two_stage_plan((2, 1), None)
    profile.save(tmp_path / "p.json")
    plan.save(tmp_path / "plan.json")
    files = ("--profile", str(tmp_path / "p.json"), "--plan", str(tmp_path / "plan.json"))
    code, out, _ = run(*files, "--microbatches", "6", "--json", "--bandwidth", "1e9")
    data = json.loads(out)
    assert code == 0 and data["schedule"] == "gpipe" and data["replicas"] == [2, 1]
    assert data["time_unit"] == "ms" and data["samples_per_s"] > 0
    code, out, _ = run(*files, "--microbatches", "6", "--schedule", "pipedream", "--stages", "2")
    assert code == 0 and "schedule pipedream: 2 stages" in out and "samples/s" in out
    code, _, err = run(*files, "--microbatches", "6", "--stages", "3")
    assert code == 2 and "--stages 3 contradicts the plan, which has 2 stages" in err
    code, _, err = run(*files, "--microbatches", "6", "--replicas", "1,1")
    assert code == 2 and "contradicts the plan's replicas 2,1" in err


@pytest.mark.parametrize("argv, phrase", [
    (["--stages", "2", "--microbatches", "4"], "--schedule is required"),
    (["--schedule", "gpipe", "--microbatches", "4"], "--stages is required"),
    (["--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--unit-cost",
      "--forward-cost", "2"], "drop it"),
    (["--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--profile", "p.json"],
     "go together"),
    (["--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--replicas", "2,x"],
     "comma-separated integers"),
    (["--schedule", "data-parallel", "--stages", "3", "--microbatches", "4"],
     "--stages 1 --replicas W"),
    (["--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--comm-cost", "-1"],
     "must be >= 0")])
def test_usage_errors(run, argv: list[str], phrase: str) -> None:
    code, _, err = run(*argv)
    assert code == 2 and phrase in err and "Traceback" not in err


def test_full_cli_once_every_command_exists(capsys) -> None:
    for name in cli.COMMAND_MODULES:
        pytest.importorskip(f"pipedream_fast.commands.{name}")
    assert cli.main(["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches",
                     "3", "--unit-cost"]) == 0
    assert "makespan    8 units" in capsys.readouterr().out


def test_a_profile_with_held_bytes_gets_each_ranks_predicted_memory(run, tmp_path) -> None:
    """With the blocks' held bytes (profiles made by this version) the summary and the JSON
    carry every rank's predicted peak (`sim_memory`), by kind; older profiles do not."""
    from pipedream_fast.sim_memory import predict_memory
    profile, plan = two_stage_plan((1, 1), None)
    for block in profile.blocks:
        block.extra["held_bytes"] = 4096
    profile.save(tmp_path / "p.json")
    plan.save(tmp_path / "plan.json")
    files = ("--profile", str(tmp_path / "p.json"), "--plan", str(tmp_path / "plan.json"))
    code, out, _ = run(*files, "--microbatches", "8", "--chunks", "4", "--schedule", "1f1b")
    assert code == 0 and "predicted memory per rank" in out
    code, out, _ = run(*files, "--microbatches", "8", "--chunks", "4", "--schedule", "1f1b",
                       "--json")
    memory = json.loads(out)["memory"]
    schedule = make_schedule("1f1b", 2, 8, chunks=4, stage_ranks=[[0], [1]])
    want = predict_memory(simulate(schedule, UnitCosts()), profile, plan, profile.batch_size, 4)
    assert {int(r): m["total_peak"] for r, m in memory.items()} == \
        {r: m.total_peak for r, m in want.items()}
    profile.blocks[0].extra.pop("held_bytes")
    profile.save(tmp_path / "p.json")
    code, out, _ = run(*files, "--microbatches", "8", "--chunks", "4", "--schedule", "1f1b")
    assert code == 0 and "predicted memory" not in out
