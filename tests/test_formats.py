"""Profile and Plan JSON: round trips, version and field checks, plan/profile matching."""

from __future__ import annotations

import json

import pytest

from pipedream_fast.formats import (PLAN_FORMAT, PROFILE_FORMAT, BlockProfile, FormatError, Plan,
                                    Profile, StagePlan)


def profile(model: str = "m", batch: int = 8, blocks: int = 3) -> Profile:
    return Profile(model=model, batch_size=batch, device="cpu", extra={"note": "kept"},
                   blocks=[BlockProfile(f"b{k}", 1.0 + k, 2.0, 100, 200, 0, extra={"saved_bytes": 5})
                           for k in range(blocks)])


def plan(workers: int = 3) -> Plan:
    return Plan(model="m", batch_size=8, workers=workers, schedule="pipedream",
                stages=[StagePlan(0, 1, 1, (0,), 3.0), StagePlan(1, 3, 2, (1, 2), 2.5, extra={"x": 1})],
                bottleneck_ms=3.0, data_parallel_ms=6.0, extra={"topology": {"levels": []}})


def test_profile_round_trip_keeps_extra_fields(tmp_path) -> None:
    path = tmp_path / "p.json"
    profile().save(path)
    data = json.loads(path.read_text())
    assert data["format"] == PROFILE_FORMAT and data["note"] == "kept"
    assert data["blocks"][0]["saved_bytes"] == 5
    again = Profile.load(path)
    assert again.blocks == profile().blocks and again.extra == {"note": "kept"}


def test_plan_round_trip(tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan().save(path)
    data = json.loads(path.read_text())
    assert data["format"] == PLAN_FORMAT
    assert data["predicted"] == {"bottleneck_ms": 3.0, "data_parallel_ms": 6.0,
                                 "speedup_vs_data_parallel": 2.0}
    again = Plan.load(path)
    assert again.stages == plan().stages and again.stages[1].extra == {"x": 1}
    assert again.stages_of_rank(2) == (1,)


def test_plan_may_place_several_stages_on_a_rank() -> None:
    looped = Plan(model="m", batch_size=8, workers=2, schedule="interleaved-1f1b",
                  stages=[StagePlan(i, i + 1, 1, (i % 2,), 1.0) for i in range(4)],
                  bottleneck_ms=1.0, data_parallel_ms=1.0)
    assert looped.stages_of_rank(0) == (0, 2) and looped.stages_of_rank(1) == (1, 3)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="pipedream_fast.profile/0"), "expected 'pipedream_fast.profile/1'"),
    (lambda d: d.pop("batch_size"), "missing the field 'batch_size'"),
    (lambda d: d.update(batch_size=True), "got a boolean"),
    (lambda d: d["blocks"][1].update(forward_ms="fast"), "profile block 1.*forward_ms"),
    (lambda d: d["blocks"][0].update(activation_bytes=-1), "must be >= 0"),
    (lambda d: d.update(blocks=[]), "has no blocks"),
])
def test_bad_profiles(tmp_path, mutate, message: str) -> None:
    data = profile().to_dict()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match=message):
        Profile.load(path)


def test_malformed_json_names_file_and_position(tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"format": "pipedream_fast.profile/1", ')
    with pytest.raises(FormatError, match=r"broken.json.*not valid JSON \(line 1"):
        Profile.load(path)
    with pytest.raises(FormatError, match="cannot read profile file"):
        Profile.load(tmp_path / "missing.json")


@pytest.mark.parametrize("stages, message", [
    ([StagePlan(0, 1, 1, (0,), 1.0), StagePlan(2, 3, 2, (1, 2), 1.0)], "must start at block 1"),
    ([StagePlan(0, 3, 2, (0,), 1.0)], "replicas=2 but 1 ranks"),
    ([StagePlan(0, 1, 1, (0,), 1.0), StagePlan(1, 3, 2, (2, 2), 1.0)], "lists a rank twice"),
    ([StagePlan(0, 3, 2, (0, 1), 1.0)], "every rank 0..2 must hold a stage"),
])
def test_invalid_plans(stages, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        Plan(model="m", batch_size=8, workers=3, schedule="gpipe", stages=stages,
             bottleneck_ms=1.0, data_parallel_ms=1.0)


def test_plan_for_another_profile_is_refused() -> None:
    with pytest.raises(FormatError, match="made for model 'm' at batch size 8.*'other'"):
        plan().check_matches(profile(model="other"))
    with pytest.raises(FormatError, match="batch size 8.*batch size 4"):
        plan().check_matches(profile(batch=4))
    with pytest.raises(FormatError, match="covers 3 blocks but .* has 5"):
        plan().check_matches(profile(blocks=5))
    plan().check_matches(profile())


def test_wrong_plan_version(tmp_path) -> None:
    data = plan().to_dict()
    data["format"] = "pipedream_fast.plan/2"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match="regenerate it"):
        Plan.load(path)
