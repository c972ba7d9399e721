"""Chrome/Perfetto traces and timeline pictures of simulated runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule
from pipedream_fast.sim import UnitCosts, events_from_simulation, simulate, write_simulation_trace
from pipedream_fast.timeline import draw_timeline
from pipedream_fast.trace import (TraceEvent, overlap_summary, read_chrome_trace, transfers,
                                  write_chrome_trace)


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


def test_transfers_from_a_hand_made_trace(tmp_path) -> None:
    """Two messages whose numbers are worked by hand: an activation the receiver started
    waiting for before it was sent (its wait before the send is the bubble, not the
    transfer), and a gradient that was in flight while the receiver did other work."""
    events = [
        TraceEvent(0, "send_act", 1.0, 0.1, stage=0, microbatch=0),
        TraceEvent(1, "forward", 0.5, 3.0, stage=1, microbatch=0, version=0,
                   args={"waited_ms": 2.0}),  # has it at 2.5: 1.5 in flight, all exposed
        TraceEvent(1, "send_grad", 3.0, 0.1, stage=1, microbatch=0),
        TraceEvent(0, "backward", 5.0, 1.0, stage=0, microbatch=0, version=0,
                   args={"waited_ms": 0.5}),  # has it at 5.5: 2.5 in flight, 0.5 exposed
        TraceEvent(0, "forward", 0.0, 0.5, stage=0, microbatch=0, version=0),  # takes nothing
    ]
    act, grad = transfers(events)
    assert (act.tensor, act.src, act.dst, act.stage, act.microbatch) == ("act", 0, 1, 1, 0)
    assert (act.in_flight_ms, act.exposed_ms, act.hidden_ms) == pytest.approx((1.5, 1.5, 0.0))
    assert (grad.tensor, grad.src, grad.dst, grad.stage) == ("grad", 1, 0, 0)
    assert (grad.in_flight_ms, grad.exposed_ms, grad.hidden_ms) == pytest.approx((2.5, 0.5, 2.0))
    summary = overlap_summary([act, grad])
    assert [(r["tensor"], r["messages"], r["hidden"]) for r in summary] == \
        [("act", 1, pytest.approx(0.0)), ("grad", 1, pytest.approx(0.8))]
    write_chrome_trace(events, tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    phases = [e["ph"] for e in data["traceEvents"] if e.get("cat") in ("transfer", "message")]
    assert sorted(phases) == sorted("bbeessff")
    assert data["otherData"]["transfers"] == summary
    assert len(read_chrome_trace(tmp_path / "t.json")) == len(events)  # slices only, as before


def test_every_message_of_a_real_run_is_taken_after_it_was_sent() -> None:
    """A 2-stage 1f1b run on rank threads, traced: each send pairs with the compute that took
    its message on the other rank, and by the clock (not by the pairing) that compute had it
    no earlier than the send began."""
    from pipedream_fast.formats import Plan, StagePlan
    from pipedream_fast.local_pipeline import LocalPipeline

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    plan = Plan(model="tiny", batch_size=4, workers=2, schedule="1f1b",
                stages=[StagePlan(0, 2, 1, (0,), 1.0), StagePlan(2, 3, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    data = [(torch.randn(8, 6), torch.randint(0, 4, (8,))) for _ in range(3)]
    pipe = LocalPipeline(net, nn.functional.cross_entropy,
                         lambda params: torch.optim.SGD(params, lr=0.1), plan,
                         schedule="1f1b", chunks=2, timeout=60, trace=True)
    list(pipe.train(data, 3))
    sends = [e for e in pipe.last_events if e.kind in ("send_act", "send_grad")]
    moved = transfers(pipe.last_events)
    assert len(moved) == len(sends) == 12  # 6 microbatches, an activation and a gradient each
    assert {(t.src, t.dst, t.tensor) for t in moved} == {(0, 1, "act"), (1, 0, "grad")}
    for t in moved:
        assert t.taken_ms >= t.sent_ms - 1e-3, t
        assert 0.0 <= t.exposed_ms <= t.in_flight_ms
