"""Weight delays, measured on simulated timelines, checked against small cases worked out by
hand (the derivations are in the comments) and against the growth PipeDream's theory predicts."""

from __future__ import annotations

import pytest

from pipedream_fast.ir import Action
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import ActionRecord, UnitCosts, simulate
from pipedream_fast.staleness import weight_delays


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


def test_ties_by_stage_then_list_order() -> None:
    def rec(rank: int, index: int, token: str, start: float) -> ActionRecord:
        return ActionRecord(rank, index, Action.parse(token), start, start, start)

    records = [rec(1, 0, "1F0@0", 0.0), rec(0, 0, "0F0@0", 0.0), rec(2, 0, "2F0@0", 0.0),
               rec(1, 1, "1U@1:0", 5.0),   # same time as the forwards below
               rec(0, 1, "0F1@0", 5.0),    # stage 0 < 1: processed before the update, R = 0
               rec(2, 1, "2F1@0", 5.0),    # stage 2 > 1: processed after it, R = 1
               rec(1, 2, "1F1@1", 5.0),    # stage 1, later in rank 1's list: R = 1
               rec(1, 3, "1U@2:1", 6.0), rec(0, 2, "0U@1:0-1", 7.0), rec(2, 2, "2U@1:0-1", 7.0)]
    d = weight_delays(records, num_stages=3, num_microbatches=2)
    got = {(x.microbatch, x.update_stage, x.read_stage): x.delay for x in d.delays}
    # k: 1U@1 -> 0, 1U@2 -> 1, 0U@1 -> 2, 2U@1 -> 3 (ties at t=7: stage 0 first)
    assert got[(1, 1, 0)] == 1 - 0 and got[(1, 1, 1)] == 1 - 1 and got[(1, 1, 2)] == 1 - 1
    assert got[(0, 0, 0)] == 2 and got[(1, 0, 0)] == 2 and got[(1, 0, 2)] == 2 - 1
    assert got[(1, 2, 1)] == 3 - 1
    assert d.max_delay is None and d.histogram() == {}  # N = 2 <= 2S: no steady state
    with pytest.raises(ValueError, match="forward of microbatch 0 on stage 2"):
        weight_delays([r for r in records if r.action.to_text() != "2F0@0"], 3, 2)


def test_pipedream_delay_grows_with_depth() -> None:
    # The theory paper: steady-state delay grows like S^2 - S/2 + O(1). Measured here with unit
    # costs for S = 2..6: 3, 8, 15, 24, 35 (= S^2 - 1). The test only requires growth that is
    # faster than linear; the exact second-order term is reported, not forced.
    measured = [delays_of("pipedream", s, 8 * s).max_delay for s in range(2, 7)]
    steps = [b - a for a, b in zip(measured, measured[1:])]
    assert all(x > 0 for x in steps) and steps == sorted(steps) and steps[-1] > steps[0]


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
