"""The planner: from a Profile and a Topology to a Plan (stages x replicas x ranks).

    Profile ──Costs──▶ HierarchicalDP (or a baseline) ──▶ tree of stages ──flatten──▶ Plan

* `strategy="dp"` (default) runs PipeDream's dynamic program (`dp.py`): minimum bottleneck over
  all stage splits and replica counts, level by level for hierarchical topologies, honouring
  the memory limit. `straight=True` keeps one worker per stage. Among the plans within
  `margin` (5%) of that minimum it keeps the simplest (fewest stages, then most workers, then
  fastest; `HierarchicalDP.simplest_plan`), so that profile noise does not flip the plan
  between near-equal ones; `extra["plan_choice"]` says what was chosen over what and why.
* `"data-parallel"` is one stage replicated on every worker; `"uniform"`, `"params"`, `"time"`
  are the baselines of `baselines.py`.

The plan's `workers` is the number of ranks it uses: when the optimum leaves whole outer
groups idle (adding them only costs all-reduce time), those trailing ranks are left out and
reported in `extra["idle_workers"]`. `extra["topology"]` carries the topology, and every stage's
extra holds its compute, outgoing-cut and memory figures (see `make_plan`).

Heterogeneous topologies (per-rank speeds or memory limits, `Topology.heterogeneous`) are planned
by `hetero.HeteroDP` instead: exact over pipelines whose stages take consecutive ranks in rank
order, costed with the slowest-link model with compute scaled by the slowest replica's speed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from pipedream_fast.formats import Plan, Profile, StagePlan
from pipedream_fast.planner.baselines import BASELINES, balanced_partition, baseline_stages
from pipedream_fast.planner.costs import SCHEDULES, Costs, MemoryModel
from pipedream_fast.schedules import kind
from pipedream_fast.planner.dp import HierarchicalDP, StageNode, data_parallel_tree
from pipedream_fast.planner.flatten import (FlatStage, choose_recompute, flat_times, flatten,
                                            nested_times, stage_memory)
from pipedream_fast.planner.hetero import HeteroDP, group_memory, worker_memory_error
from pipedream_fast.topology import Topology

STRATEGIES = ("dp", "data-parallel") + BASELINES

MARGIN = 0.05
"""Plans (and schedules) predicted within this fraction of the fastest count as equally fast:
the simplest of them is chosen. Profiles of one model measured twice differ by a few percent
per block; a margin above that noise makes the choice repeatable."""

__all__ = ["MARGIN", "PlanningError", "SCHEDULES", "STRATEGIES", "evaluate_plan", "make_plan",
           "smallest_memory"]


class PlanningError(ValueError):
    """No plan satisfies the request (memory too small, impossible straight pipeline, ...)."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def smallest_memory(costs: Costs, topology: Topology, memory: MemoryModel,
                    straight: bool = False) -> int | None:
    """Smallest per-worker memory for which the dynamic program finds any plan (None: none at all).

    Some plan's largest stage footprint is the answer, so it is one of the footprints a stage can
    have; bisect over those, solving the DP as a feasibility test at each probe.
    """
    valid = np.triu(np.ones_like(costs.params, dtype=bool), k=1)
    noams = range(1, topology.workers + 1) if memory.varies_with_noam else [1]
    forms = {"none": (False,), "all": (True,), "auto": (False, True)}[memory.recompute]
    candidates = np.unique(np.concatenate(
        [memory.stage_bytes(costs, n, recomputed)[valid] for n in noams for recomputed in forms]))

    def feasible(limit: float) -> bool:
        probe = dataclasses.replace(memory, limit=int(limit))
        return HierarchicalDP(costs, topology, probe, straight).best_time()[1] > 0

    if not feasible(candidates[-1]):
        return None
    low, high = 0, len(candidates) - 1  # candidates[high] is feasible
    while low < high:
        mid = (low + high) // 2
        if feasible(candidates[mid]):
            high = mid
        else:
            low = mid + 1
    return int(candidates[high])


def _structural_hint(costs: Costs, topology: Topology, straight: bool) -> str:
    if straight and len(topology.levels) > 1:
        inner = topology.levels[0].count
        return (f"a straight plan must run a {inner}-stage pipeline inside every level-0 group of "
                f"{inner} workers, which needs at least {inner} blocks per group, and the model has "
                f"{costs.num_blocks}; let the planner replicate stages (--no-straight) or use a "
                f"flat topology")
    return "no plan exists for this topology"


def make_plan(profile: Profile, topology: Topology, *, schedule: str = "pipedream",
              straight: bool = False, strategy: str = "dp",
              chunks: int | None = None, stages_per_rank: int = 1,
              margin: float = MARGIN, recompute: str = "none", placement: str = "looped") -> Plan:
    """Plan `profile` on `topology`; see the module docstring for the strategies.

    `chunks` is the number of microbatches per step, all of which GPipe keeps in flight
    (default: the worker count); the memory limit is `topology.memory_per_worker` (or per
    rank, `Topology.memory_of`).
    `stages_per_rank` > 1 plans an interleaved pipeline instead (see `interleaved_plan`), its
    stages looped over the ranks or, with `placement="v"` (zb-v), in a V.
    `margin`: the DP keeps the simplest plan within this fraction of the fastest (0: the
    fastest, with the fewest stages among equally fast ones).
    `recompute`: none (stages keep their activations), all (every stage makes them again in
    its backward), auto (a stage recomputes only where keeping them does not fit the memory
    limit); the plan's stages say which recompute (`extra["recompute"]`).
    """
    if strategy not in STRATEGIES:
        raise PlanningError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not 0 <= margin < 1:
        raise PlanningError(f"margin is a fraction of the fastest plan's time in [0, 1), got "
                            f"{margin}")
    if stages_per_rank != 1:
        return interleaved_plan(profile, topology, stages_per_rank, schedule, recompute,
                                placement)
    if topology.heterogeneous:
        return _hetero_plan(profile, topology, schedule, straight, strategy, chunks, margin,
                            recompute)
    began = time.perf_counter()
    costs = Costs.from_profile(profile)
    memory = _memory_model(schedule, topology.uniform_memory, chunks or topology.workers,
                           recompute)
    num_blocks = costs.num_blocks

    data_parallel = choose_recompute(flatten(data_parallel_tree(num_blocks, topology), topology),
                                     costs, memory)
    data_parallel_ms = nested_times(data_parallel, costs, topology, memory)[0][0]

    choice: dict[str, Any] | None = None
    if strategy == "dp":
        solver = HierarchicalDP(costs, topology, memory, straight)
        found = solver.simplest_plan(margin)
        if found is None:
            raise PlanningError(_no_plan_message(costs, topology, memory, straight, schedule))
        stages = flatten(found[1], topology)
        choice = _plan_choice(solver, found, margin)
    elif strategy == "data-parallel":
        stages = data_parallel
    else:
        stages = baseline_stages(strategy, costs, topology.workers, straight)
    stages = choose_recompute(stages, costs, memory)
    times, cuts = (nested_times if strategy in ("dp", "data-parallel") else flat_times)(
        stages, costs, topology, memory)
    footprints = stage_memory(stages, costs, memory)
    if memory.limit is not None and strategy != "dp":
        worst = max(f.bytes for f in footprints)
        if worst > memory.limit:
            raise PlanningError(
                f"the {strategy} plan needs {_fmt_bytes(worst)} ({worst} bytes) per worker with "
                f"schedule {schedule}{_recompute_note(memory)}, more than --memory-per-worker "
                f"{memory.limit}; raise the limit or use --strategy dp")

    plan = _assemble(profile, topology, stages, times, cuts, footprints, costs, memory,
                     data_parallel_ms, strategy, straight, began)
    if choice is not None:
        plan.extra["plan_choice"] = choice
    return plan


def _hetero_plan(profile: Profile, topology: Topology, schedule: str, straight: bool,
                 strategy: str, chunks: int | None, margin: float, recompute: str) -> Plan:
    """`make_plan` on a heterogeneous topology (see the module docstring and `hetero.py`).
    Its limits are per rank, so stages recompute only when told to (recompute="all")."""
    began = time.perf_counter()
    costs = Costs.from_profile(profile)
    memory = _memory_model(schedule, None, chunks or topology.workers,
                           "all" if recompute == "all" else "none")  # limits are per rank
    everyone = [FlatStage(0, costs.num_blocks, tuple(range(topology.workers)))]
    data_parallel_ms = flat_times(everyone, costs, topology, memory)[0][0]
    choice: dict[str, Any] | None = None
    if strategy == "dp":
        solver = HeteroDP(costs, topology, memory, straight)
        found = solver.simplest_plan(margin)
        if found is None:
            if all(topology.memory_of(r) is None for r in range(topology.workers)):
                raise PlanningError(_structural_hint(costs, topology, straight))
            raise PlanningError(worker_memory_error(costs, topology, memory, schedule))
        stages = [FlatStage(s.start, s.stop, s.ranks) for s in found[1]]
        fastest = solver.best_time()
        choice = {"margin": margin, "fastest_ms": fastest, "chosen_ms": found[0],
                  "why": (f"the simplest plan within the {margin:.0%} margin of the fastest "
                          f"({fastest:.3g} ms) over stages on consecutive ranks in rank order "
                          f"(heterogeneous workers): fewest stages, then most workers")}
    elif strategy == "data-parallel":
        stages = everyone
    else:
        stages = baseline_stages(strategy, costs, topology.workers, straight)
    stages = choose_recompute(stages, costs, memory)
    times, cuts = flat_times(stages, costs, topology, memory)
    footprints = stage_memory(stages, costs, memory)
    for stage, footprint in zip(stages, footprints):
        limit = group_memory(topology, stage.ranks)
        if limit is not None and footprint.bytes > limit:
            raise PlanningError(
                f"the {strategy} plan's stage of blocks [{stage.start}, {stage.stop}) needs "
                f"{_fmt_bytes(footprint.bytes)} ({footprint.bytes} bytes) per worker with schedule "
                f"{schedule}, more than its ranks {list(stage.ranks)} hold ({limit} bytes); "
                f"give them more memory or use --strategy dp")
    plan = _assemble(profile, topology, stages, times, cuts, footprints, costs, memory,
                     data_parallel_ms, strategy, straight, began, nested=False)
    if choice is not None:
        plan.extra["plan_choice"] = choice
    return plan


def _plan_choice(solver: HierarchicalDP, chosen: tuple[float, list[StageNode]],
                 margin: float) -> dict[str, Any]:
    """What the DP chose over the fastest plan it found, and why (for the plan's report)."""
    fastest = solver.best_plan()
    assert fastest is not None  # a plan was chosen, so one exists
    (best_ms, best), (ms, nodes) = fastest, chosen

    def shape(tree: list[StageNode]) -> str:
        n = len(tree)
        return (f"{n} stage{'s' * (n != 1)} x replicas "
                f"{'/'.join(str(s.replicas) for s in tree)}")

    if [(s.start, s.stop, s.replicas) for s in best] == [(s.start, s.stop, s.replicas)
                                                        for s in nodes]:
        why = f"the fastest plan; none simpler within the {margin:.0%} margin"
    else:
        slower = max(0.0, ms / best_ms - 1) if best_ms > 0 else 0.0  # both 0 within margin
        why = (f"{shape(nodes)}, {slower:.1%} slower than the fastest "
               f"found ({shape(best)}, {best_ms:.3g} ms): within the {margin:.0%} margin the "
               f"fewest stages win, then the most workers, so profile noise does not flip "
               f"the plan")
    return {"margin": margin, "fastest_ms": best_ms, "chosen_ms": ms, "why": why}


def interleaved_plan(profile: Profile, topology: Topology, stages_per_rank: int,
                     schedule: str = "1f1b", recompute: str = "none",
                     placement: str = "looped") -> Plan:
    """Workers x v stages balanced by time, stage k on rank k mod workers (the looped placement
    of interleaved schedules), one replica each; with `placement="v"` (v = 2, zb-v) stage k
    on rank k for k < workers, else on rank 2 x workers - 1 - k. The predicted time per
    minibatch is the busiest rank's compute over its v stages."""
    began = time.perf_counter()
    if topology.heterogeneous:
        raise PlanningError(f"interleaved plans (stages per rank > 1) are not planned for "
                            f"heterogeneous workers (topology {topology}); use 1 stage per rank")
    costs = Costs.from_profile(profile)
    workers, v = topology.workers, stages_per_rank
    if v < 1 or workers * v > costs.num_blocks:
        raise PlanningError(f"{workers} workers x {v} stages per rank need at least "
                            f"{workers * v} blocks; the model has {costs.num_blocks}")
    if placement not in ("looped", "v") or (placement == "v" and v != 2):
        raise PlanningError(f"placement is looped (any stages per rank) or v (2 stages per "
                            f"rank), got {placement!r} with {v} stages per rank")
    rank_of = ((lambda k: k if k < workers else 2 * workers - 1 - k) if placement == "v"
               else (lambda k: k % workers))
    bounds = balanced_partition(np.diff(costs.compute[0]).tolist(), workers * v)
    # The schedule's own rule for a stage of several per rank, where it declares one (its
    # stages' share of the rank's peak at its default microbatches per step); else per stage.
    memory = _memory_model(schedule, topology.uniform_memory,
                           kind(schedule).default_chunks(workers), recompute,
                           ranks=workers, stages_per_rank=v)
    stages = choose_recompute([FlatStage(a, b, (rank_of(k),))
                               for k, (a, b) in enumerate(zip(bounds, bounds[1:]))], costs, memory)
    times, cuts = flat_times(stages, costs, topology, memory)
    data_parallel = flatten(data_parallel_tree(costs.num_blocks, topology), topology)
    data_parallel_ms = nested_times(data_parallel, costs, topology, memory)[0][0]
    plan = _assemble(profile, topology, stages, times, cuts, stage_memory(stages, costs, memory),
                     costs, memory, data_parallel_ms, "time", True, began, nested=False)
    per_rank = [sum(t for k, t in enumerate(times) if rank_of(k) == r) for r in range(workers)]
    plan.bottleneck_ms = max(max(per_rank), max(cuts or [0]))
    plan.extra["stages_per_rank"] = v
    if placement != "looped":
        plan.extra["placement"] = placement
    return plan


def evaluate_plan(plan: Plan, profile: Profile, topology: Topology,
                  chunks: int | None = None) -> Plan:
    """Re-cost an existing plan (e.g. edited by hand, or for a new profile of the same model).

    Stages that carry their per-level `levels` (plans made by the dynamic program) on a topology
    of the same shape are costed with the hierarchical model, others with the slowest-link
    model. Raises FormatError when the plan was made for another model or batch size.
    """
    began = time.perf_counter()
    plan.check_matches(profile)
    if plan.workers > topology.workers:
        raise PlanningError(f"the plan uses {plan.workers} workers but the topology {topology} "
                            f"has only {topology.workers}")
    costs = Costs.from_profile(profile)
    hetero = topology.heterogeneous
    memory = MemoryModel(plan.schedule, None if hetero else topology.uniform_memory,
                         chunks or int(plan.extra.get("chunks", plan.extra.get(
                             "microbatches", topology.workers))))  # its name before 0.2
    levels = [s.extra.get("levels") for s in plan.stages]
    chains = [chain for chain in levels
              if isinstance(chain, list) and len(chain) == len(topology.levels)]
    nested = len(chains) == len(levels) and not hetero
    if nested:
        stages = [FlatStage(s.start, s.stop, tuple(s.ranks),
                            tuple((c["start"], c["stop"], c["replicas"]) for c in chain),
                            recompute=bool(s.extra.get("recompute", False)))
                  for s, chain in zip(plan.stages, chains)]
    else:
        stages = [FlatStage(s.start, s.stop, tuple(s.ranks),
                            recompute=bool(s.extra.get("recompute", False)))
                  for s in plan.stages]
    times, cuts = (nested_times if nested else flat_times)(stages, costs, topology, memory)
    footprints = stage_memory(stages, costs, memory)
    if hetero:
        data_parallel_ms = flat_times([FlatStage(0, costs.num_blocks,
                                                 tuple(range(topology.workers)))],
                                      costs, topology, memory)[0][0]
    else:
        data_parallel = choose_recompute(
            flatten(data_parallel_tree(costs.num_blocks, topology), topology), costs, memory)
        data_parallel_ms = nested_times(data_parallel, costs, topology, memory)[0][0]
    return _assemble(profile, topology, stages, times, cuts, footprints, costs, memory,
                     data_parallel_ms, str(plan.extra.get("strategy", "given")),
                     bool(plan.extra.get("straight", False)), began, nested=nested)


def _assemble(profile: Profile, topology: Topology, stages: list[FlatStage], times: list[float],
              cuts: list[float], footprints: list[Any], costs: Costs, memory: MemoryModel,
              data_parallel_ms: float, strategy: str, straight: bool, began: float,
              nested: bool | None = None) -> Plan:
    hierarchical = strategy in ("dp", "data-parallel") if nested is None else nested
    extra = _plan_extra(stages, times, cuts, topology, strategy, straight, memory, profile, began)
    extra["cost_model"] = "hierarchical" if hierarchical else "slowest-link"
    return Plan(model=profile.model, batch_size=profile.batch_size,
                workers=len({r for s in stages for r in s.ranks}), schedule=memory.schedule,
                stages=_stage_plans(stages, times, cuts, footprints, costs, hierarchical),
                bottleneck_ms=max(times + cuts), data_parallel_ms=data_parallel_ms, extra=extra)


def _no_plan_message(costs: Costs, topology: Topology, memory: MemoryModel, straight: bool,
                     schedule: str) -> str:
    if memory.limit is None:
        return _structural_hint(costs, topology, straight)
    need = smallest_memory(costs, topology, memory, straight)
    if need is None:
        return _structural_hint(costs, topology, straight)
    advice = ("use more workers, or a schedule that keeps fewer weight versions (2bw, 1f1b, "
              "gpipe)")
    if memory.recompute == "none":
        advice += ", or let stages recompute their activations (--recompute auto)"
    return (f"no {'straight ' if straight else ''}plan fits in {_fmt_bytes(memory.limit)} "
            f"({memory.limit} bytes) per worker with schedule {schedule}"
            f"{_recompute_note(memory)}: the smallest requirement of any plan is "
            f"{_fmt_bytes(need)} ({need} bytes) per worker"
            f"{_where_it_goes(costs, topology, memory, straight, need)}; raise "
            f"--memory-per-worker to at least {need}, {advice}")


def _recompute_note(memory: MemoryModel) -> str:
    return {"none": "", "all": ", every stage recomputing",
            "auto": ", stages recomputing where that fits"}[memory.recompute]


def _where_it_goes(costs: Costs, topology: Topology, memory: MemoryModel, straight: bool,
                   need: int) -> str:
    """The fullest worker of the plan that fits in `need`, by kind of bytes."""
    solver = HierarchicalDP(costs, topology, dataclasses.replace(memory, limit=need), straight)
    found = solver.best_plan()
    if found is None:
        return ""
    stages = choose_recompute(flatten(found[1], topology), costs,
                              dataclasses.replace(memory, limit=need))
    footprints = stage_memory(stages, costs, memory)
    index = max(range(len(stages)), key=lambda k: footprints[k].bytes)
    stage, worst = stages[index], footprints[index]
    kinds = ", ".join(f"{kind.replace('_', ' ')} {_fmt_bytes(value)}"
                      for kind, value in worst.parts.items() if value)
    how = ", recomputing" if stage.recompute else ""
    blocks = (costs.names[stage.start] if stage.stop == stage.start + 1 else
              f"{costs.names[stage.start]} .. {costs.names[stage.stop - 1]}")
    return f" (the fullest worker holds stage {index}, blocks {blocks}{how}: {kinds})"


def _memory_model(schedule: str, limit: int | None, chunks: int, recompute: str,
                  ranks: int | None = None, stages_per_rank: int = 1) -> MemoryModel:
    try:
        return MemoryModel(schedule, limit, chunks, recompute, ranks=ranks,
                           stages_per_rank=stages_per_rank)
    except ValueError as err:
        raise PlanningError(str(err)) from None


def _stage_plans(stages: list[FlatStage], times: list[float], cuts: list[float],
                 footprints: list[Any], costs: Costs, hierarchical: bool) -> list[StagePlan]:
    out = []
    for index, (stage, ms, mem) in enumerate(zip(stages, times, footprints)):
        extra: dict[str, Any] = {
            "blocks": list(costs.names[stage.start:stage.stop]),
            "compute_ms": float(costs.compute[stage.start, stage.stop]),
            "parameter_bytes": int(costs.params[stage.start, stage.stop]),
            "weight_versions": mem.versions, "in_flight": mem.in_flight,
            "memory_bytes": mem.bytes, "recompute": mem.recompute,
            "memory_parts": {k: int(v) for k, v in mem.parts.items()}}
        if index < len(cuts):
            extra["comm_out_ms"] = cuts[index]
        if hierarchical:
            extra["levels"] = [{"start": a, "stop": b, "replicas": r} for a, b, r in stage.chain]
        out.append(StagePlan(start=stage.start, stop=stage.stop, replicas=stage.replicas,
                             ranks=stage.ranks, predicted_ms=ms, extra=extra))
    return out


def _plan_extra(stages: list[FlatStage], times: list[float], cuts: list[float],
                topology: Topology, strategy: str, straight: bool, memory: MemoryModel,
                profile: Profile, began: float) -> dict[str, Any]:
    worst_stage = max(range(len(times)), key=times.__getitem__)
    worst_cut = max(range(len(cuts)), key=cuts.__getitem__) if cuts else None
    if worst_cut is not None and cuts[worst_cut] > times[worst_stage]:
        bottleneck = {"kind": "cut", "after_stage": worst_cut, "ms": cuts[worst_cut]}
    else:
        bottleneck = {"kind": "stage", "stage": worst_stage, "ms": times[worst_stage]}
    extra: dict[str, Any] = {
        "topology": topology.to_dict(), "strategy": strategy, "straight": straight,
        "idle_workers": topology.workers - len({r for s in stages for r in s.ranks}),
        "bottleneck": bottleneck, "profile_device": profile.device,
        "planner_ms": (time.perf_counter() - began) * 1e3}
    if memory.schedule == "gpipe":
        extra["chunks"] = memory.chunks
    if memory.recompute != "none":
        extra["recompute"] = memory.recompute
    return extra
