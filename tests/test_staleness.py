"""Weight delays, measured on simulated timelines, checked against small cases worked out by
hand (the derivations are in the comments), against the closed form of PipeDream's delay law
with unit costs (S^2 - ceil(S/2), the theory paper's S^2 - S/2 + O(1)), and on the runtime's
own trace of a real run."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pipedream_fast.ir import Action
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import ActionRecord, UnitCosts, events_from_simulation, simulate
from pipedream_fast.staleness import (pipedream_unit_law, records_from_events, trace_delays,
                                      weight_delays)
from pipedream_fast.trace import TraceEvent


def delays_of(name: str, stages: int, n: int, **kw):
    return simulate(make_schedule(name, stages, n, **kw), UnitCosts()).delays


def test_pipedream_two_stages_six_microbatches_by_hand() -> None:
    # Unit costs (F = B = 1, steps and transfers 0). Timelines (start times):
    #   stage 0: F0 0, F1 1, B0 3 (U 4), F2 4, B1 5 (U 6), F3 6, B2 7 (U 8), F4 8, B3 9 (U 10),
    #            F5 10, B4 11 (U 12), B5 13 (U 14)
    #   stage 1: F0 1, B0 2 (U 3), F1 3, B1 4 (U 5), F2 5, B2 6 (U 7), F3 7, B3 8 (U 9),
    #            F4 9, B4 10 (U 11), F5 11, B5 12 (U 13)
    # Processing by (start, stage): at t=3 stage 0's B0 precedes stage 1's update of mb 0, and
    # that update precedes stage 1's F1 (same rank, earlier in its list). Counting updates:
    #   R(m,0): F0 0, F1 0, F2 2, F3 4, F4 6, F5 8;   R(m,1): F0 0, F1 1, F2 3, F3 5, F4 7, F5 9
    #   update (k before it): s1 mb0 (0), s0 mb0 (1), s1 mb1 (2), s0 mb1 (3), s1 mb2 (4),
    #                         s0 mb2 (5), s1 mb3 (6), s0 mb3 (7), ...
    # Steady state S <= m < N - S is m = 2, 3:
    #   mb 2: s1: d = (4-2, 4-3) = (2, 1);  s0: d = (5-2, 5-3) = (3, 2)
    #   mb 3: s1: d = (6-4, 6-5) = (2, 1);  s0: d = (7-4, 7-5) = (3, 2)
    d = delays_of("pipedream", 2, 6)
    assert d.steady_range == (2, 4)
    assert sorted((x.microbatch, x.update_stage, x.read_stage, x.delay) for x in d.steady) == [
        (2, 0, 0, 3), (2, 0, 1, 2), (2, 1, 0, 2), (2, 1, 1, 1),
        (3, 0, 0, 3), (3, 0, 1, 2), (3, 1, 0, 2), (3, 1, 1, 1)]
    assert (d.max_delay, d.mean_delay) == (3, 2.0)
    assert d.histogram() == {1: 2, 2: 4, 3: 2}
    assert d.per_stage()[0] == {"max": 3, "mean": 2.5, "count": 4}
    assert d.per_stage()[1] == {"max": 2, "mean": 1.5, "count": 4}
    assert d.per_stage("read_stage")[1] == {"max": 2, "mean": 1.5, "count": 4}


def test_gpipe_two_stages_by_hand() -> None:
    # One minibatch of 6: every forward runs before any update, so R(m, j) = 0. Stage 1's
    # single step (t = 13) is processed with k = 0, stage 0's (t = 14) with k = 1; each lists
    # all six microbatches. Steady m = 2, 3: stage 1 gives d = 0, 0, stage 0 gives 1, 1.
    d = delays_of("gpipe", 2, 6)
    assert (d.max_delay, d.mean_delay) == (1, 0.5)
    assert d.histogram() == {0: 4, 1: 4}


def test_replicas_update_once() -> None:
    # data-parallel, 2 workers, steps of 2: worker 0 runs F0 B0, worker 1 F1 B1; both step to
    # version 1 at t = 2 (one logical update, k = 0: d = 0 for mbs 0, 1), then F2 / F3 at t = 2
    # read R = 1, and the step to version 2 at t = 4 has k = 1: d = 1 - 1 = 0 for mbs 2, 3.
    # Counting worker 1's copy of each step as a second update would give mb 2 a delay of 1.
    d = delays_of("data-parallel", 1, 4, replicas=[2], chunks=2)
    assert [x.delay for x in d.delays] == [0, 0, 0, 0]


def rec(rank: int, index: int, token: str, start: float, end: float | None = None
        ) -> ActionRecord:
    return ActionRecord(rank, index, Action.parse(token), start, start,
                        start if end is None else end)


def test_tie_rule_an_update_is_seen_from_the_instant_it_ends() -> None:
    # Three stages, one per rank. Times are (start, end).
    records = [rec(0, 0, "0F0@0", 0, 1), rec(1, 0, "1F0@0", 1, 2), rec(2, 0, "2F0@0", 2, 3),
               rec(1, 1, "1U@1:0", 4, 5),    # an update that takes 4..5: visible at 5
               rec(2, 1, "2F1@0", 4.5, 5.5),  # starts while it runs: not seen, R(1,2) = 0
               rec(0, 1, "0F1@0", 5, 6),      # another rank, lower stage, starts at 5: seen
               rec(1, 2, "1F1@1", 5, 6),      # its own rank, after it: seen
               rec(1, 3, "1U@2:1", 7, 7),     # k = 1
               rec(0, 2, "0U@1:0", 8, 8), rec(2, 2, "2U@1:0", 8, 8),  # a tie: stage 0 first
               # zero-length forward then update on rank 0 at t = 9: the forward, earlier in
               # its rank's list, has not seen the update although both are at one instant
               rec(0, 3, "0F2@1", 9, 9), rec(0, 4, "0U@2:1", 9, 9),  # k = 4
               rec(1, 4, "1F2@2", 10, 11), rec(2, 3, "2F2@1", 11, 12),
               rec(2, 4, "2U@2:2", 12, 12)]   # k = 5
    d = weight_delays(records, num_stages=3, num_microbatches=3)
    got = {(x.microbatch, x.update_stage): [] for x in d.delays}
    for x in sorted(d.delays, key=lambda x: x.read_stage):
        got[(x.microbatch, x.update_stage)].append(x.delay)
    # R(0, j) = 0; R(1, .) = (1, 1, 0); R(2, .) = (4, 5, 5)
    assert got == {(0, 1): [0, 0, 0], (0, 0): [2, 2, 2], (0, 2): [3, 3, 3],
                   (1, 1): [0, 0, 1], (1, 0): [3, 3, 4], (2, 2): [1, 0, 0]}
    assert d.max_delay is None and d.histogram() == {}  # N = 3 <= 2S: no steady state
    # (Breaking a tie by stage index instead would put 0F1, stage 0, before 1U@1, stage 1.)
    with pytest.raises(ValueError, match="forward of microbatch 0 on stage 2"):
        weight_delays([r for r in records if r.action.to_text() != "2F0@0"], 3, 3)


@pytest.mark.parametrize("stages", [4, 7])
def test_steady_state_does_not_depend_on_the_number_of_microbatches(stages: int) -> None:
    got = {n: (d.max_delay, d.mean_delay) for n in (2 * stages + 1, 3 * stages, 5 * stages)
           for d in [delays_of("pipedream", stages, n)]}
    assert len(set(got.values())) == 1, got


def test_pipedream_delay_law_with_unit_costs() -> None:
    # The closed form derived in pipedream_fast.staleness: max S^2 - ceil(S/2), which is the
    # paper's S^2 - S/2 for even S and half a unit below it for odd S; mean
    # S^2/2 + S/4 - 1/2 - (S mod 2)/(4S). N = 2S + 2: two steady microbatches (the steady
    # state does not depend on N, above). S = 2..32 take about 5 s.
    for stages in range(2, 33):
        d = delays_of("pipedream", stages, 2 * stages + 2)
        most, mean = pipedream_unit_law(stages)
        assert d.max_delay == most == stages ** 2 - (stages + 1) // 2, stages
        assert d.mean_delay == pytest.approx(float(mean), abs=1e-12), stages
        assert abs(most - (stages ** 2 - stages / 2)) <= 0.5
        # the maximum is the update of stage 0 reading the stage-0 weights of its forward
        assert d.per_stage()[0]["max"] == most and d.per_stage("read_stage")[0]["max"] == most


# --- the runtime's trace --------------------------------------------------------------------

@pytest.mark.parametrize("name,kw", [("pipedream", {}), ("1f1b", {"chunks": 3}),
                                     ("data-parallel", {"replicas": [2], "chunks": 2}),
                                     ("localsgd", {})])
def test_trace_events_give_the_simulators_delays(name: str, kw: dict) -> None:
    stages = 1 if name == "data-parallel" else 3
    result = simulate(make_schedule(name, stages, 12, **kw), UnitCosts())
    events = events_from_simulation(result)
    assert len(records_from_events(events)) == sum(
        r.action.kind.value in ("forward", "optimizer_step") for r in result.records)
    assert trace_delays(events, stages, 12).delays == result.delays.delays
    # without the index the event carries: its position in its rank's events
    bare = [TraceEvent(e.rank, e.kind, e.start_ms, e.duration_ms, e.stage, e.microbatch,
                       e.version, {k: v for k, v in e.args.items() if k != "index"})
            for e in events]
    assert trace_delays(bare, stages, 12).delays == result.delays.delays


def test_a_traced_window_of_a_longer_run_has_the_steady_delays_of_its_simulation() -> None:
    # `train --trace` keeps the first N microbatches of a longer run (and the updates until
    # then); the simulation it is compared with runs N microbatches and drains.
    from pipedream_fast.fit import trace_window
    from pipedream_fast.run_report import traced_weight_delays, weight_delay_text
    long = simulate(make_schedule("pipedream", 3, 30), UnitCosts())
    window = trace_window(events_from_simulation(long), 10)
    short = simulate(make_schedule("pipedream", 3, 10), UnitCosts())
    got = trace_delays(window, 3, 10)
    assert sorted(got.steady, key=str) == sorted(short.delays.steady, key=str)
    report = traced_weight_delays([{"events": window}], short)
    assert report == {"steady_microbatches": [3, 7], "measured": {"max": 7, "mean": 14 / 3},
                      "simulated": {"max": 7, "mean": 14 / 3}}
    assert weight_delay_text(report).startswith("max 7, mean 4.67 (simulated: max 7, mean 4.67")
    assert traced_weight_delays([{"events": []}], short) is None


SLEEP_S = 0.01  # each forward and backward of a stage: the unit cost of the simulation


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_S)
        return grad


class Sleep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x)


def test_a_real_run_measures_the_simulated_delays() -> None:
    """PipeDream on 2 stages, each rank a thread (`LocalPipeline`), forwards and backwards
    made 10 ms long by sleeping (so the shared cores barely matter), updates and transfers
    fast: the unit-cost setting. The run's trace (`last_events`) goes through the same
    `weight_delays` and gives the simulated delays, every one of them.

    Why they must agree here, and may not elsewhere: a delay only depends on whether each
    update ended before or after each forward started. On one rank the list fixes that; across
    ranks the timing does. With 2 stages the unit-cost simulation has no cross-rank tie: every
    such pair is a unit (here 10 ms) apart, and the run keeps its order unless a rank stalls for
    that long. From 3 stages on the simulation has exact ties (stage s's update of m ends when
    stage s - 2's forward of m + 1 starts), which a real run breaks by chance; and a run whose
    compute times differ from the simulator's costs (another profile, a loaded machine) can
    reorder what the simulation does not tie."""
    from pipedream_fast.formats import Plan, StagePlan
    from pipedream_fast.local_pipeline import LocalPipeline

    chunks, batch, steps = 1, 4, 10
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), Sleep(), nn.Linear(8, 4), Sleep())
    plan = Plan(model="sleepy", batch_size=batch, workers=2, schedule="pipedream",
                stages=[StagePlan(0, 2, 1, (0,), 1.0), StagePlan(2, 4, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]
    pipe = LocalPipeline(net, nn.functional.cross_entropy,
                         lambda params: torch.optim.SGD(params, lr=0.1), plan,
                         schedule="pipedream", chunks=chunks, timeout=60, trace=True)
    assert len(list(pipe.train(data, steps))) == steps
    measured = trace_delays(pipe.last_events)
    simulated = simulate(make_schedule("pipedream", 2, steps * chunks), UnitCosts()).delays
    assert (measured.num_stages, measured.num_microbatches) == (2, 10)
    assert sorted(measured.delays, key=str) == sorted(simulated.delays, key=str)
    assert (measured.max_delay, measured.mean_delay) == (3, 2.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "pipedream-vsync", "2bw",
                                  "localsgd"])
def test_reports_are_complete(name: str) -> None:
    d = delays_of(name, 3, 12)
    assert d.max_delay is not None and d.max_delay >= 0
    lo, hi = d.steady_range
    assert {x.microbatch for x in d.steady} == set(range(lo, hi))
    assert sum(d.histogram().values()) == len(d.steady) == sum(
        v["count"] for v in d.per_stage().values())
    assert d.to_dict()["max_delay"] == d.max_delay
