"""Chrome/Perfetto traces and timeline pictures of simulated runs."""

from __future__ import annotations

import json

import pytest

from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule
from pipedream_fast.sim import UnitCosts, events_from_simulation, simulate, write_simulation_trace
from pipedream_fast.timeline import draw_timeline
from pipedream_fast.trace import TraceEvent, read_chrome_trace, write_chrome_trace


def test_simulation_trace_has_one_slice_per_action(tmp_path) -> None:
    result = simulate(make_schedule("pipedream", 3, 6), UnitCosts(backward=2, comm=0.5))
    path = tmp_path / "trace.json"
    write_simulation_trace(result, path)
    data = json.loads(path.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(len(a) for a in result.schedule.actions)
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e.get("name") == "thread_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)", 2: "rank 2 (stage 2)"}
    forward = next(e for e in slices if e["args"].get("action") == "1F2@1")
    rec = next(r for r in result.records if r.action.to_text() == "1F2@1")
    assert forward["name"] == "F2 v1" and forward["cat"] == "forward"
    assert forward["ts"] == pytest.approx(rec.start * 1e3)  # microseconds
    assert forward["dur"] == pytest.approx(1e3)
    assert forward["args"]["stage"] == 1 and forward["args"]["microbatch"] == 2
    for tid in names:  # slices on a track never overlap, so the viewers nest them correctly
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))


def test_trace_round_trip(tmp_path) -> None:
    result = simulate(make_schedule("2bw", 2, 6), UnitCosts())
    events = events_from_simulation(result)
    write_chrome_trace(events, tmp_path / "t.json")
    back = read_chrome_trace(tmp_path / "t.json")
    assert [(e.rank, e.kind, e.stage, e.microbatch, e.version) for e in back] == \
        [(e.rank, e.kind, e.stage, e.microbatch, e.version) for e in events]
    assert [e.start_ms for e in back] == pytest.approx([e.start_ms for e in events])


def test_runtime_style_events(tmp_path) -> None:
    """What the runtime will emit: measured times, extra args, no schedule object."""
    events = [TraceEvent(0, "forward", 0.25, 3.5, stage=0, microbatch=1, version=0,
                         args={"bytes": 4096}),
              TraceEvent(1, "recv_act", 0.5, 3.0, stage=1, microbatch=1),
              TraceEvent(1, "optimizer_step", 9.0, 0.4, stage=1, version=2)]
    write_chrome_trace(events, tmp_path / "run.json", process="runtime", pid=1,
                       rank_stages={0: [0], 1: [1]})
    data = json.loads((tmp_path / "run.json").read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["F1 v0", "recv act 1", "step v2"]
    assert slices[0]["args"]["bytes"] == 4096 and slices[0]["dur"] == pytest.approx(3500)
    assert all(e["pid"] == 1 for e in data["traceEvents"])


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_draws(name: str, tmp_path) -> None:
    stages, replicas = (1, [2]) if name == "data-parallel" else (3, [2, 1, 1])
    kw: dict = {"replicas": replicas}
    if name == "localsgd":
        kw = {}
    if name == "interleaved-1f1b":
        stages, kw = 4, {"stages_per_rank": 2}
    result = simulate(make_schedule(name, stages, 8, **kw), UnitCosts(comm=0.2))
    path = tmp_path / f"{name}.png"
    title, key = draw_timeline(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what it is (a simulation, not a measurement) and what its labels mean
    assert title.startswith(f"simulated {name} (predicted from the profile, not measured)")
    assert key.startswith("number in a box: its microbatch")
    several = len({r.action.version for r in result.records if r.action.kind.is_compute}) > 1
    assert ("vN: the weight version" in key) == several
