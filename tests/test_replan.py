"""Re-planning from measured speeds (`planner/replan.py`): the speeds read from calibration
snapshots, the decision to move or stay, and the plan moved to against exhaustive search.

Snapshots are synthetic: a rank `slowdown` times slower than the profile measures each of its
stages' forward and backward at the profiled time (scaled to the microbatch) times `slowdown`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from pipedream_fast.formats import BlockProfile, Plan, Profile, StagePlan
from pipedream_fast.planner import evaluate_plan, make_plan
from pipedream_fast.planner.choose import plan_for
from pipedream_fast.planner.replan import (Replan, calibrated_profile, measured_speeds, replan,
                                           state_bytes)
from pipedream_fast.runtime.calibration import CalibrationSnapshot, Estimate
from pipedream_fast.topology import Topology
from test_planner_hetero import layouts

BATCH = 32
PARAMS, OPTIMIZER = 4000, 8000  # bytes per block


def profile_of(ms: Sequence[float]) -> Profile:
    """Blocks of `ms` compute each (a third forward, two thirds backward), tiny transfers."""
    blocks = [BlockProfile(f"b{k}", m / 3, 2 * m / 3, 1000, PARAMS, OPTIMIZER)
              for k, m in enumerate(ms)]
    return Profile("toy", BATCH, "cpu", blocks)


def hand_plan(profile: Profile, stages: Sequence[tuple[int, int, tuple[int, ...]]],
              schedule: str = "1f1b") -> Plan:
    workers = len({r for _, _, ranks in stages for r in ranks})
    return Plan(profile.model, profile.batch_size, workers, schedule,
                [StagePlan(a, b, len(ranks), ranks, 0.0) for a, b, ranks in stages], 0.0, 0.0)


def stages_of(plan: Plan) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(s.start, s.stop, tuple(s.ranks)) for s in plan.stages]


def snapshots(profile: Profile, plan: Plan, slowdown: Sequence[float], microbatch: int = 8,
              split: bool = False, factor: float = 1.0) -> dict[int, CalibrationSnapshot]:
    """What each rank would measure running `slowdown[rank]` times slower than profiled
    (`factor` more on every rank); `split`: backwards as input + weight parts (zb-h1)."""
    scale = microbatch / profile.batch_size * factor / 1e3  # profile ms -> measured s
    out = {}
    for rank in range(plan.workers):
        actions: dict[tuple[str, int | None], Estimate] = {}
        for s in plan.stages_of_rank(rank):
            blocks = profile.blocks[plan.stages[s].start:plan.stages[s].stop]
            f = sum(b.forward_ms for b in blocks) * scale * slowdown[rank]
            b = sum(b.backward_ms for b in blocks) * scale * slowdown[rank]
            actions[("forward", s)] = Estimate(f, 40)
            if split:
                actions[("backward_input", s)] = Estimate(0.4 * b, 40)
                actions[("backward_weight", s)] = Estimate(0.6 * b, 40)
            else:
                actions[("backward", s)] = Estimate(b, 40)
        actions[("optimizer_step", 0)] = Estimate(1.0, 4)  # not compute: ignored
        out[rank] = CalibrationSnapshot(rank=rank, actions=actions)
    return out


def decide(profile: Profile, plan: Plan, slowdown: Sequence[float],
           snaps: Mapping[int, CalibrationSnapshot] | None = None, microbatch_size: int = 8,
           step_seconds: float = 0.1, move_seconds: float = 0.5, chunks: int = 4,
           **kw: Any) -> Replan:
    """`replan` on what ranks `slowdown` times slower measure (or on `snaps`)."""
    if snaps is None:
        snaps = snapshots(profile, plan, slowdown, microbatch=microbatch_size)
    return replan(profile, plan, snaps, microbatch_size=microbatch_size, chunks=chunks,
                  step_seconds=step_seconds, move_seconds=move_seconds, **kw)


def at_speeds(plan: Plan, speeds: Sequence[float]) -> Topology:
    return dataclasses.replace(Topology.parse(f"{plan.workers}x1e9"), speeds=tuple(speeds))


EIGHT = profile_of([3.0] * 8)


def straight(profile: Profile, workers: int) -> Plan:
    return make_plan(profile, Topology.parse(f"{workers}x1e9"), schedule="1f1b", straight=True,
                     chunks=4)


# --- the decision --------------------------------------------------------------------------------

def test_equal_speeds_on_a_balanced_plan_stay():
    plan = straight(EIGHT, 2)
    assert stages_of(plan) == [(0, 4, (0,)), (4, 8, (1,))]
    d = decide(EIGHT, plan, [1.0, 1.0])
    assert d.plan is None and d.speeds is not None
    assert d.speeds == pytest.approx((1.0, 1.0))
    assert d.gain == 0.0 and d.current_ms == pytest.approx(12.0, rel=1e-3)
    assert "already the best" in d.reason and "same speed" in d.reason


def test_a_slow_rank_gives_up_a_block():
    plan = straight(EIGHT, 2)
    d = decide(EIGHT, plan, [1.0, 1.5])
    assert d.speeds == pytest.approx((1.0, 2 / 3))
    assert d.plan is not None
    new = d.plan
    assert stages_of(new) == [(0, 5, (0,)), (5, 8, (1,))]  # rank 1 holds fewer blocks
    assert new.stages[0].ranks == plan.stages[0].ranks and new.workers == plan.workers
    assert new.schedule == plan.schedule == "1f1b"
    assert d.best_ms is not None and d.current_ms is not None
    assert d.best_ms < d.current_ms
    assert d.current_ms == pytest.approx(18.0, rel=1e-3)  # 12 ms of blocks at 2/3 speed
    assert d.best_ms == pytest.approx(15.0, rel=1e-3)
    assert d.gain == pytest.approx(1 - 15 / 18, rel=1e-3)
    assert "rank 1 runs at 0.67x" in d.reason
    assert "moving block 4 from rank 1 to rank 0" in d.reason and "paid back" in d.reason
    json.dumps(d.to_dict())  # JSON-able, plan included
    assert d.to_dict()["plan"]["schedule"] == "1f1b"
    assert Plan.from_dict(d.to_dict()["plan"]).stages[0].stop == 5


def test_a_slow_first_rank_gives_blocks_to_the_next():
    plan = straight(EIGHT, 2)
    d = decide(EIGHT, plan, [1.5, 1.0])
    assert d.speeds == pytest.approx((2 / 3, 1.0))
    assert d.plan is not None and stages_of(d.plan) == [(0, 3, (0,)), (3, 8, (1,))]


Stages = list[tuple[int, int, tuple[int, ...]]]


def every_plan(blocks: int, workers: int, first: int, straight: bool) -> list[Stages]:
    """Every plan on all `workers` ranks with stages on consecutive ranks in rank order, the
    first stage on ranks 0..first-1 (one rank per stage if `straight`)."""
    return [[(a, b, tuple(g)) for (a, b), g in zip(zip(bounds, bounds[1:]), groups)]
            for used, groups, bounds in layouts(blocks, Topology.parse(f"{workers}x1e9"),
                                                straight)
            if used == workers and len(groups[0]) == first]


def exhaustive(profile: Profile, plan: Plan, speeds: Sequence[float]
               ) -> tuple[float, int]:
    """The least bottleneck over `every_plan` (costed by `evaluate_plan` at `speeds`), and the
    fewest bytes of state a move from `plan` to a plan at that bottleneck sends."""
    topology = at_speeds(plan, speeds)
    straight = all(len(s.ranks) == 1 for s in plan.stages)
    costed = []
    for stages in every_plan(len(profile.blocks), plan.workers, len(plan.stages[0].ranks),
                             straight):
        candidate = hand_plan(profile, stages)
        costed.append((evaluate_plan(candidate, profile, topology, 4).bottleneck_ms,
                       state_bytes(profile, plan, candidate)))
    best = min(ms for ms, _ in costed)
    return best, min(b for ms, b in costed if ms <= best * (1 + 1e-9))


def check_against_exhaustive(profile: Profile, plan: Plan, slowdown: Sequence[float]) -> None:
    d = decide(profile, plan, slowdown, threshold=0.0, move_seconds=0.0)
    assert d.speeds is not None and d.best_ms is not None
    best_ms, least_moved = exhaustive(profile, plan, d.speeds)
    assert d.best_ms == pytest.approx(best_ms, rel=1e-9), d.reason
    if d.plan is not None:  # moved: to a plan on every rank at the optimum, moving least
        assert d.plan.workers == plan.workers
        assert d.plan.stages[0].ranks == plan.stages[0].ranks
        again = evaluate_plan(d.plan, profile, at_speeds(plan, d.speeds), 4)
        assert again.bottleneck_ms == pytest.approx(best_ms, rel=1e-9)
        assert state_bytes(profile, plan, d.plan) == least_moved
    else:  # stayed: the current plan is as fast
        assert d.current_ms == pytest.approx(best_ms, rel=1e-9), d.reason
        assert least_moved == 0


@pytest.mark.parametrize("workers", [2, 3])
def test_the_plan_moved_to_is_the_exhaustive_best(workers):
    rng = random.Random(workers)
    for _ in range(12):
        profile = profile_of([float(rng.randint(1, 9)) for _ in range(rng.randint(workers, 8))])
        cuts = sorted(rng.sample(range(1, len(profile.blocks)), workers - 1))
        bounds = [0, *cuts, len(profile.blocks)]
        plan = hand_plan(profile, [(a, b, (k,)) for k, (a, b) in enumerate(zip(bounds,
                                                                                bounds[1:]))])
        check_against_exhaustive(profile, plan,
                                 [rng.choice([1.0, 1.25, 1.5, 2.0, 3.0]) for _ in range(workers)])


def test_replicated_plans_move_to_the_exhaustive_best_keeping_the_first_stage():
    rng = random.Random(7)
    for _ in range(10):
        profile = profile_of([float(rng.randint(1, 9)) for _ in range(rng.randint(3, 6))])
        end = len(profile.blocks)
        plan = hand_plan(profile, rng.choice([[(0, 1, (0, 1)), (1, 2, (2,)), (2, end, (3,))],
                                              [(0, 2, (0,)), (2, end, (1, 2, 3))]]))
        check_against_exhaustive(profile, plan,
                                 [rng.choice([1.0, 1.5, 2.0, 4.0]) for _ in range(4)])


def test_equally_fast_plans_prefer_the_current_one_then_the_least_moved():
    # rank 1 at half speed: 5 | 3 and 6 | 2 blocks both take 18 ms
    four = hand_plan(EIGHT, [(0, 4, (0,)), (4, 8, (1,))])
    d = decide(EIGHT, four, [1.0, 2.0])
    assert d.plan is not None and stages_of(d.plan) == [(0, 5, (0,)), (5, 8, (1,))]
    assert state_bytes(EIGHT, four, d.plan) == PARAMS + OPTIMIZER
    for kept in ([(0, 5, (0,)), (5, 8, (1,))], [(0, 6, (0,)), (6, 8, (1,))]):
        d = decide(EIGHT, hand_plan(EIGHT, kept), [1.0, 2.0], threshold=0.0, move_seconds=0.0)
        assert d.plan is None and "already the best" in d.reason
        assert d.best_ms == d.current_ms == pytest.approx(18.0, rel=1e-3)


def test_a_small_gain_stays_under_the_threshold():
    # 13 | 13 ms; rank 1 1.05x slower: moving the 0.3 ms block 3 gains about 2.3%
    profile = profile_of([6.0, 6.7, 0.3, 0.3, 6.7, 6.0])
    plan = hand_plan(profile, [(0, 3, (0,)), (3, 6, (1,))])
    d = decide(profile, plan, [1.0, 1.05])
    assert d.plan is None and 0 < d.gain < 0.1
    assert "threshold" in d.reason and "10%" in d.reason and "block 3" in d.reason
    assert d.best_ms is not None and d.current_ms is not None and d.best_ms < d.current_ms
    moved = decide(profile, plan, [1.0, 1.05], threshold=0.02, move_seconds=0.1)
    assert moved.plan is not None and stages_of(moved.plan)[0] == (0, 4, (0,))


def test_a_move_that_does_not_pay_back_stays():
    plan = straight(EIGHT, 2)
    d = decide(EIGHT, plan, [1.0, 1.5], move_seconds=1e4)
    assert d.plan is None and d.gain == pytest.approx(1 / 6, rel=1e-3)
    assert "payback" in d.reason and "200 steps" in d.reason
    # 0.1 s steps saving 1/6: a move of 3 s pays back in 180 steps, 4 s in 240
    assert decide(EIGHT, plan, [1.0, 1.5], move_seconds=3.0).plan is not None
    assert decide(EIGHT, plan, [1.0, 1.5], move_seconds=4.0).plan is None
    assert decide(EIGHT, plan, [1.0, 1.5], move_seconds=4.0, payback_steps=300).plan is not None


def test_missing_measurements_stay_without_speeds():
    plan = straight(EIGHT, 2)
    snaps = snapshots(EIGHT, plan, [1.0, 1.5])

    def rank1(**change: Estimate | None) -> dict[int, CalibrationSnapshot]:
        actions = dict(snaps[1].actions)
        for kind, estimate in change.items():
            if estimate is None:
                del actions[(kind, 1)]
            else:
                actions[(kind, 1)] = estimate
        return {0: snaps[0], 1: CalibrationSnapshot(rank=1, actions=actions)}

    cases = [({0: snaps[0]}, "rank 1 has no calibration snapshot"),
             (rank1(backward=None), "rank 1 has no backward of stage 1"),
             (rank1(forward=None), "rank 1 has no forward of stage 1"),
             (rank1(forward=Estimate(math.nan, 3)), "invalid forward"),
             (rank1(backward=Estimate(-1.0, 3)), "invalid backward"),
             (rank1(forward=Estimate(math.inf, 3)), "invalid forward"),
             (rank1(forward=Estimate(0.0, 3), backward=Estimate(0.0, 3)), "no compute time")]
    for given, why in cases:
        assert measured_speeds(EIGHT, plan, given, 8) is None, why
        d = decide(EIGHT, plan, [], snaps=given)
        assert (d.plan, d.speeds, d.current_ms, d.best_ms, d.gain) == (None, None, None, None,
                                                                      0.0)
        assert "not enough measurements" in d.reason and why in d.reason, d.reason


def test_speeds_do_not_depend_on_the_microbatch_or_a_common_factor():
    plan = straight(EIGHT, 2)
    base = measured_speeds(EIGHT, plan, snapshots(EIGHT, plan, [1.0, 1.5]), 8)
    assert base == pytest.approx((1.0, 2 / 3))
    for microbatch, factor in ((32, 1.0), (8, 2.5), (4, 0.3)):
        snaps = snapshots(EIGHT, plan, [1.0, 1.5], microbatch=microbatch, factor=factor)
        assert measured_speeds(EIGHT, plan, snaps, microbatch) == pytest.approx(base)
        d = decide(EIGHT, plan, [], snaps=snaps, microbatch_size=microbatch)
        assert d.plan is not None and stages_of(d.plan) == [(0, 5, (0,)), (5, 8, (1,))]
        assert d.best_ms == pytest.approx(15.0, rel=1e-3)


def test_split_backwards_count_as_the_backward():
    profile = EIGHT
    plan = plan_for("zb-h1", profile, Topology.parse("2x1e9"), straight=True, chunks=4)
    plan.schedule = "zb-h1"
    split = snapshots(profile, plan, [1.0, 1.5], split=True)
    assert ("backward", 1) not in split[1].actions
    speeds = measured_speeds(profile, plan, split, 8)
    assert speeds == pytest.approx((1.0, 2 / 3))
    assert speeds == pytest.approx(measured_speeds(profile, plan,
                                                   snapshots(profile, plan, [1.0, 1.5]), 8))
    d = decide(profile, plan, [], snaps=split)
    assert d.plan is not None and d.plan.schedule == "zb-h1"
    assert stages_of(d.plan) == [(0, 5, (0,)), (5, 8, (1,))]
    # only the input part measured: the backward is not known yet
    partial = {k: v for k, v in split[1].actions.items() if k[0] != "backward_weight"}
    assert measured_speeds(profile, plan, {0: split[0], 1: CalibrationSnapshot(1, partial)},
                           8) is None


def test_a_replicated_first_stage_keeps_its_ranks():
    # stage 0 on ranks 0,1 (6 ms each), stages on ranks 2 and 3 (6 ms each); rank 3 halves.
    plan = hand_plan(EIGHT, [(0, 4, (0, 1)), (4, 6, (2,)), (6, 8, (3,))])
    d = decide(EIGHT, plan, [1.0, 1.0, 1.0, 2.0])
    assert d.speeds == pytest.approx((1.0, 1.0, 1.0, 0.5))
    assert d.plan is not None, d.reason
    # The fastest plan (7 ms) replicates the first stage on ranks 0-2; the fastest that
    # keeps it on 0,1 gives them 5 blocks (7.5 ms), rank 2 two, rank 3 one.
    assert stages_of(d.plan) == [(0, 5, (0, 1)), (5, 7, (2,)), (7, 8, (3,))]
    assert d.current_ms == pytest.approx(12.0, rel=1e-3)
    assert d.best_ms == pytest.approx(7.5, rel=1e-3)
    assert "ranks 0-2 instead of ranks 0,1" in d.reason


def test_a_plan_moving_the_loader_elsewhere_is_refused():
    # The first stage on ranks 0 and 2: no plan of the planner's (stages on consecutive ranks)
    # keeps it there, so the decision stays and says why.
    plan = hand_plan(EIGHT, [(0, 4, (0, 2)), (4, 6, (1,)), (6, 8, (3,))])
    d = decide(EIGHT, plan, [1.0, 1.0, 1.0, 2.0])
    assert d.plan is None
    assert "data loader" in d.reason and "instead of ranks 0,2" in d.reason
    assert d.best_ms is not None and d.current_ms is not None and d.best_ms < d.current_ms


def test_a_plan_leaving_a_rank_idle_is_replaced_by_the_best_on_every_rank():
    # rank 2 at a tenth of the speed: the fastest plan leaves it idle, which a move cannot
    plan = hand_plan(EIGHT, [(0, 3, (0,)), (3, 6, (1,)), (6, 8, (2,))])
    d = decide(EIGHT, plan, [1.0, 1.0, 10.0])
    assert d.plan is not None and d.plan.workers == 3
    # of the plans at 30 ms (rank 2's one block), the one moving only block 6 from rank 2
    assert stages_of(d.plan) == [(0, 3, (0,)), (3, 7, (1,)), (7, 8, (2,))]
    assert d.best_ms == pytest.approx(30.0, rel=1e-3) and d.current_ms == pytest.approx(60.0,
                                                                                        rel=1e-3)
    assert "uses 2 of the 3 ranks" in d.reason


def test_schedules_the_planner_cannot_replan_at_speed_stay():
    # interleaved plans are not planned for heterogeneous workers
    plan = plan_for("interleaved-1f1b", EIGHT, Topology.parse("2x1e9"))
    plan.schedule = "interleaved-1f1b"
    d = decide(EIGHT, plan, [1.0, 1.5])
    assert d.plan is None and d.speeds == pytest.approx((1.0, 2 / 3))
    assert "no plan at the measured speeds" in d.reason
    # data parallel stays data parallel: nothing to move
    plan = plan_for("data-parallel", EIGHT, Topology.parse("2x1e9"))
    plan.schedule = "data-parallel"
    d = decide(EIGHT, plan, [1.0, 1.5])
    assert d.plan is None and "already the best" in d.reason


def test_invalid_arguments_raise():
    plan = straight(EIGHT, 2)
    for bad in ({"chunks": 0}, {"step_seconds": -1.0}, {"move_seconds": math.nan},
                {"threshold": 1.0}, {"microbatch_size": 0},
                {"topology": Topology.parse("3x1e9")}):
        with pytest.raises(ValueError):
            decide(EIGHT, plan, [1.0, 1.0], **bad)


def test_a_given_topology_keeps_its_links_and_takes_the_measured_speeds():
    plan = straight(EIGHT, 2)
    given = Topology.parse("2x1e9@speeds=0.1,0.1")  # its speeds are replaced
    d = decide(EIGHT, plan, [1.0, 1.5], topology=given)
    assert d.plan is not None and d.plan.extra["topology"]["speeds"] == pytest.approx([1, 2 / 3])


# --- state_bytes ---------------------------------------------------------------------------------

def test_state_bytes_counts_what_the_new_holders_receive():
    per_block = PARAMS + OPTIMIZER
    old = hand_plan(EIGHT, [(0, 4, (0,)), (4, 8, (1,))])
    assert state_bytes(EIGHT, old, old) == 0
    assert state_bytes(EIGHT, old, hand_plan(EIGHT, [(0, 5, (0,)), (5, 8, (1,))])) == per_block
    assert state_bytes(EIGHT, old, hand_plan(EIGHT, [(0, 2, (0,)), (2, 8, (1,))])) \
        == 2 * per_block
    four = hand_plan(EIGHT, [(0, 4, (0, 1)), (4, 6, (2,)), (6, 8, (3,))])
    moved = hand_plan(EIGHT, [(0, 5, (0, 1, 2)), (5, 8, (3,))])
    # blocks 0-3 gain rank 2, block 4 ranks 0 and 1, block 5 rank 3; blocks 6-7 stay on 3
    assert state_bytes(EIGHT, four, moved) == per_block * (4 + 2 + 1)


# --- the baseline: the profile scaled to the run's own measurements ------------------------------

def test_a_calibrated_profile_makes_every_rank_run_at_one_and_scales_each_stage_alike():
    plan = straight(EIGHT, 2)
    # rank 1's stage measures 3x what the profile says (say, overheads the profile missed)
    snaps = snapshots(EIGHT, plan, [1.0, 3.0])
    calibrated = calibrated_profile(EIGHT, plan, snaps, 8)
    assert not isinstance(calibrated, str)
    assert [b.forward_ms + b.backward_ms for b in calibrated.blocks] == \
        pytest.approx([3.0] * 4 + [9.0] * 4)
    same = decide(calibrated, plan, [1.0, 1.0], snaps=snaps)
    assert same.speeds == pytest.approx((1.0, 1.0))
    # the profile's balanced split is not balanced as the blocks run: a block moves to rank 0
    # (rank 1's stage, not its speed, was the slow part)
    assert same.plan is not None and stages_of(same.plan)[0] == (0, 5, (0,))
    assert same.current_ms == pytest.approx(36.0) and same.best_ms == pytest.approx(27.0)
    # rank 1 then slows 1.5x: a move, costed with the calibrated blocks (rank 1's cost 9 ms)
    later = decide(calibrated, plan, [1.0, 4.5], snaps=snapshots(EIGHT, plan, [1.0, 4.5]))
    assert later.speeds == pytest.approx((1.0, 2 / 3))
    assert later.plan is not None and later.plan.stages[0].stop == 6  # 30 vs 27 ms


def test_a_calibrated_profile_needs_every_stage_measured():
    plan = straight(EIGHT, 2)
    snaps = snapshots(EIGHT, plan, [1.0, 1.0])
    del snaps[1]
    assert "rank 1 has no calibration snapshot" in calibrated_profile(EIGHT, plan, snaps, 8)


def test_a_plan_from_a_manual_split_replans_with_the_profile_of_its_blocks():
    """A plan made from balance= names the model's class and batch size 0."""
    plan = dataclasses.replace(straight(EIGHT, 2), model="Sequential", batch_size=0)
    d = decide(EIGHT, plan, [1.0, 1.5])
    assert d.plan is not None and d.plan.stages[0].stop > 4
