"""Heterogeneous workers (per-rank speeds and memory): the planner against exhaustive search.

The search below enumerates, independently of the planner, every plan of the space
`planner/hetero.py` claims to be exact over: stages on consecutive ranks in rank order from
rank 0, trailing ranks possibly idle. It costs each with its own arithmetic: a stage computes at
its slowest rank's speed, all-reduces over the slowest link between any two of its ranks (ring,
2 (r-1) P / (r B)), a cut crosses the slowest link between any rank of one stage and any of the
next, and a replica's bytes at NOAM = ceil(ranks from the stage to the end / replicas) must fit
every one of its ranks. Topologies may have an inner level slower than an outer one: there the
slowest link of a group is not the one between its first and last rank (the DP once assumed it
was and reported plans cheaper than they are, --hypothesis-seed=8).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedream_fast.formats import BlockProfile, Plan, Profile
from pipedream_fast.planner import PlanningError, evaluate_plan, make_plan
from pipedream_fast.planner.choose import choose_schedule, predict
from pipedream_fast.planner.costs import Costs, MemoryModel
from pipedream_fast.planner.hetero import HeteroDP
from pipedream_fast.topology import Level, Topology
from test_planner import profiles

UNIT = 10**5  # bytes: transfers of ms at 1-25 GB/s, comparable to the compute times drawn


def hetero_profiles() -> st.SearchStrategy[Profile]:
    """Random profiles of 4 to 7 blocks (`test_planner.profiles`)."""
    return profiles(min_blocks=4, max_blocks=7)


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    shape = draw(st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (2, 2, 2)]))
    bandwidths = draw(st.lists(st.sampled_from([1e9, 4e9, 2.5e10]), min_size=len(shape),
                               max_size=len(shape)))
    workers = math.prod(shape)
    speeds = tuple(draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0]), min_size=workers,
                                 max_size=workers)))
    memories = None
    if draw(st.booleans()):
        memories = tuple(draw(st.lists(st.integers(500, 6000).map(lambda m: m * UNIT),
                                       min_size=workers, max_size=workers)))
    return Topology(tuple(Level(c, b) for c, b in zip(shape, bandwidths)), None, speeds, memories)


def compositions(total: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of positive integers summing to `total`."""
    for parts in range(1, total + 1):
        for cuts in itertools.combinations(range(1, total), parts - 1):
            bounds = (0,) + cuts + (total,)
            yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


Layout = tuple[int, list[list[int]], tuple[int, ...]]  # ranks used, stage ranks, block bounds


def layouts(blocks: int, topology: Topology, straight: bool) -> Iterator[Layout]:
    """Every plan of the space: stages on consecutive ranks from rank 0, in order."""
    for used in range(1, topology.workers + 1):
        for sizes in compositions(used):
            if (straight and any(r != 1 for r in sizes)) or len(sizes) > blocks:
                continue
            groups, w = [], 0
            for r in sizes:
                groups.append(list(range(w, w + r)))
                w += r
            for cuts in itertools.combinations(range(1, blocks), len(sizes) - 1):
                yield used, groups, (0,) + cuts + (blocks,)


def plan_cost(profile: Profile, topology: Topology, schedule: str, layout: Layout) -> float:
    """One plan's bottleneck (inf where a stage does not fit its ranks' memory)."""
    b = profile.blocks
    compute = [x.forward_ms + x.backward_ms for x in b]
    params = [x.parameter_bytes for x in b]
    state = [x.optimizer_state_bytes for x in b]
    saved = [x.extra["saved_bytes"] for x in b]
    overlap = profile.device.startswith("cuda")
    used, groups, bounds = layout
    worst = 0.0
    for k, ranks in enumerate(groups):
        a, z, r = bounds[k], bounds[k + 1], len(ranks)
        speed = min(topology.speeds[q] for q in ranks) if topology.speeds else 1.0
        bw = min((topology.bandwidth_between(p, q) for p in ranks for q in ranks if p != q),
                 default=math.inf)
        reduce = 2 * (r - 1) * sum(params[a:z]) / (r * bw) * 1e3 if r > 1 else 0.0
        work = sum(compute[a:z]) / speed
        worst = max(worst, (max(work, reduce) if overlap else work + reduce) / r)
        noam = -(-(used - ranks[0]) // r)
        # pipedream: NOAM versions and microbatches; 1f1b with one microbatch per step
        # (chunks = 1): one version, at most that one microbatch in flight.
        versions, flight = (noam, noam) if schedule == "pipedream" else (1, 1)
        need = (versions + 2) * sum(params[a:z]) + sum(state[a:z]) + flight * sum(saved[a:z])
        if topology.memories and need > min(topology.memories[q] for q in ranks):
            return math.inf
        if k + 1 < len(groups):
            link = min(topology.bandwidth_between(p, q) for p in ranks for q in groups[k + 1])
            worst = max(worst, 2 * b[z - 1].activation_bytes / link * 1e3)
    return worst


def brute_force(profile: Profile, topology: Topology, schedule: str, straight: bool) -> float:
    return min((plan_cost(profile, topology, schedule, layout)
                for layout in layouts(len(profile.blocks), topology, straight)), default=math.inf)


def check_returned_plans(solver: HeteroDP, profile: Profile, topology: Topology, schedule: str,
                         optimum: float) -> None:
    """Each plan the DP returns (the fastest, and the simplest within a margin) costs, by the
    search's own arithmetic, exactly what the DP reports for it: never less."""
    for margin in (0.0, 0.25):
        found = solver.simplest_plan(margin)
        assert found is not None
        reported, stages = found
        last = stages[-1]
        layout = (last.first_rank + last.replicas, [list(s.ranks) for s in stages],
                  tuple(s.start for s in stages) + (last.stop,))
        cost = plan_cost(profile, topology, schedule, layout)
        assert reported == pytest.approx(cost, rel=1e-9, abs=1e-12), (margin, layout)
        assert cost <= optimum * (1 + margin) * (1 + 1e-9) + 1e-12


@settings(max_examples=300, deadline=None)
@given(hetero_profiles(), topologies(), st.sampled_from(["pipedream", "1f1b"]), st.booleans())
def test_hetero_dp_equals_exhaustive_search(profile: Profile, topology: Topology, schedule: str,
                                           straight: bool) -> None:
    expected = brute_force(profile, topology, schedule, straight)
    solver = HeteroDP(Costs.from_profile(profile), topology, MemoryModel(schedule, None, 1),
                      straight)
    found = solver.best_time()
    assert found == pytest.approx(expected, rel=1e-9) or found == expected == math.inf
    if found == math.inf:
        assert solver.simplest_plan(0.0) is None
        return
    check_returned_plans(solver, profile, topology, schedule, expected)
    # make_plan plans with HeteroDP only on heterogeneous topologies (all speeds 1 and one
    # memory limit go to the hierarchical DP, a model of its own). The plan it builds costs
    # the optimum in the plan's own model, and re-costing it gives the same.
    if topology.heterogeneous:
        plan = make_plan(profile, topology, schedule=schedule, straight=straight, chunks=1,
                         margin=0.0)
        assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9)
        plan.validate()
        again = evaluate_plan(plan, profile, topology, chunks=1)
        assert again.bottleneck_ms == pytest.approx(plan.bottleneck_ms, rel=1e-9)


def test_a_group_across_levels_all_reduces_over_its_slowest_link() -> None:
    """--hypothesis-seed=8 shrunk: 2x2 with the inner level slower (1 GB/s) than the outer
    (4 GB/s). Ranks 1-3 cross 2-3 at 1 GB/s; the DP took their all-reduce at 4 GB/s (the link
    of rank 1 to the others), found [0, 1) on rank 0 + [1, 4) on ranks 1-3 at 1.478 ms, which
    costs 1.911 ms, below the true optimum, data parallelism on all 4 ranks at 1.4875 ms."""
    blocks = [BlockProfile(name=f"b{k}", forward_ms=0.0, backward_ms=float(k == 2),
                           activation_bytes=0, parameter_bytes=13 * UNIT if k == 2 else 0,
                           optimizer_state_bytes=0, extra={"saved_bytes": 0}) for k in range(4)]
    profile = Profile(model="random", batch_size=4, device="cpu", blocks=blocks)
    topology = Topology((Level(2, 1e9), Level(2, 4e9)), None, (0.25,) * 4)
    assert brute_force(profile, topology, "pipedream", False) == pytest.approx(1.4875)
    solver = HeteroDP(Costs.from_profile(profile), topology, MemoryModel("pipedream"))
    assert solver.best_time() == pytest.approx(1.4875)
    plan = make_plan(profile, topology, margin=0.0)
    assert layout(plan) == [(0, 4, (0, 1, 2, 3))]
    assert plan.bottleneck_ms == pytest.approx(1.4875)
    old = dataclasses.replace(plan, stages=[
        dataclasses.replace(plan.stages[0], stop=1, replicas=1, ranks=(0,)),
        dataclasses.replace(plan.stages[0], start=1, replicas=3, ranks=(1, 2, 3))])
    assert evaluate_plan(old, profile, topology).bottleneck_ms == pytest.approx(1.9111111)


def test_a_plan_choice_between_free_plans() -> None:
    """Identical workers, a profile that costs nothing: the fastest (0 ms) and the chosen plan
    differ, and the report's 'slower than the fastest' divided by 0 (ZeroDivisionError)."""
    profile = even_profile(4, ms=0.0)
    plan = make_plan(profile, Topology.parse("2x1e9"), margin=0.0)
    choice = plan.extra["plan_choice"]
    assert choice["fastest_ms"] == choice["chosen_ms"] == 0.0
    assert "0.0% slower" in choice["why"]


def even_profile(blocks: int, ms: float = 10.0) -> Profile:
    return Profile(model="even", batch_size=4, device="cpu", blocks=[
        BlockProfile(name=f"b{k}", forward_ms=ms / 2, backward_ms=ms / 2, activation_bytes=0,
                     parameter_bytes=UNIT, optimizer_state_bytes=0, extra={"saved_bytes": 0})
        for k in range(blocks)])


def layout(plan: Plan) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(s.start, s.stop, tuple(s.ranks)) for s in plan.stages]


@pytest.mark.parametrize("speeds, expected", [
    ("1,0.5", [(0, 4, (0,)), (4, 6, (1,))]),
    ("0.5,1", [(0, 2, (0,)), (2, 6, (1,))]),
])
def test_a_slow_worker_gets_fewer_blocks(speeds: str, expected: list) -> None:
    # 6 blocks of 10 ms on a fast and a half-speed worker: 4 + 2 blocks take 40 ms a stage,
    # against 60 ms for data parallelism (in lockstep at the slow worker's pace) or one worker.
    plan = make_plan(even_profile(6), Topology.parse(f"2x1e12@speeds={speeds}"))
    assert layout(plan) == expected
    assert plan.bottleneck_ms == pytest.approx(40.0, rel=1e-3)
    assert plan.extra["topology"]["speeds"] == [float(s) for s in speeds.split(",")]


def test_identical_workers_plan_as_before() -> None:
    profile = even_profile(6)
    for text in ("4x1e9", "2x1e10,2x1e9"):
        before = make_plan(profile, Topology.parse(text, memory_per_worker=10 * UNIT))
        same = make_plan(profile, Topology.parse(f"{text}@speeds=1,1,1,1@memory=" +
                                                 ",".join([str(10 * UNIT)] * 4)))
        assert layout(same) == layout(before)
        assert same.bottleneck_ms == before.bottleneck_ms


def test_a_worker_with_little_memory_gets_a_stage_that_fits() -> None:
    # One worker: everything fits at NOAM 1 (3 x 6 params: live, one version slot, gradients).
    # Two workers straight: stage 0 at NOAM 2 keeps 4 x its parameters. Rank 1 holds only 2
    # blocks' worth at NOAM 1 (3 x 2).
    profile = even_profile(6)
    topology = Topology.parse(f"2x1e12@memory={100 * UNIT},{6 * UNIT}")
    plan = make_plan(profile, topology, straight=True)
    assert layout(plan) == [(0, 4, (0,)), (4, 6, (1,))]
    limits = topology.memories
    assert limits is not None
    for stage in plan.stages:
        assert stage.extra["memory_bytes"] <= min(limits[r] for r in stage.ranks)
    roomy = make_plan(profile, Topology.parse(f"2x1e12@memory={100 * UNIT},{100 * UNIT}"),
                      straight=True)
    assert layout(roomy) == [(0, 3, (0,)), (3, 6, (1,))]


def test_no_plan_fits_the_workers_memory_is_a_clear_error() -> None:
    with pytest.raises(PlanningError, match=r"no plan fits the workers' memory limits "
                                            r"\[100000, 200000\].*needs 300000 bytes"):
        make_plan(even_profile(4), Topology.parse(f"2x1e12@memory={UNIT},{2 * UNIT}"))
    # Equal limits are one limit: the identical-workers planner names the smallest requirement.
    with pytest.raises(PlanningError, match="raise --memory-per-worker to at least 800000"):
        make_plan(even_profile(4), Topology.parse(f"2x1e12@memory={UNIT},{UNIT}"))


def test_baselines_respect_per_worker_memory() -> None:
    with pytest.raises(PlanningError, match=r"ranks \[1\] hold"):
        make_plan(even_profile(6), Topology.parse(f"2x1e12@memory={100 * UNIT},{2 * UNIT}"),
                  strategy="uniform", straight=True)


def test_interleaved_plans_refuse_heterogeneous_workers() -> None:
    with pytest.raises(PlanningError, match="heterogeneous"):
        make_plan(even_profile(8), Topology.parse("2x1e9@speeds=1,0.5"), stages_per_rank=2)


def test_hetero_dp_equals_exhaustive_search_across_groups() -> None:
    """Seeded instances on two- and three-level topologies where transfers are dear, so the
    slowest link between two stages' ranks (which may sit in different groups) decides the
    optimum; half of them have an inner level slower than an outer one, where that link is not
    the one between the extreme ranks (the cut's halves range over whole stages)."""
    rng = random.Random(20)
    for case in range(120):
        shape = rng.choice([(2, 2), (3, 2), (2, 3), (2, 2, 2)])
        workers = math.prod(shape)
        bandwidths = [rng.choice([1e9, 4e9, 2.5e10]) for _ in shape]
        if case % 2 == 0:
            bandwidths.sort(reverse=True)  # the usual: outer levels no faster than inner
        topology = Topology(tuple(Level(c, b) for c, b in zip(shape, bandwidths)), None,
                            tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(workers)))
        blocks = [BlockProfile(name=f"b{k}", forward_ms=rng.randint(0, 6),
                               backward_ms=rng.randint(0, 6),
                               activation_bytes=rng.randint(0, 100) * UNIT,
                               parameter_bytes=rng.randint(0, 50) * UNIT,
                               optimizer_state_bytes=0, extra={"saved_bytes": 0})
                  for k in range(rng.randint(4, 6))]
        profile = Profile(model="random", batch_size=4, device=rng.choice(["cpu", "cuda"]),
                          blocks=blocks)
        straight = rng.random() < 0.3
        expected = brute_force(profile, topology, "pipedream", straight)
        solver = HeteroDP(Costs.from_profile(profile), topology, MemoryModel("pipedream"),
                          straight)
        assert solver.best_time() == pytest.approx(expected, rel=1e-9), (topology, profile)
        check_returned_plans(solver, profile, topology, "pipedream", expected)


def test_the_schedule_choice_simulates_the_workers_speeds() -> None:
    # Data parallelism runs at the quarter-speed worker's pace (6 x 10 ms / 0.25 / 2 = 120 ms a
    # microbatch); the simulator must see that too, or it would prefer it to the pipeline.
    profile, topology = even_profile(6), Topology.parse("2x1e12@speeds=1,0.25")
    plan = choose_schedule(profile, topology)
    assert layout(plan) == [(0, 5, (0,)), (5, 6, (1,))]
    steady = profile.batch_size / plan.bottleneck_ms * 1e3
    assert predict(profile, plan, plan.schedule) == pytest.approx(steady, rel=0.1)
