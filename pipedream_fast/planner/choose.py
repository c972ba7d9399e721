"""Choosing the schedule: plan every trainable schedule (but localsgd, another algorithm),
predict each plan with the simulator running that very schedule, keep the fastest one that
fits in memory.

The prediction is samples per second over the same number of microbatches of the profiled
size for every schedule, so fill and drain count as they will in a run. Candidates within
`MARGIN` (5%) of the fastest count as equally fast, so that profile noise does not flip the
choice; among them the simplest wins (see `choose_schedule`). Every candidate and why it won
or lost is kept in the plan (`extra["schedule_choice"]`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipedream_fast.formats import Plan, Profile
from pipedream_fast.schedules import AUTOMATIC, kind, make_schedule
from pipedream_fast.topology import Topology

STEPS = 8  # steps simulated per candidate: enough for the steady state to dominate


def plan_for(name: str, profile: Profile, topology: Topology, straight: bool = False,
             **overrides: Any) -> Plan:
    """The plan schedule `name` is trained with: `make_plan` with its memory rules and the
    options it declares (`ScheduleKind.planning`), then `overrides`."""
    from pipedream_fast.planner import make_plan

    spec = kind(name)
    options = {"straight": straight, **spec.planning, **overrides}
    # A schedule with its own rule for a stage of several per rank plans under its own name
    # (its memory counted by that rule); others under the schedule whose rules they share.
    own = spec.stage_stashed is not None and options.get("stages_per_rank", 1) > 1
    return make_plan(profile, topology, schedule=name if own else spec.plans_as or name,
                     **options)


def predict(profile: Profile, plan: Plan, name: str, steps: int = STEPS,
            chunks: int | None = None, bandwidth: float | None = None,
            options: dict[str, Any] | None = None) -> float:
    """Samples/s of `name` on `plan` in the simulator: the prediction, the one figure
    `plan`, `simulate` (with a profile and a plan) and `train` report for the same plan and
    settings. `steps` x workers microbatches of the profiled size for every schedule (those
    that step per minibatch take one microbatch per worker per step; those that step per
    `chunks` microbatches, default one per worker, take `steps` steps), so fill and drain
    weigh the same for all. `bandwidth` (bytes/s) for the cuts where the plan has no topology;
    `options`: the schedule's own (localsgd's local_steps ...)."""
    result = simulate_prediction(profile, plan, name, steps, chunks, bandwidth, options)
    return result.schedule.num_microbatches * profile.batch_size / result.makespan * 1e3


def prediction_text(samples_per_s: float, schedule: str) -> str:
    """How every command says `predict`'s figure, so that they can be compared."""
    return (f"predicted (simulated from the profile): {samples_per_s:,.1f} samples/s for "
            f"{schedule}")


def prediction_size(plan: Plan, name: str, steps: int = STEPS,
                    chunks: int | None = None) -> tuple[int, int | None]:
    """(microbatches, chunks per step or None) that `predict` simulates."""
    if kind(name).chunked_steps:
        chunks = chunks or kind(name).default_chunks(plan.workers)
        return steps * chunks, chunks
    return steps * plan.workers, None


def simulate_prediction(profile: Profile, plan: Plan, name: str, steps: int = STEPS,
                        chunks: int | None = None, bandwidth: float | None = None,
                        options: dict[str, Any] | None = None) -> Any:
    """The simulated run behind `predict` (a `sim.SimResult`)."""
    from pipedream_fast.sim import ProfileCosts, simulate

    n, per_step = prediction_size(plan, name, steps, chunks)
    given: dict[str, Any] = {"chunks": per_step} if per_step is not None else {}
    given.update(options or {})
    schedule = make_schedule(name, len(plan.stages), n,
                             stage_ranks=[list(s.ranks) for s in plan.stages], **given)
    costs = (ProfileCosts.from_plan(profile, plan) if bandwidth is None
             else ProfileCosts.from_plan(profile, plan, bandwidth))
    return simulate(schedule, _at_speed(costs, plan))


def _at_speed(costs: Any, plan: Plan) -> Any:
    """`costs` (sim.ProfileCosts) with each stage's compute and update divided by the speed of
    its slowest rank, on a heterogeneous topology (replicas run in lockstep, as the planner's
    model has them)."""
    topology = costs.topology
    if topology is None or not topology.heterogeneous:
        return costs
    speeds = [min(topology.speed_of(r) for r in s.ranks) for s in plan.stages]

    def scaled(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v / speed for v, speed in zip(values, speeds)) if values else values

    return dataclasses.replace(
        costs, forward_ms=scaled(costs.forward_ms), backward_ms=scaled(costs.backward_ms),
        stage_optimizer_ms=scaled(costs.stage_optimizer_ms),
        grad_scale_ms=scaled(costs.grad_scale_ms), snapshot_ms=scaled(costs.snapshot_ms))


def _memory(plan: Plan) -> int:
    return max(int(s.extra.get("memory_bytes", 0)) for s in plan.stages)


def _simpler(name: str, plan: Plan) -> tuple[bool, int, int]:
    """The order among schedules predicted equally fast: synchronous first (exact minibatch
    SGD, no stale weights), then fewer stages (fewer transfers, stashed microbatches and
    estimated terms that can be off), then less memory per worker."""
    return not kind(name).synchronous, len(plan.stages), _memory(plan)


def choose_schedule(profile: Profile, topology: Topology, straight: bool = False,
                    candidates: tuple[str, ...] = AUTOMATIC, margin: float | None = None,
                    recompute: str = "none") -> Plan:
    """The plan of the candidate schedule with the highest predicted throughput among those
    that fit the memory limit. Candidates within `margin` (default `MARGIN`, 5%) of the best
    count as equally fast; the simplest of them wins (`_simpler`); each candidate's plan is
    itself the simplest within `margin` (`make_plan`), with stages recomputing as `recompute`
    says (auto: where that is what makes them fit the limit; the simulator charges the
    re-run). Raises the last PlanningError if no candidate fits."""
    from pipedream_fast.planner import MARGIN, PlanningError

    margin = MARGIN if margin is None else margin

    rows: list[dict[str, Any]] = []
    fitting: dict[str, tuple[float, Plan]] = {}
    error: PlanningError | None = None
    for name in candidates:
        try:
            plan = plan_for(name, profile, topology, straight, margin=margin,
                            recompute=recompute)
            rate = predict(profile, plan, name)
        except (PlanningError, ValueError) as err:
            rows.append({"schedule": name, "samples_per_s": None, "why": str(err)})
            error = err if isinstance(err, PlanningError) else error
            continue
        rows.append({"schedule": name, "samples_per_s": rate, "memory_bytes": _memory(plan)})
        fitting[name] = (rate, plan)
    if not fitting:
        raise error or PlanningError("no trainable schedule has a plan for this topology")
    top = max(rate for rate, _ in fitting.values())
    tied = [n for n, (rate, _) in fitting.items() if rate * (1 + margin) >= top]
    chosen = min(tied, key=lambda n: _simpler(n, fitting[n][1]))
    rate, plan = fitting[chosen]
    for row in rows:
        if row["samples_per_s"] is None:
            continue
        if row["schedule"] == chosen:
            row["why"] = ("chosen: fastest predicted" if len(tied) == 1 else
                          f"chosen among {len(tied)} within {margin:.0%} of the fastest: "
                          f"synchronous first, then fewest stages, then least memory")
        else:
            row["why"] = f"{row['samples_per_s'] / rate:.2f}x the chosen"
    plan.schedule = chosen
    plan.extra["schedule_choice"] = rows
    return plan
