"""Planner tests: the dynamic program against exhaustive search, plus layout and baselines.

The exhaustive searches below are written independently of the planner, straight from the cost
model in issue 3 (flat) and PipeDream §3.1 (hierarchical): they enumerate every plan, evaluate
it with their own arithmetic, and keep the minimum bottleneck.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedream_fast.formats import BlockProfile, Profile
from pipedream_fast.planner import PlanningError, evaluate_plan, make_plan
from pipedream_fast.planner.baselines import balanced_partition, uniform_partition
from pipedream_fast.planner.costs import Costs, MemoryModel
from pipedream_fast.planner.dp import HierarchicalDP
from pipedream_fast.topology import Level, Topology

SETTINGS = settings(max_examples=100, deadline=None)
# Memory bugs only show when the limit binds at one particular stage: search harder there.
SETTINGS_MEMORY = settings(max_examples=300, deadline=None)
UNIT = 10**5  # bytes: makes transfers (ms at 1-25 GB/s) comparable to the compute times drawn


# ---- instances -------------------------------------------------------------------------------

@st.composite
def profiles(draw: st.DrawFn, max_blocks: int = 5, min_blocks: int = 1) -> Profile:
    n = draw(st.integers(min_blocks, max_blocks))
    ms = st.integers(0, 12).map(float)  # small integers: ties happen, and must be handled
    blocks = [BlockProfile(name=f"b{k}", forward_ms=draw(ms), backward_ms=draw(ms),
                           activation_bytes=draw(st.integers(0, 300)) * UNIT,
                           parameter_bytes=draw(st.integers(0, 300)) * UNIT,
                           optimizer_state_bytes=draw(st.integers(0, 300)) * UNIT,
                           extra={"saved_bytes": draw(st.integers(0, 300)) * UNIT})
              for k in range(n)]
    # Both cost models: the all-reduce added to compute (CPU) or hidden behind it (GPU).
    device = draw(st.sampled_from(["cpu", "cuda"]))
    return Profile(model="random", batch_size=4, device=device, blocks=blocks)


BANDWIDTHS = st.sampled_from([1e9, 4e9, 2.5e10])


def block_arrays(profile: Profile) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """compute ms, parameter, optimizer, saved-activation and cut bytes per block."""
    b = profile.blocks
    return ([x.forward_ms + x.backward_ms for x in b], [x.parameter_bytes for x in b],
            [x.optimizer_state_bytes for x in b], [x.extra["saved_bytes"] for x in b],
            [x.activation_bytes for x in b])


def stage_time(compute: float, params: float, replicas: int, bandwidth: float,
               overlap: bool, schedule: str = "pipedream", chunks: int = 1) -> float:
    """A replicated stage (no update costs in these profiles): a ring all-reduce over full-duplex
    links, hidden behind compute on GPU (PipeDream's max) and added to it on CPU. pipedream
    all-reduces after every microbatch; 1f1b once per step of `chunks` microbatches, which the
    replicas share."""
    allreduce = 2 * (replicas - 1) * params / (replicas * bandwidth) * 1e3 if replicas > 1 else 0.0
    if schedule != "pipedream":
        allreduce /= max(1, chunks // replicas)
    return (max(compute, allreduce) if overlap else compute + allreduce) / replicas


def on_gpu(profile: Profile) -> bool:
    return profile.device.startswith("cuda")


def memory_ok(profile: Profile, flat: list[tuple[int, int, int]], limit: float | None,
              schedule: str, microbatches: int) -> bool:
    """flat: (start, stop, replicas) in pipeline order; the docstring model of costs.py."""
    if limit is None:
        return True
    comp, par, opt, saved, _ = block_arrays(profile)
    after = sum(r for _, _, r in flat)
    for start, stop, r in flat:
        noam = math.ceil(after / r)
        after -= r
        versions = {"pipedream": noam, "2bw": 2}.get(schedule, 1)
        in_flight = microbatches if schedule == "gpipe" else noam
        need = ((versions + 2) * sum(par[start:stop]) + sum(opt[start:stop])
                + in_flight * sum(saved[start:stop]))
        if need > limit:
            return False
    return True


def splits(start: int, stop: int) -> Iterator[list[tuple[int, int]]]:
    """Every way to cut blocks [start, stop) into contiguous non-empty stages."""
    inner = range(start + 1, stop)
    for k in range(len(inner) + 1):
        for cuts in itertools.combinations(inner, k):
            bounds = [start, *cuts, stop]
            yield list(zip(bounds, bounds[1:]))


def compositions(total: int, parts: int, exact: bool, straight: bool) -> Iterator[tuple[int, ...]]:
    """Replica counts >= 1 for `parts` stages summing to `total` (or at most `total`)."""
    choices = [1] if straight else range(1, total + 1)
    for reps in itertools.product(choices, repeat=parts):
        if sum(reps) == total or (not exact and sum(reps) <= total):
            yield reps


# ---- flat: exhaustive search -----------------------------------------------------------------

def brute_force_flat(profile: Profile, workers: int, bandwidth: float, straight: bool,
                     limit: float | None = None, schedule: str = "pipedream") -> float:
    comp, par, _, _, act = block_arrays(profile)
    best = math.inf
    for stages in splits(0, len(comp)):
        for reps in compositions(workers, len(stages), exact=False, straight=straight):
            flat = [(a, b, r) for (a, b), r in zip(stages, reps)]
            if not memory_ok(profile, flat, limit, schedule, workers):
                continue
            times = [stage_time(sum(comp[a:b]), sum(par[a:b]), r, bandwidth, on_gpu(profile),
                                 schedule, workers) for a, b, r in flat]
            comms = [2 * act[b - 1] / bandwidth * 1e3 for _, b, _ in flat[:-1]]
            best = min(best, max(times + comms))
    return best


def plan_bottleneck_flat(profile: Profile, plan, bandwidth: float) -> float:
    comp, par, _, _, act = block_arrays(profile)
    times = [stage_time(sum(comp[s.start:s.stop]), sum(par[s.start:s.stop]), s.replicas, bandwidth,
                        on_gpu(profile))
             for s in plan.stages]
    comms = [2 * act[s.stop - 1] / bandwidth * 1e3 for s in plan.stages[:-1]]
    return max(times + comms)


@SETTINGS
@given(profile=profiles(), workers=st.integers(1, 5), bandwidth=BANDWIDTHS, straight=st.booleans())
def test_flat_dp_equals_exhaustive_search(profile: Profile, workers: int, bandwidth: float,
                                          straight: bool) -> None:
    plan = make_plan(profile, Topology((Level(workers, bandwidth),)), straight=straight, margin=0)
    expected = brute_force_flat(profile, workers, bandwidth, straight)
    assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # The returned stages really achieve it, within the worker budget.
    assert plan_bottleneck_flat(profile, plan, bandwidth) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plan.workers <= workers
    assert plan.extra["idle_workers"] == workers - plan.workers
    if straight:
        assert all(s.replicas == 1 for s in plan.stages)
    else:  # data parallelism is one of the plans searched
        assert plan.bottleneck_ms <= plan.data_parallel_ms + 1e-9


def footprints(profile: Profile, workers: int, schedule: str) -> list[int]:
    """Every footprint a stage can have: the limits at which plans start or stop fitting."""
    _, par, opt, saved, _ = block_arrays(profile)
    n = len(par)
    out = set()
    for a in range(n):
        for b in range(a + 1, n + 1):
            for noam in range(1, workers + 1):
                versions = {"pipedream": noam, "2bw": 2}.get(schedule, 1)
                in_flight = workers if schedule == "gpipe" else noam
                out.add((versions + 2) * sum(par[a:b]) + sum(opt[a:b]) + in_flight * sum(saved[a:b]))
    return sorted(out)


@SETTINGS_MEMORY
@given(profile=profiles(max_blocks=4), workers=st.integers(1, 4), bandwidth=BANDWIDTHS,
       straight=st.booleans(), schedule=st.sampled_from(["pipedream", "2bw", "1f1b", "gpipe"]),
       data=st.data())
def test_flat_dp_with_memory_equals_exhaustive_search(profile: Profile, workers: int,
                                                      bandwidth: float, straight: bool,
                                                      schedule: str, data: st.DataObject) -> None:
    # Limits exactly at a possible footprint (or one byte under) are where mistakes show.
    limit = data.draw(st.sampled_from(footprints(profile, workers, schedule)))
    limit = max(1, limit - data.draw(st.sampled_from([0, 1])))
    topology = Topology((Level(workers, bandwidth),), memory_per_worker=limit)
    expected = brute_force_flat(profile, workers, bandwidth, straight, limit, schedule)
    if math.isinf(expected):
        with pytest.raises(PlanningError, match="smallest requirement|no plan exists"):
            make_plan(profile, topology, schedule=schedule, straight=straight)
        return
    plan = make_plan(profile, topology, schedule=schedule, straight=straight, margin=0)
    assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9, abs=1e-12)
    flat = [(s.start, s.stop, s.replicas) for s in plan.stages]
    assert memory_ok(profile, flat, limit, schedule, workers)
    assert all(s.extra["memory_bytes"] <= limit for s in plan.stages)


@settings(max_examples=25, deadline=None)
@given(profile=profiles(max_blocks=4), workers=st.integers(1, 3), bandwidth=BANDWIDTHS,
       schedule=st.sampled_from(["pipedream", "gpipe"]))
def test_smallest_memory_requirement_is_exact(profile: Profile, workers: int, bandwidth: float,
                                              schedule: str) -> None:
    """The reported requirement fits, and one byte less does not."""
    tight = Topology((Level(workers, bandwidth),), memory_per_worker=1)
    if profile.blocks and all(b.parameter_bytes == b.optimizer_state_bytes == 0 and
                              b.extra["saved_bytes"] == 0 for b in profile.blocks):
        make_plan(profile, tight, schedule=schedule)  # needs no memory at all: always fits
        return
    with pytest.raises(PlanningError) as err:
        make_plan(profile, tight, schedule=schedule)
    need = int(str(err.value).split("smallest requirement of any plan is ")[1].split("(")[1].split()[0])
    make_plan(profile, Topology((Level(workers, bandwidth),), memory_per_worker=need), schedule=schedule)
    assert math.isinf(brute_force_flat(profile, workers, bandwidth, False, need - 1, schedule))


# ---- hierarchical: exhaustive search of the nested plan space -------------------------------

def nested_plans(profile: Profile, topology: Topology, level: int, start: int, stop: int,
                 units: int, exact: bool, schedule: str = "pipedream"
                 ) -> Iterator[tuple[float, list[tuple[int, int, int]]]]:
    """(bottleneck, flattened (start, stop, total replicas)) of every level-`level` pipeline on
    [start, stop) over `units` units; each unit of a stage runs a full pipeline of the level
    below on all of its units, replicas all-reduce at this level's bandwidth (PipeDream §3.1)."""
    comp, par, _, _, act = block_arrays(profile)
    bandwidth = topology.levels[level].bandwidth
    for stages in splits(start, stop):
        for reps in compositions(units, len(stages), exact, straight=False):
            if level == 0:
                options = [[(stage_time(sum(comp[a:b]), sum(par[a:b]), r, bandwidth, on_gpu(profile),
                                          schedule, topology.workers), [(a, b, r)])]
                           for (a, b), r in zip(stages, reps)]
            else:
                below = topology.levels[level - 1].count
                options = [[(stage_time(value, sum(par[a:b]), r, bandwidth, on_gpu(profile), schedule,
                                         topology.workers),
                             [(x, y, r * z) for x, y, z in flat])
                            for value, flat in nested_plans(profile, topology, level - 1, a, b, below, True,
                                                             schedule)]
                           for (a, b), r in zip(stages, reps)]
            comms = [2 * act[b - 1] / bandwidth * 1e3 for _, b in stages[:-1]]
            for combo in itertools.product(*options):
                yield (max([value for value, _ in combo] + comms),
                       [stage for _, flat in combo for stage in flat])


def brute_force_nested(profile: Profile, topology: Topology, limit: float | None = None,
                       schedule: str = "pipedream") -> float:
    top = len(topology.levels) - 1
    best = math.inf
    for value, flat in nested_plans(profile, topology, top, 0, len(profile.blocks),
                                    topology.levels[top].count, exact=False, schedule=schedule):
        if memory_ok(profile, flat, limit, schedule, topology.workers):
            best = min(best, value)
    return best


@SETTINGS_MEMORY
@given(profile=profiles(max_blocks=4), inner=st.integers(1, 3), outer=st.integers(1, 2),
       fast=st.sampled_from([1e10, 4e10]), slow=BANDWIDTHS, limited=st.booleans(),
       schedule=st.sampled_from(["pipedream", "1f1b"]), data=st.data())
def test_hierarchical_dp_equals_exhaustive_search(profile: Profile, inner: int, outer: int,
                                                  fast: float, slow: float, limited: bool,
                                                  schedule: str, data: st.DataObject) -> None:
    limit = None
    if limited:
        limit = max(1, data.draw(st.sampled_from(footprints(profile, inner * outer, schedule))))
    topology = Topology((Level(inner, fast), Level(outer, slow)), memory_per_worker=limit)
    expected = brute_force_nested(profile, topology, limit, schedule)
    if math.isinf(expected):
        with pytest.raises(PlanningError):
            make_plan(profile, topology, schedule=schedule)
        return
    plan = make_plan(profile, topology, schedule=schedule, margin=0)
    assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9, abs=1e-12)
    flat = [(s.start, s.stop, s.replicas) for s in plan.stages]
    assert memory_ok(profile, flat, limit, schedule, topology.workers)
    comms = [s.extra["comm_out_ms"] for s in plan.stages[:-1]]
    assert max([s.predicted_ms for s in plan.stages] + comms) == pytest.approx(plan.bottleneck_ms)


@SETTINGS
@given(profile=profiles(), workers=st.integers(1, 5), bandwidth=BANDWIDTHS)
def test_unit_inner_level_equals_flat(profile: Profile, workers: int, bandwidth: float) -> None:
    """Groups of one worker add nothing: the hierarchical DP reduces to the flat one."""
    flat = make_plan(profile, Topology((Level(workers, bandwidth),)), margin=0)
    nested = make_plan(profile, Topology((Level(1, 1e12), Level(workers, bandwidth))), margin=0)
    assert nested.bottleneck_ms == pytest.approx(flat.bottleneck_ms, rel=1e-12)


# ---- layout, reports and baselines ------------------------------------------------------------

def cnn_like_profile() -> Profile:
    spec = [("conv1", 2, 1e4, 4e6), ("conv2", 6, 2e5, 1e6), ("conv3", 5, 3e5, 2e6),
            ("conv4", 6, 6e5, 5e5), ("fc1", 3, 6.7e7, 1.3e5), ("fc2", 3, 6.7e7, 1.3e5),
            ("fc3", 0.1, 1.6e5, 320)]
    return Profile(model="cnn-like", batch_size=8, device="cpu", blocks=[
        BlockProfile(name, ms / 3, 2 * ms / 3, int(act), int(par), int(par)) for name, ms, par, act in spec])


def test_ranks_keep_inner_replicas_inside_one_group() -> None:
    topology = Topology.parse("4x12.5e9,4x1.25e9")
    plan = make_plan(cnn_like_profile(), topology)
    plan.validate()
    for stage in plan.stages:
        inner_replicas = stage.extra["levels"][0]["replicas"]
        groups: dict[int, int] = {}
        for rank in stage.ranks:
            groups[rank // 4] = groups.get(rank // 4, 0) + 1
        assert set(groups.values()) == {inner_replicas}
    # The JSON the simulator reads carries the topology.
    assert Topology.from_dict(plan.extra["topology"]) == topology


def test_plan_round_trips_and_evaluates_to_the_same_figures(tmp_path) -> None:
    profile = cnn_like_profile()
    topology = Topology.parse("2x10e9,2x1e9")
    plan = make_plan(profile, topology)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = evaluate_plan(type(plan).load(path), profile, topology)
    assert again.bottleneck_ms == pytest.approx(plan.bottleneck_ms)
    assert [s.predicted_ms for s in again.stages] == pytest.approx([s.predicted_ms for s in plan.stages])


def test_data_parallel_strategy_and_speedup() -> None:
    profile = cnn_like_profile()
    topology = Topology.parse("8x1e9")
    dp = make_plan(profile, topology, strategy="data-parallel")
    assert [(s.start, s.stop, s.replicas) for s in dp.stages] == [(0, 7, 8)]
    assert dp.bottleneck_ms == pytest.approx(dp.data_parallel_ms)
    best = make_plan(profile, topology)
    assert best.bottleneck_ms < dp.bottleneck_ms  # the fc layers make data parallelism slow
    assert best.speedup_vs_data_parallel > 1


@pytest.mark.parametrize("strategy", ["uniform", "params", "time"])
def test_baselines_are_valid_and_never_beat_the_dp(strategy: str) -> None:
    profile = cnn_like_profile()
    topology = Topology.parse("4x1e9")
    plan = make_plan(profile, topology, strategy=strategy)
    plan.validate()
    assert plan.workers == 4 and len(plan.stages) == 4
    assert make_plan(profile, topology, margin=0).bottleneck_ms <= plan.bottleneck_ms + 1e-9
    straight = make_plan(profile, Topology.parse("16x1e9"), strategy=strategy, straight=True)
    assert len(straight.stages) == 7 and all(s.replicas == 1 for s in straight.stages)


@given(weights=st.lists(st.integers(0, 30).map(float), min_size=1, max_size=7), data=st.data())
@settings(max_examples=60, deadline=None)
def test_balanced_partition_is_optimal(weights: list[float], data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, len(weights)))
    bounds = balanced_partition(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == parts + 1
    got = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    best = min(max(sum(weights[a:b]) for a, b in stages)
               for stages in splits(0, len(weights)) if len(stages) == parts)
    assert got == best


def test_uniform_partition_sizes_differ_by_at_most_one() -> None:
    bounds = uniform_partition(10, 4)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sum(sizes) == 10 and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_memory_error_names_the_smallest_requirement() -> None:
    profile = cnn_like_profile()
    with pytest.raises(PlanningError, match=r"smallest requirement of any plan is .*\(\d+ bytes\)"):
        make_plan(profile, Topology.parse("4x1e9", memory_per_worker=10**6))


def test_memory_limit_changes_the_plan_and_is_respected() -> None:
    profile = cnn_like_profile()
    free = make_plan(profile, Topology.parse("4x1e9"))
    need = max(s.extra["memory_bytes"] for s in free.stages)
    limited = make_plan(profile, Topology.parse("4x1e9", memory_per_worker=need - 1))
    assert all(s.extra["memory_bytes"] <= need - 1 for s in limited.stages)
    assert limited.bottleneck_ms >= free.bottleneck_ms


def test_straight_hierarchical_without_enough_blocks_is_a_clear_error() -> None:
    profile = Profile(model="m", batch_size=1, device="cpu",
                      blocks=[BlockProfile("only", 1.0, 1.0, 0, 0, 0)])
    with pytest.raises(PlanningError, match="at least 4 blocks"):
        make_plan(profile, Topology.parse("4x1e10,2x1e9"), straight=True)


def test_gpipe_footprint_counts_all_microbatches() -> None:
    profile = Profile(model="m", batch_size=1, device="cpu",
                      blocks=[BlockProfile("a", 1.0, 1.0, 0, 100, 0, extra={"saved_bytes": 10})])
    plan = make_plan(profile, Topology.parse("1x1e9"), schedule="gpipe", chunks=7)
    assert plan.stages[0].extra["memory_bytes"] == 3 * 100 + 7 * 10  # live, 1 slot, grads
    assert plan.extra["chunks"] == 7


def test_dp_tables_ignore_context_without_a_memory_limit() -> None:
    costs = Costs.from_profile(cnn_like_profile())
    solver = HierarchicalDP(costs, Topology.parse("4x1e10,4x1e9"), MemoryModel("pipedream"))
    solver.best_plan()
    assert {context for _, context in solver._memo} == {0}


def test_activation_fallback_without_saved_bytes() -> None:
    """Profiles from other tools may lack saved_bytes: a stage then keeps what enters it plus
    every cut its blocks produce."""
    profile = Profile(model="m", batch_size=1, device="cpu", extra={"input_bytes": 7},
                      blocks=[BlockProfile(f"b{k}", 1.0, 1.0, 10 * (k + 1), 0, 0) for k in range(3)])
    costs = Costs.from_profile(profile)
    assert costs.activations[0, 2] == 7 + 10 + 20
    assert costs.activations[1, 3] == 10 + 20 + 30
    assert costs.activations[2, 3] == 20 + 30


# ---- choosing the schedule -------------------------------------------------------------------

def two_part_profile(parameter_bytes: int) -> Profile:
    """Four equal blocks; `parameter_bytes` each decides how dear data parallelism is."""
    blocks = [BlockProfile(name=f"b{k}", forward_ms=10.0, backward_ms=20.0,
                           activation_bytes=10**5, parameter_bytes=parameter_bytes,
                           optimizer_state_bytes=parameter_bytes, extra={"saved_bytes": 10**5})
              for k in range(4)]
    return Profile(model="four", batch_size=8, device="cpu", blocks=blocks)


def test_the_planner_chooses_a_pipeline_where_gradients_are_dear() -> None:
    from pipedream_fast.planner.choose import choose_schedule
    plan = choose_schedule(two_part_profile(10**8), Topology.parse("2x1e8"))
    rows = {r["schedule"]: r for r in plan.extra["schedule_choice"]}
    assert plan.schedule != "data-parallel" and len(plan.stages) > 1
    assert rows["data-parallel"]["samples_per_s"] < rows[plan.schedule]["samples_per_s"]
    assert rows[plan.schedule]["why"].startswith("chosen")


def test_the_planner_chooses_data_parallelism_where_gradients_are_cheap() -> None:
    from pipedream_fast.planner.choose import choose_schedule
    plan = choose_schedule(two_part_profile(10), Topology.parse("2x1e10"))
    rows = {r["schedule"]: r for r in plan.extra["schedule_choice"]}
    best = max(r["samples_per_s"] for r in rows.values() if r["samples_per_s"] is not None)
    assert rows[plan.schedule]["samples_per_s"] >= 0.99 * best
    assert len(plan.stages) == 1 and plan.stages[0].replicas == 2  # data parallel wins


def test_the_chosen_schedule_fits_the_memory_limit() -> None:
    from pipedream_fast.planner.choose import choose_schedule
    profile = two_part_profile(10**8)
    free = choose_schedule(profile, Topology.parse("2x1e8"))
    need = max(s.extra["memory_bytes"] for s in free.stages)
    tight = choose_schedule(profile, Topology.parse("2x1e8", memory_per_worker=need - 1))
    assert max(s.extra["memory_bytes"] for s in tight.stages) < need
    assert tight.schedule != free.schedule
    refused = [r for r in tight.extra["schedule_choice"] if r["samples_per_s"] is None]
    assert refused and all("per worker" in r["why"] for r in refused)


# ---- the planner's steady state against the simulator ---------------------------------------

def update_profile(device: str) -> Profile:
    """Unequal blocks whose updates cost something: what the update terms must get right."""
    blocks = [BlockProfile(name=f"b{k}", forward_ms=10.0 + 5 * k, backward_ms=20.0 + 7 * k,
                           activation_bytes=2 * 10**5, parameter_bytes=(k + 1) * 10**7,
                           optimizer_state_bytes=0,
                           extra={"saved_bytes": 10**5, "optimizer_ms": 2.0 + k,
                                  "grad_zero_ms": 0.5, "grad_scale_ms": 1.5,
                                  "snapshot_ms": 1.0 + k})
              for k in range(4)]
    return Profile(model="four", batch_size=8, device=device, blocks=blocks)


@pytest.mark.parametrize("strategy", ["data-parallel", "time"])
@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_predicted_time_per_microbatch_matches_the_simulated_steady_state(strategy: str,
                                                                          schedule: str) -> None:
    """The planner's bottleneck (compute, the all-reduce it cannot hide on CPU, the optimizer
    step, clearing, averaging and weight copies) is what the simulator, running the schedule's
    own actions, spends per microbatch once the pipeline is full."""
    from pipedream_fast.planner.choose import predict

    profile = update_profile("cpu")
    plan = make_plan(profile, Topology.parse("2x1e9"), schedule=schedule, strategy=strategy,
                     chunks=2)
    planned = profile.batch_size / plan.bottleneck_ms * 1e3
    simulated = predict(profile, plan, schedule, steps=40)
    assert simulated == pytest.approx(planned, rel=0.05)


def test_updates_and_the_all_reduce_add_to_compute_on_cpu_and_overlap_on_gpu() -> None:
    cpu = make_plan(update_profile("cpu"), Topology.parse("2x1e9"), strategy="data-parallel")
    gpu = make_plan(update_profile("cuda"), Topology.parse("2x1e9"), strategy="data-parallel")
    compute = sum(b.forward_ms + b.backward_ms for b in update_profile("cpu").blocks)
    params = sum(b.parameter_bytes for b in update_profile("cpu").blocks)
    update = sum(2.0 + k + 0.5 for k in range(4))
    reduce = 2 * (2 - 1) * params / (2 * 1e9) * 1e3  # a ring all-reduce over 2, full duplex
    assert cpu.data_parallel_ms == pytest.approx((compute + reduce + update) / 2)
    assert gpu.data_parallel_ms == pytest.approx((max(compute, reduce) + update) / 2)


# ---- near-equal plans: the simplest within the margin ------------------------------------------

def brute_force_flat_plans(profile: Profile, workers: int, bandwidth: float, straight: bool
                           ) -> Iterator[tuple[float, int, int, tuple[tuple[int, int], ...]]]:
    """(bottleneck, stages, workers used, (replicas, end) of each stage) of every flat plan."""
    comp, par, _, _, act = block_arrays(profile)
    for stages in splits(0, len(comp)):
        for reps in compositions(workers, len(stages), exact=False, straight=straight):
            times = [stage_time(sum(comp[a:b]), sum(par[a:b]), r, bandwidth, on_gpu(profile))
                     for (a, b), r in zip(stages, reps)]
            comms = [2 * act[b - 1] / bandwidth * 1e3 for _, b in stages[:-1]]
            yield (max(times + comms), len(stages), sum(reps),
                   tuple((r, b) for (_, b), r in zip(stages, reps)))


@SETTINGS
@given(profile=profiles(), workers=st.integers(1, 4), bandwidth=BANDWIDTHS,
       straight=st.booleans(), margin=st.sampled_from([0.0, 0.05, 0.3]))
def test_the_plan_is_the_simplest_within_the_margin(profile: Profile, workers: int,
                                                    bandwidth: float, straight: bool,
                                                    margin: float) -> None:
    """Among the plans within `margin` of the fastest: the fewest stages, then the most
    workers, then a fixed order, not the fastest, so that near-equal cuts do not swap with
    profile noise: stage by stage, the fewest replicas, then the earliest cut (checked
    against every plan)."""
    plans = list(brute_force_flat_plans(profile, workers, bandwidth, straight))
    fastest = min(p[0] for p in plans)
    within = [p for p in plans if p[0] <= fastest * (1 + margin) * (1 + 1e-9) + 1e-12]
    want_time, want_stages, want_workers, _ = min(within, key=lambda p: (p[1], -p[2], p[3]))
    plan = make_plan(profile, Topology((Level(workers, bandwidth),)), straight=straight,
                     margin=margin)
    assert (len(plan.stages), plan.workers) == (want_stages, want_workers)
    assert plan.bottleneck_ms == pytest.approx(want_time, rel=1e-9, abs=1e-12)
    assert plan_bottleneck_flat(profile, plan, bandwidth) == pytest.approx(want_time, rel=1e-9,
                                                                           abs=1e-12)
    choice = plan.extra["plan_choice"]
    assert choice["fastest_ms"] == pytest.approx(fastest, rel=1e-9, abs=1e-12)
    assert choice["chosen_ms"] <= fastest * (1 + margin) + 1e-9


def gpt_like_profile(parameter_scale: float, noise: float = 0.0, seed: int = 0) -> Profile:
    """nanoGPT's blocks on CPU, each time off by up to `noise` (a fraction), as two profiles
    of one model measured twice are. With parameter_scale 0.15 on 2 workers at 1 GB/s, data
    parallelism and a 2-stage pipeline are predicted within 0.1% of each other."""
    rng = random.Random(seed)
    spec = [("wte", 0.5, 1.6e6), ("wpe", 0.1, 1e5), ("h.0", 6.0, 7e6), ("h.1", 6.0, 7e6),
            ("ln_f", 0.2, 1e3), ("lm_head", 3.0, 1.6e6)]
    blocks = []
    for name, ms, params in spec:
        f = 1 + rng.uniform(-noise, noise)
        blocks.append(BlockProfile(name, ms / 3 * f, 2 * ms / 3 * f, 4 * 10**5,
                                   int(params * parameter_scale), int(params * parameter_scale),
                                   extra={"saved_bytes": 10**6}))
    return Profile(model="gpt-like", batch_size=8, device="cpu", blocks=blocks)


def shape(plan) -> list[tuple[int, int, int]]:
    return [(s.start, s.stop, s.replicas) for s in plan.stages]


def test_profile_noise_does_not_flip_the_plan() -> None:
    """Twelve profiles of one model, each block off by up to 3%: one plan (the fastest
    picked 2 stages in some and data parallelism in others)."""
    topology = Topology.parse("2x1e9")
    noisy = [gpt_like_profile(0.15, noise=0.03, seed=seed) for seed in range(12)]
    plans = {str(shape(make_plan(p, topology, schedule="1f1b"))) for p in noisy}
    assert plans == {str([(0, 6, 2)])}  # the simpler one: data parallelism
    fastest = {str(shape(make_plan(p, topology, schedule="1f1b", margin=0))) for p in noisy}
    assert len(fastest) > 1  # teeth: the fastest plan alone flips with the noise


def test_a_clearly_faster_plan_still_wins_and_the_choice_is_reported() -> None:
    topology = Topology.parse("2x1e9")
    # Dearer gradients: data parallelism is 14% slower than the 2-stage pipeline.
    dear = make_plan(gpt_like_profile(0.3), topology, schedule="1f1b")
    assert shape(dear) == [(0, 3, 1), (3, 6, 1)]
    assert dear.data_parallel_ms > 1.1 * dear.bottleneck_ms
    assert dear.extra["plan_choice"]["why"].startswith("the fastest plan")
    # Within the margin the simpler plan wins, and the plan says over what and why.
    near = gpt_like_profile(0.16)
    fastest = make_plan(near, topology, schedule="1f1b", margin=0)
    chosen = make_plan(near, topology, schedule="1f1b")
    assert len(fastest.stages) == 2 and shape(chosen) == [(0, 6, 2)]
    assert chosen.bottleneck_ms <= 1.05 * fastest.bottleneck_ms
    why = chosen.extra["plan_choice"]["why"]
    assert "1 stage" in why and "2 stages" in why and "5% margin" in why, why


def test_profile_noise_does_not_flip_the_schedule() -> None:
    """`--schedule auto` on the noisy profiles: one schedule and plan (the fastest alone
    switches between 1f1b and data-parallel, a percent apart)."""
    from pipedream_fast.planner.choose import choose_schedule
    topology = Topology.parse("2x1e9")
    noisy = [gpt_like_profile(0.15, noise=0.03, seed=seed) for seed in range(8)]

    def chosen(margin: float | None) -> set[tuple[str, str]]:
        return {(plan.schedule, str(shape(plan))) for plan in
                (choose_schedule(p, topology, margin=margin) for p in noisy)}

    assert len(chosen(None)) == 1, chosen(None)
    assert len(chosen(0.0)) > 1  # teeth


# ---- recomputation: every stage keeps or recomputes, searched exhaustively ------------------

def recompute_footprint(profile: Profile, a: int, b: int, noam: int, schedule: str,
                        microbatches: int, recomputed: bool) -> float:
    """One replica of stage [a, b) by costs.py's docstring: kept, its saved bytes per
    microbatch in flight; recomputed, what enters each block and what leaves the last, plus
    the largest block's own activations once (its re-run)."""
    _, par, opt, saved, act = block_arrays(profile)
    versions = {"pipedream": noam, "2bw": 2}.get(schedule, 1)
    in_flight = microbatches if schedule == "gpipe" else noam
    if recomputed:
        entering = act[a - 1] if a > 0 else 0
        per_mb = entering + sum(act[a:b])
        rerun = max(max(0, saved[k] - (act[k - 1] if k > 0 else 0) - act[k]) for k in range(a, b))
        activations = in_flight * per_mb + rerun
    else:
        activations = in_flight * sum(saved[a:b])
    return (versions + 2) * sum(par[a:b]) + sum(opt[a:b]) + activations


def brute_force_recompute(profile: Profile, workers: int, bandwidth: float, straight: bool,
                          limit: float | None, schedule: str, mode: str) -> float:
    """The least bottleneck over every split, replica count and (mode auto) every choice of
    the stages that recompute: a recomputing stage's compute includes its forward again."""
    comp, par, _, _, act = block_arrays(profile)
    fwd = [b.forward_ms for b in profile.blocks]
    best = math.inf
    for stages in splits(0, len(comp)):
        for reps in compositions(workers, len(stages), exact=False, straight=straight):
            options = {"none": [False], "all": [True], "auto": [False, True]}[mode]
            for chosen in itertools.product(options, repeat=len(stages)):
                after, ok, times = sum(reps), True, []
                for (a, b), r, rec in zip(stages, reps, chosen):
                    noam = math.ceil(after / r)
                    after -= r
                    need = recompute_footprint(profile, a, b, noam, schedule, workers, rec)
                    if limit is not None and need > limit:
                        ok = False
                        break
                    compute = sum(comp[a:b]) + (sum(fwd[a:b]) if rec else 0)
                    times.append(stage_time(compute, sum(par[a:b]), r, bandwidth,
                                            on_gpu(profile), schedule, workers))
                if ok:
                    comms = [2 * act[b - 1] / bandwidth * 1e3 for _, b in stages[:-1]]
                    best = min(best, max(times + comms))
    return best


@SETTINGS_MEMORY
@given(profile=profiles(max_blocks=4), workers=st.integers(1, 3), bandwidth=BANDWIDTHS,
       straight=st.booleans(), schedule=st.sampled_from(["pipedream", "2bw", "1f1b", "gpipe"]),
       mode=st.sampled_from(["auto", "all", "none"]), data=st.data())
def test_dp_choosing_recomputation_equals_exhaustive_search(
        profile: Profile, workers: int, bandwidth: float, straight: bool, schedule: str,
        mode: str, data: st.DataObject) -> None:
    """Under a memory limit the plan is the fastest over stages, replicas and which stages
    recompute (auto), and every stage it has recompute really needs to, to fit."""
    n = len(profile.blocks)
    limits = sorted({recompute_footprint(profile, a, b, noam, schedule, workers, rec)
                     for a in range(n) for b in range(a + 1, n + 1)
                     for noam in range(1, workers + 1) for rec in (False, True)})
    limit = max(1, int(data.draw(st.sampled_from(limits))) - data.draw(st.sampled_from([0, 1])))
    topology = Topology((Level(workers, bandwidth),), memory_per_worker=limit)
    expected = brute_force_recompute(profile, workers, bandwidth, straight, limit, schedule, mode)
    if math.isinf(expected):
        with pytest.raises(PlanningError, match="smallest requirement|no plan exists"):
            make_plan(profile, topology, schedule=schedule, straight=straight, recompute=mode)
        return
    plan = make_plan(profile, topology, schedule=schedule, straight=straight, margin=0,
                     recompute=mode)
    assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert all(s.extra["memory_bytes"] <= limit for s in plan.stages)
    after = plan.workers
    for s in plan.stages:
        noam = math.ceil(after / s.replicas)
        after -= s.replicas
        footprint = recompute_footprint(profile, s.start, s.stop, noam, schedule, workers,
                                        s.extra["recompute"])
        assert s.extra["memory_bytes"] == pytest.approx(footprint, abs=1)
        if mode == "auto" and s.extra["recompute"]:  # only where keeping would not fit
            assert recompute_footprint(profile, s.start, s.stop, noam, schedule, workers,
                                       False) > limit


@settings(max_examples=25, deadline=None)
@given(profile=profiles(max_blocks=4), workers=st.integers(1, 3), bandwidth=BANDWIDTHS)
def test_smallest_memory_with_recomputation_is_exact(profile: Profile, workers: int,
                                                     bandwidth: float) -> None:
    """With recompute auto the reported requirement fits and one byte less fits no plan,
    recomputing or not; it is never above the requirement without recomputation."""
    tight = Topology((Level(workers, bandwidth),), memory_per_worker=1)
    try:
        make_plan(profile, tight, schedule="1f1b", recompute="auto")
        return  # needs no memory at all
    except PlanningError as err:
        message = str(err)
    need = int(message.split("smallest requirement of any plan is ")[1].split("(")[1].split()[0])
    assert "the fullest worker holds stage" in message
    make_plan(profile, Topology((Level(workers, bandwidth),), memory_per_worker=need),
              schedule="1f1b", recompute="auto")
    assert math.isinf(brute_force_recompute(profile, workers, bandwidth, False, need - 1, "1f1b",
                                            "auto"))
    keep = math.inf
    try:
        make_plan(profile, tight, schedule="1f1b", recompute="none")
    except PlanningError as err:
        keep = int(str(err).split("smallest requirement of any plan is ")[1].split("(")[1].split()[0])
    assert need <= keep
