"""In-rank calibration (runtime/calibration.py) and the simulator fed with it
(sim.MeasuredCosts): the estimator on synthetic timings, the simulator reproducing a timeline
of known costs exactly, a real 2-rank run's figures, and the main job's report. No timing
assertions on real runs: speed goals live in bench/sim_accuracy.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pipedream_fast.ir import Action, ActionKind
from pipedream_fast.runtime.calibration import (Calibration, WindowedMean, pair_transfers,
                                                snapshots, summary, transfer_time)
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import MeasuredCosts, ProfileCosts, UnitCosts, simulate

K = ActionKind
MS = 1e-3  # the calibration takes seconds; the simulator's measured costs are in ms


def F(stage: int, mb: int) -> Action:
    return Action(K.FORWARD, stage, microbatch=mb, version=0)


def B(stage: int, mb: int) -> Action:
    return Action(K.BACKWARD, stage, microbatch=mb, version=0)


# --- the estimator on synthetic timings ------------------------------------------------------

def test_windowed_mean_keeps_two_buckets():
    m = WindowedMean()
    assert m.mean is None and m.estimate() is None
    for v in (1.0, 2.0, 3.0):
        m.add(v)
    assert m.mean == pytest.approx(2.0) and m.count == 3
    m.rotate()  # the bucket of 1, 2, 3 becomes the old one
    m.add(5.0)
    assert m.mean == pytest.approx((1 + 2 + 3 + 5) / 4)
    m.rotate()  # 1, 2, 3 forgotten
    assert m.mean == pytest.approx(5.0) and m.count == 1
    m.rotate()
    m.rotate()
    assert m.mean is None


def feed(cal: Calibration, timeline: list[tuple[Action, float, float, float]]) -> None:
    cal.begin_run()
    for action, start, end, waited in timeline:
        cal.record(action, start * MS, end * MS, waited * MS)


def test_own_time_gap_and_skipped_first_sample():
    """Own time = duration - wait; the gap is start - previous end; each kind's first
    sample of a run (its warm-up) is left out, and so is the run's first gap."""
    cal = Calibration(0)
    timeline, t = [], 0.0
    for mb in range(5):
        first = 50.0 if mb == 0 else 0.0  # a slow first forward and backward: left out
        timeline.append((F(1, mb), t, t + 2.0 + first + 1.0, 1.0))  # waited 1 ms
        t += 3.0 + first + 0.25  # gap 0.25 ms
        timeline.append((B(1, mb), t, t + 4.0 + first, 0.0))
        t += 4.0 + first + 0.25
    feed(cal, timeline)
    snap = cal.snapshot()
    assert snap.action_ms(K.FORWARD, 1) == pytest.approx(2.0)
    assert snap.action_ms(K.BACKWARD, 1) == pytest.approx(4.0)
    assert snap.actions[("forward", 1)].count == 4
    assert snap.gap is not None and snap.gap.ms == pytest.approx(0.25)
    assert snap.gap.count == len(timeline) - 2  # no gap before the first, first gap skipped


def test_the_feed_is_taken_off_the_first_forward():
    cal = Calibration(0, skip_first=0)
    cal.begin_run()
    for mb in range(3):
        cal.note_feed(0.5 * MS)  # what `timed_feed` notes while the forward reads its data
        cal.record(F(0, mb), mb * 10 * MS, (mb * 10 + 3) * MS, 0.0)
    snap = cal.snapshot()
    assert snap.action_ms(K.FORWARD, 0) == pytest.approx(2.5)
    assert snap.feed is not None and snap.feed.ms == pytest.approx(0.5)
    timed = cal.timed_feed(lambda mb: ((torch.zeros(1),), mb))
    assert timed(7)[1] == 7  # the source's value, unchanged


def test_window_forgets_the_old_speed_and_reset_starts_a_new_one():
    cal = Calibration(0, window=4, skip_first=0)
    cal.begin_run()
    t = 0.0
    for mb, ms in enumerate([10.0] * 8 + [2.0] * 8):  # the machine became 5x faster
        cal.record(F(1, mb), t * MS, (t + ms) * MS, 0.0)
        t += ms
    # buckets of 4 actions: the estimate covers the last 4 to 8, all of the fast ones
    assert cal.snapshot().action_ms(K.FORWARD, 1) == pytest.approx(2.0)
    cal.reset()
    assert cal.snapshot().actions == {}
    cal.record(F(1, 99), t * MS, (t + 3.0) * MS, 0.0)  # mid-run: no warm-up skipped again
    assert cal.snapshot().action_ms(K.FORWARD, 1) == pytest.approx(3.0)


def test_updates_keep_their_allreduce_wait_apart():
    cal = Calibration(0, skip_first=0)
    cal.begin_run()
    step = Action(K.OPTIMIZER_STEP, 0, version=1, microbatches=(0,))
    cal.record(step, 0.0, 5 * MS, 3 * MS)
    snap = cal.snapshot()
    assert snap.action_ms(K.OPTIMIZER_STEP, 0) == pytest.approx(2.0)
    assert snap.allreduce_wait[0].ms == pytest.approx(3.0)


def test_transfers_pair_send_and_ready_times_across_ranks():
    """Sender: SEND started at s; receiver: its forward started at t0 and waited w, so the
    tensor was ready at t0 + w. A receiver waiting for every message: the mean transfer; one
    that never waited: the smallest slack (an upper bound)."""
    sender, receiver = Calibration(0, skip_first=0), Calibration(1, skip_first=0)
    sender.begin_run()
    receiver.begin_run()
    for mb, transfer in enumerate([1.0, 2.0, 3.0]):
        s = mb * 100.0
        sender.record(Action(K.SEND_ACT, 0, microbatch=mb, peer=1), s * MS, (s + 0.1) * MS, 0)
        receiver.record(Action(K.RECV_ACT, 1, microbatch=mb, peer=0), s * MS, s * MS, 0)
        t0 = s + 0.5  # the forward asks at s + 0.5 and waits until s + transfer
        receiver.record(F(1, mb), t0 * MS, (s + transfer + 4) * MS, (s + transfer - t0) * MS)
    found = pair_transfers([sender.snapshot(), receiver.snapshot()])
    assert found[("act", 1, 0, 1)].ms == pytest.approx(2.0)
    assert found[("act", 1, 0, 1)].count == 3
    # the receiver always late (asked 5 ms after the send, the tensor long there)
    late = Calibration(1, skip_first=0)
    late.begin_run()
    for mb in range(3):
        s = mb * 100.0
        late.record(Action(K.RECV_ACT, 1, microbatch=mb, peer=0), s * MS, s * MS, 0)
        late.record(F(1, mb), (s + 5 + mb) * MS, (s + 9 + mb) * MS, 0.0)
    found = pair_transfers([sender.snapshot(), late.snapshot()])
    assert found[("act", 1, 0, 1)].ms == pytest.approx(5.0)


def test_transfer_time_matches_the_receivers_total_wait():
    # a receiver late by 2 ms for every message waited 1 ms once: T = 2.25, under which it
    # waits 4 x 0.25 ms; the 3 ms of the one it waited for, applied to all, would make 4 ms
    assert transfer_time([2.0, 2.0, 2.0, 2.0], 1.0) == pytest.approx(2.25)
    assert transfer_time([-1.0, 0.0, 5.0], 3.0 + 2.0) == pytest.approx(2.0)  # T - x summed
    assert transfer_time([0.5, 0.5, 0.5], 0.0) == pytest.approx(0.5)
    assert transfer_time([], 0.0) == 0.0
    for slacks, waited in (([0.1, 0.7, 0.2, 3.0], 1.3), ([1.0, 2.0], 0.25)):
        t = transfer_time(slacks, waited)
        assert sum(max(0.0, t - x) for x in slacks) == pytest.approx(waited)


def test_run_overhead_is_the_call_outside_its_runs(monkeypatch):
    import pipedream_fast.runtime.calibration as module

    clock = [0.0]

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return clock[0]

    monkeypatch.setattr(module, "time", FakeTime)
    cal = Calibration(0, skip_first=1)
    for call in range(3):
        base = call * 1.0
        clock[0] = base
        cal.begin_train()
        cal.begin_run()
        cal.record(F(1, 0), base + 0.010, base + 0.020, 0.0)  # 10 ms after the call began
        cal.record(B(1, 0), base + 0.021, base + 0.100, 0.0)
        clock[0] = base + 0.104  # 4 ms after the last action
        cal.end_train()
    est = cal.snapshot().run_overhead
    assert est is not None and est.count == 2  # the first call (set-up) left out
    assert est.ms == pytest.approx(14.0)


# --- the simulator reproduces a timeline of known costs exactly -------------------------------

KNOWN = MeasuredCosts(
    action_ms={**{(r, k, s): ms for r in range(3) for s in range(3)
                  for k, ms in (("forward", 1.0 + 0.5 * s), ("backward", 2.0 + 0.25 * s),
                                ("backward_input", 1.25), ("backward_weight", 0.75),
                                ("optimizer_step", 0.4), ("snapshot", 0.05), ("release", 0.01),
                                ("send_act", 0.03), ("send_grad", 0.02), ("recv_act", 0.01),
                                ("recv_grad", 0.015), ("allreduce", 0.02))}},
    feed_ms={0: 0.3}, overhead_ms={0: 0.1, 1: 0.12, 2: 0.08},
    transfer_ms={("act", 1, 0, 1): 0.35, ("act", 2, 1, 2): 0.3, ("grad", 0, 1, 0): 0.25,
                 ("grad", 1, 2, 1): 0.2},
    allreduce_ms={0: 0.6})


def fake_executor_timeline(result, costs: MeasuredCosts) -> dict[int, Calibration]:
    """Each rank's calibration fed with the simulated timeline as an executor would see it:
    an action starts `overhead` after the previous one ended, waits inside for its input
    (or its group), then takes its own time; a first-stage forward reads data first."""
    cals = {r: Calibration(r, skip_first=0) for r in range(result.schedule.num_ranks)}
    for cal in cals.values():
        cal.begin_run()
    last = {r: 0.0 for r in cals}
    for rec in sorted(result.records, key=lambda r: (r.rank, r.index)):
        start = last[rec.rank] + costs.overhead(rec.rank, rec.action)
        waited = rec.ready - start
        assert waited >= -1e-9
        if rec.action.kind is K.FORWARD and rec.action.stage == 0:
            cals[rec.rank].note_feed(costs.feed_ms.get(rec.rank, 0.0) * MS)
        cals[rec.rank].record(rec.action, start * MS, rec.end * MS, max(0.0, waited) * MS)
        last[rec.rank] = rec.end
    return cals


@pytest.mark.parametrize("name, stages, n, kw", [
    ("pipedream", 2, 12, {}), ("pipedream", 3, 12, {}), ("1f1b", 3, 12, {"chunks": 4}),
    ("gpipe", 2, 8, {"chunks": 4}), ("zb-h1", 3, 12, {"chunks": 4}), ("2bw", 2, 8, {}),
    ("data-parallel", 1, 8, {"replicas": [2]}),
])
def test_calibrated_simulation_reproduces_known_costs(name, stages, n, kw):
    schedule = make_schedule(name, stages, n, **kw)
    truth = simulate(schedule, KNOWN)
    cals = fake_executor_timeline(truth, KNOWN)
    costs = MeasuredCosts.from_calibration({r: c.snapshot() for r, c in cals.items()})
    again = simulate(schedule, costs)
    assert again.makespan == pytest.approx(truth.makespan, rel=1e-9)
    assert [(r.rank, r.index) for r in again.records] == [(r.rank, r.index)
                                                          for r in truth.records]
    assert [r.end for r in again.records] == pytest.approx([r.end for r in truth.records],
                                                           rel=1e-9)
    for (rank, kind, stage), ms in costs.action_ms.items():
        if kind != "allreduce":  # the simulated all-reduce is the group's, in allreduce_ms
            assert ms == pytest.approx(KNOWN.action_ms[(rank, kind, stage)], rel=1e-9)
    replicated = {s for s, ranks in enumerate(schedule.stage_ranks) if len(ranks) > 1}
    assert costs.allreduce_ms == pytest.approx({s: KNOWN.allreduce_ms[s] for s in replicated},
                                               rel=1e-9)
    assert costs.transfer_ms == pytest.approx({k: v for k, v in KNOWN.transfer_ms.items()
                                               if k in costs.transfer_ms}, rel=1e-9)


def test_measured_costs_time_the_overheads_the_profile_leaves_out():
    """Overhead before every action, the sends' and posts' own time and the feed: a
    2-stage pipedream with 1 ms forwards and backwards is slower by exactly those."""
    schedule = make_schedule("pipedream", 2, 10)
    plain = simulate(schedule, UnitCosts(forward=1, backward=1))
    bare = MeasuredCosts(action_ms={(r, k, r): 1.0 for r in (0, 1)
                                    for k in ("forward", "backward")})
    assert simulate(schedule, bare).makespan == pytest.approx(plain.makespan)
    slower = MeasuredCosts(action_ms=bare.action_ms, overhead_ms={0: 0.1, 1: 0.1},
                           feed_ms={0: 0.2})
    assert simulate(schedule, slower).makespan > plain.makespan + 10 * 0.2


def test_cost_models_without_overhead_time_as_before():
    """UnitCosts and ProfileCosts charge nothing for sends, posts or between actions."""
    result = simulate(make_schedule("1f1b", 3, 6, chunks=3), UnitCosts(comm=0.5))
    for rec in result.records:
        if rec.action.kind.spec.timing in ("send", "post"):
            assert rec.start == rec.ready == rec.end
    assert not hasattr(ProfileCosts, "overhead")


# --- a real run --------------------------------------------------------------------------------

def tiny_pipeline(**kw):
    from pipedream_fast.pipeline import Pipeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return Pipeline(model, nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.05), ranks="threads", workers=2,
                    stages=2, **kw)


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("schedule, chunks", [("pipedream", 1), ("1f1b", 2)])
def test_a_real_two_rank_run_calibrates_every_figure(schedule, chunks):
    pipe = tiny_pipeline(schedule=schedule, chunks=chunks)
    try:
        for _ in range(2):  # the first call's overhead is set-up: a second one measures it
            for _ in pipe.train(data(6), steps=6):
                pass
        snaps = snapshots(pipe)
    finally:
        pipe.close()
    assert set(snaps) == {0, 1}
    figures = summary(snaps)
    json.dumps(figures)  # plain values
    values = [figures["stages"][str(s)][f"{k}_ms"] for s in (0, 1)
              for k in ("forward", "backward", "update")]
    values += [figures["overhead_ms"][r] for r in ("0", "1")]
    values += [figures["feed_ms"]["0"], *figures["run_overhead_ms"].values()]
    assert len(figures["transfer_ms"]) == 2  # act 0 -> 1, grad 1 -> 0
    values += list(figures["transfer_ms"].values())
    assert all(math.isfinite(v) and v > 0 for v in values), figures
    assert len(figures["run_overhead_ms"]) == 2
    costs = MeasuredCosts.from_calibration(snaps)
    result = simulate(make_schedule(schedule, 2, 6 * chunks,
                                    **({"chunks": chunks} if chunks > 1 else {})), costs)
    assert math.isfinite(result.makespan) and result.makespan > 0


def test_the_main_job_reports_the_calibrated_prediction(tmp_path, capsys):
    from pipedream_fast.cli import main

    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--epochs", "2", "--batch-size", "128",
                 "--trace-steps", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    table = (out / "summary.txt").read_text()
    assert "samples/s simulated, calibrated" in table
    assert "samples/s simulated, profile" in table and "planner" in table
    run = json.loads((out / "summary.json").read_text())["runs"][0]
    calibrated = run["calibrated"]
    assert (calibrated["calibrated_epochs"], calibrated["predicted_epochs"]) == (1, 1)
    for key in ("predicted_samples_per_s", "measured_samples_per_s",
                "same_window_samples_per_s"):
        assert math.isfinite(calibrated[key]) and calibrated[key] > 0
    assert run["simulated_samples_per_s"] > 0  # the profile's, kept


def test_a_one_epoch_job_says_why_it_has_no_calibrated_prediction(tmp_path, capsys):
    from pipedream_fast.cli import main

    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--steps", "3", "--batch-size", "16",
                 "--trace-steps", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    assert "needs 2 epochs" in (out / "summary.txt").read_text()
    assert json.loads((out / "summary.json").read_text())["runs"][0]["calibrated"] is None
