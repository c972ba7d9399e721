"""Re-planning a running pipeline from the speed its ranks measured: whether to move stages
between ranks, and to which plan.

The plan a job starts with assumes every rank computes as fast as the profile says. In a run
they need not: a rank shares its machine, throttles, or is a slower device. The in-rank
calibration (`runtime.calibration`) measures each action's own time, so a rank's **speed** is
what the profile says its stages cost over what the rank measured for them (compute only,
forward and backward per microbatch: the part the profile and the rank both know; overheads
and transfers do not tell one rank's speed). Speeds are relative, the fastest rank at 1.0;
the profile's batch size and the run's microbatch size only scale every rank alike.

With those speeds on the topology, the planner's heterogeneous model (`planner/hetero.py`)
costs the current plan and finds the fastest plan at margin 0 (we want the fastest at the
measured speeds, not the simplest near it). Among equally fast plans the one that moves the
least state wins, so a tie keeps the current plan, which costs nothing to move to.
A move is refused when the running job could not take it: it must use the same ranks, and
keep the first stage on the same ranks (they read the data loader, which a move cannot hand
to others). When the fastest plan breaks one of these, the fastest plan that keeps them (all
ranks used, the first stage on its ranks; searched over the same space as the planner) is
taken instead where the heterogeneous planner can search it.

Moving costs a pause (the weights and optimizer state of the moved blocks travel,
`state_bytes`), and the measurements are noisy, so the plan moves only when the predicted
gain is at least `threshold` (default 10%, above the few percent that measurements of one
machine drift by) and the time a move takes is paid back by the faster steps within
`payback_steps` steps. `Replan.reason` says in one line what was decided and why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipedream_fast.formats import Plan, Profile, StagePlan
from pipedream_fast.planner import PlanningError, evaluate_plan, make_plan
from pipedream_fast.planner.costs import Costs, MemoryModel
from pipedream_fast.planner.hetero import HeteroDP
from pipedream_fast.schedules import kind
from pipedream_fast.topology import Topology

if TYPE_CHECKING:  # the runtime package imports torch; the planner need not
    from pipedream_fast.runtime.calibration import CalibrationSnapshot, Estimate

__all__ = ["Replan", "calibrated_profile", "measured_speeds", "replan", "state_bytes"]

SAME_SPEED = 0.995
"""Ranks at or above this fraction of the fastest are reported as running at full speed."""

_TIE = 1e-9  # relative: a plan no faster than this is not faster (float noise)


@dataclass(frozen=True)
class Replan:
    """The decision: `plan` to move to (None: stay), and why in one line."""

    plan: Plan | None  # the plan to move to; None: stay
    reason: str  # one line for the log: what was decided and the numbers behind it
    speeds: tuple[float, ...] | None  # measured speed per rank, fastest 1.0; None: unmeasured
    current_ms: float | None  # predicted bottleneck of the current plan at the measured speeds
    best_ms: float | None  # of the best plan at the measured speeds
    gain: float  # 1 - best_ms / current_ms (0 when staying for lack of data)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": None if self.plan is None else self.plan.to_dict(),
                "reason": self.reason,
                "speeds": None if self.speeds is None else list(self.speeds),
                "current_ms": self.current_ms, "best_ms": self.best_ms, "gain": self.gain}


# --- measured speeds ---------------------------------------------------------------------------

def _usable(e: Estimate | None) -> bool:
    return e is not None and math.isfinite(e.mean_s) and e.mean_s >= 0


def _stage_seconds(snap: CalibrationSnapshot, stage: int) -> float | str:
    """Measured compute of one microbatch of `stage` on the snapshot's rank (seconds): its
    forward plus its backward, whole or split into input and weight parts (weighted by how
    many microbatches took each form, should a schedule mix them); or why it is unknown."""
    def get(name: str) -> Estimate | None:
        return snap.actions.get((name, stage))

    forward = get("forward")
    if forward is None:
        return f"rank {snap.rank} has no forward of stage {stage} measured yet"
    whole, part_i, part_w = get("backward"), get("backward_input"), get("backward_weight")
    forms: list[tuple[float, int]] = []  # (seconds per microbatch, microbatches)
    if whole is not None:
        if not _usable(whole):
            return f"rank {snap.rank} measured an invalid backward of stage {stage}"
        forms.append((whole.mean_s, max(1, whole.count)))
    if part_i is not None and part_w is not None:
        if not (_usable(part_i) and _usable(part_w)):
            return f"rank {snap.rank} measured an invalid split backward of stage {stage}"
        forms.append((part_i.mean_s + part_w.mean_s, max(1, min(part_i.count, part_w.count))))
    if not forms:
        return f"rank {snap.rank} has no backward of stage {stage} measured yet"
    if not _usable(forward):
        return f"rank {snap.rank} measured an invalid forward of stage {stage}"
    backward = sum(s * n for s, n in forms) / sum(n for _, n in forms)
    total = forward.mean_s + backward
    if not (math.isfinite(total) and total > 0):
        return f"rank {snap.rank} measured no compute time for stage {stage}"
    return total


def _measure(profile: Profile, plan: Plan, snapshots: Mapping[int, CalibrationSnapshot],
             microbatch_size: int) -> tuple[float, ...] | str:
    """The speeds of `measured_speeds`, or why there are none."""
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) \
            or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be a positive integer, got {microbatch_size!r}")
    plan = _named_as(plan, profile)
    plan.check_matches(profile)
    scale = microbatch_size / profile.batch_size
    raw = []
    for rank in range(plan.workers):
        snap = snapshots.get(rank)
        if snap is None:
            return f"not enough measurements yet: rank {rank} has no calibration snapshot"
        profiled = measured = 0.0
        for s in plan.stages_of_rank(rank):
            stage = plan.stages[s]
            seconds = _stage_seconds(snap, s)
            if isinstance(seconds, str):
                return f"not enough measurements yet: {seconds}"
            measured += seconds * 1e3
            profiled += scale * sum(b.forward_ms + b.backward_ms
                                    for b in profile.blocks[stage.start:stage.stop])
        speed = profiled / measured
        if not (math.isfinite(speed) and speed > 0):
            return (f"cannot measure the speed of rank {rank}: the profile gives its stages "
                    f"{profiled:.3g} ms of compute")
        raw.append(speed)
    fastest = max(raw)
    return tuple(s / fastest for s in raw)


def calibrated_profile(profile: Profile, plan: Plan,
                       snapshots: Mapping[int, CalibrationSnapshot],
                       microbatch_size: int) -> Profile | str:
    """`profile` with each block's times scaled by how its stage's measured compute compares
    with the profile's (the mean over the stage's ranks), so that every rank's speed is 1.0
    against it now: a per-block cost that knows what the profile left out (what an action
    costs whatever its blocks, another batch size, the run's own kernels). Later speeds
    measured against it are changes since this moment. Or why there are no measurements."""
    plan = _named_as(plan, profile)
    plan.check_matches(profile)
    scale = microbatch_size / profile.batch_size
    blocks = list(profile.blocks)
    for index, stage in enumerate(plan.stages):
        measured = []
        for rank in stage.ranks:
            snap = snapshots.get(rank)
            if snap is None:
                return f"not enough measurements yet: rank {rank} has no calibration snapshot"
            seconds = _stage_seconds(snap, index)
            if isinstance(seconds, str):
                return f"not enough measurements yet: {seconds}"
            measured.append(seconds * 1e3)
        profiled = scale * sum(b.forward_ms + b.backward_ms
                               for b in profile.blocks[stage.start:stage.stop])
        if not profiled > 0:
            return f"the profile gives stage {index} no compute to scale"
        factor = sum(measured) / len(measured) / profiled
        for b in range(stage.start, stage.stop):
            blocks[b] = dataclasses.replace(blocks[b], forward_ms=blocks[b].forward_ms * factor,
                                            backward_ms=blocks[b].backward_ms * factor)
    return dataclasses.replace(profile, blocks=blocks)


def _named_as(plan: Plan, profile: Profile) -> Plan:
    """`plan` under the profile's model name and batch size when it has the profile's blocks
    (a plan made from a manual split names neither)."""
    if plan.stages[-1].stop == len(profile.blocks):
        return dataclasses.replace(plan, model=profile.model, batch_size=profile.batch_size)
    return plan


def measured_speeds(profile: Profile, plan: Plan, snapshots: Mapping[int, CalibrationSnapshot],
                    microbatch_size: int) -> tuple[float, ...] | None:
    """Each rank's speed, the fastest at 1.0: the profile's compute (forward + backward) of the
    rank's stages, scaled to `microbatch_size`, over the rank's measured own time of them.
    None while some rank of `plan` has no snapshot, no forward or backward measured for one of
    its stages, or an invalid (negative, not finite) measurement."""
    found = _measure(profile, plan, snapshots, microbatch_size)
    return None if isinstance(found, str) else found


# --- describing plans --------------------------------------------------------------------------

def _speeds_text(speeds: Sequence[float]) -> str:
    slow = [(r, s) for r, s in enumerate(speeds) if s < SAME_SPEED]
    if not slow:
        return f"all {len(speeds)} ranks run at the same speed (within {1 - SAME_SPEED:.1%})"
    (r, s), rest = slow[0], slow[1:]
    return ", ".join([f"rank {r} runs at {s:.2f}x"] + [f"rank {r} at {s:.2f}x" for r, s in rest])


def _ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0,2', 'ranks 0-7' (runs of three or more consecutive ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else
                               ",".join(str(r) for r in run) for run in runs)


def _pct(x: float) -> str:
    return f"{x:.1%}" if abs(x) < 0.1 else f"{x:.0%}"


def _holders(plan: Plan, blocks: int) -> list[tuple[int, ...]]:
    """Per block, the ranks holding it (in the plan's order)."""
    out: list[tuple[int, ...]] = [() for _ in range(blocks)]
    for stage in plan.stages:
        for b in range(stage.start, min(stage.stop, blocks)):
            out[b] = out[b] + tuple(r for r in stage.ranks if r not in out[b])
    return out


def _moves_text(old: Plan, new: Plan, blocks: int) -> str:
    """'moving block 5 from rank 1 to rank 0; blocks 6-7 from ...' (consecutive blocks with the
    same move together)."""
    before, after = _holders(old, blocks), _holders(new, blocks)
    runs: list[list[Any]] = []  # [first block, last block, old ranks, new ranks]
    for b, (was, now) in enumerate(zip(before, after)):
        if set(was) == set(now):
            continue
        if runs and runs[-1][1] == b - 1 and runs[-1][2:] == [was, now]:
            runs[-1][1] = b
        else:
            runs.append([b, b, was, now])
    if not runs:
        return "re-splitting the stages"
    parts = [(f"block {a}" if a == z else f"blocks {a}-{z}") +
             f" from {_ranks_text(was)} to {_ranks_text(now)}" for a, z, was, now in runs]
    return "moving " + "; ".join(parts)


def _stages_key(plan: Plan) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(s.start, s.stop, tuple(s.ranks)) for s in plan.stages]


def state_bytes(profile: Profile, old: Plan, new: Plan) -> int:
    """Bytes a move from `old` to `new` sends: each block's parameters and optimizer state
    (the profile's `parameter_bytes` + `optimizer_state_bytes`) once for every rank that holds
    the block in `new` but not in `old` (for straight plans: the blocks whose rank changes)."""
    old.check_matches(profile)
    new.check_matches(profile)
    blocks = len(profile.blocks)
    total = 0
    for block, was, now in zip(profile.blocks, _holders(old, blocks), _holders(new, blocks)):
        total += (block.parameter_bytes + block.optimizer_state_bytes) * len(set(now) - set(was))
    return total


# --- the decision ------------------------------------------------------------------------------

def _problem(old: Plan, new: Plan) -> tuple[str, str] | None:
    """Why the running job could not move from `old` to `new`: (what the new plan does, why
    that is refused); None: it can."""
    if new.workers != old.workers:
        return (f"uses {new.workers} of the {old.workers} ranks",
                "a move cannot leave ranks idle")
    if set(new.stages[0].ranks) != set(old.stages[0].ranks):
        return (f"puts the first stage on {_ranks_text(new.stages[0].ranks)} instead of "
                f"{_ranks_text(old.stages[0].ranks)}",
                "those read the data loader, and a move cannot hand it to other ranks")
    return None


def _best_keeping(profile: Profile, plan: Plan, topology: Topology, schedule: str,
                  straight: bool, chunks: int) -> Plan | None:
    """The plan to move to on a heterogeneous `topology`: the fastest that uses every rank and
    keeps the first stage on `plan`'s ranks, over the heterogeneous planner's space (stages on
    consecutive ranks in rank order, so only when those ranks are 0..r-1; else None); among
    the equally fast, the one that moves the fewest bytes of state, then changes the fewest
    blocks' ranks (so the current plan wins a tie, and a slow rank's neighbours are not
    reshuffled where the bottleneck does not need it). None where no plan fits."""
    first = tuple(sorted(plan.stages[0].ranks))
    r0 = len(first)
    if first != tuple(range(r0)):
        return None
    costs = Costs.from_profile(profile)
    memory = MemoryModel(schedule, None, chunks)  # limits are the topology's, per rank
    dp = HeteroDP(costs, topology, memory, straight)
    n, blocks = topology.workers, costs.num_blocks
    rmax = 1 if straight else n
    # The optimum: the first stage on ranks 0..r0-1, then the planner's own table of the
    # fastest pipeline of blocks [j, L) on exactly ranks [r0, n) (every rank used).
    tail = dp._table(n, None)
    optimum = math.inf
    for j in range(1, blocks + 1):
        if (j == blocks) != (r0 == n):
            continue
        value = dp._terms(0, j, 0, r0, n)
        if j < blocks:
            rest = tail.get((j, r0))
            value = max(value, math.inf if rest is None else rest[1])
        optimum = min(optimum, value)
    if optimum == math.inf:
        return None
    bound = optimum * (1 + _TIE)

    # Least moved among the plans whose every term is within the bound: per (w, r), prefix sums
    # over blocks of the bytes the ranks [w, w+r) would receive and of the blocks they change.
    holders = [set(h) for h in _holders(plan, blocks)]
    state = [b.parameter_bytes + b.optimizer_state_bytes for b in profile.blocks]
    moved: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for w in range(n):
        for r in range(1, n - w + 1):
            ranks, sums = set(range(w, w + r)), [(0, 0)]
            for b in range(blocks):
                sent, changed = sums[-1]
                sums.append((sent + state[b] * len(ranks - holders[b]),
                             changed + (ranks != holders[b])))
            moved[w, r] = sums
    none = (math.inf, math.inf, -1, 0)  # (bytes, blocks changed, stop, replicas)
    best: dict[tuple[int, int], tuple[float, float, int, int]] = {}
    for i in range(blocks - 1, -1, -1):
        for w in ([0] if i == 0 else range(n - 1, 0, -1)):
            option = none
            for r in ([r0] if i == 0 else range(1, min(rmax, n - w) + 1)):
                for j in ([blocks] if w + r == n else range(i + 1, blocks)):
                    if dp._terms(i, j, w, r, n) > bound:
                        continue
                    sums = moved[w, r]
                    key = (float(sums[j][0] - sums[i][0]), float(sums[j][1] - sums[i][1]), j, r)
                    if j < blocks:
                        rest = best.get((j, w + r), none)
                        key = (key[0] + rest[0], key[1] + rest[1], j, r)
                    if key[:2] < option[:2]:
                        option = key
            best[i, w] = option
    if best[0, 0][0] == math.inf:
        return None
    bounds, i, w = [], 0, 0
    while i < blocks:
        _, _, j, r = best[i, w]
        bounds.append((i, j, tuple(range(w, w + r))))
        i, w = j, w + r
    skeleton = Plan(model=profile.model, batch_size=profile.batch_size, workers=n,
                    schedule=schedule,
                    stages=[StagePlan(a, b, len(rs), rs, 0.0) for a, b, rs in bounds],
                    bottleneck_ms=0.0, data_parallel_ms=0.0,
                    extra={"strategy": "dp", "straight": straight})
    return evaluate_plan(skeleton, profile, topology, chunks)


def _check_args(chunks: int, step_seconds: float, move_seconds: float, threshold: float,
                payback_steps: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    for name, value in (("step_seconds", step_seconds), ("move_seconds", move_seconds)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite seconds >= 0, got {value!r}")
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold is a fraction of the current time in [0, 1), got "
                         f"{threshold!r}")
    if payback_steps < 0:
        raise ValueError(f"payback_steps must be >= 0, got {payback_steps!r}")


def replan(profile: Profile, plan: Plan, snapshots: Mapping[int, CalibrationSnapshot], *,
           microbatch_size: int, chunks: int, step_seconds: float, move_seconds: float,
           threshold: float = 0.1, payback_steps: int = 200,
           topology: Topology | None = None) -> Replan:
    """Whether the running `plan` should move, and to which plan (see the module docstring).

    `snapshots`: every rank's calibration, by rank; `microbatch_size`: the run's; `chunks`:
    microbatches per step; `step_seconds`: a step's measured time now; `move_seconds`: what
    a move would pause the job for (e.g. from `state_bytes`); `topology`: the links and memory
    limits to plan on (default: a flat one, as `Pipeline` plans with), its speeds replaced by
    the measured ones. Raises ValueError on invalid arguments or a topology of another size.
    """
    _check_args(chunks, step_seconds, move_seconds, threshold, payback_steps)
    found = _measure(profile, plan, snapshots, microbatch_size)
    if isinstance(found, str):
        return Replan(None, f"staying: {found}", None, None, None, 0.0)
    speeds = found
    said = _speeds_text(speeds)
    base = topology if topology is not None else Topology.parse(f"{plan.workers}x1e9")
    if base.workers != plan.workers:
        raise ValueError(f"the topology {base} has {base.workers} workers, the plan "
                         f"{plan.workers}: re-planning keeps the ranks of the running job")
    at_speed = dataclasses.replace(base, speeds=speeds)
    try:
        spec = kind(plan.schedule)
    except ValueError as err:
        return Replan(None, f"{said}; staying: cannot re-plan schedule {plan.schedule!r} ({err})",
                      speeds, None, None, 0.0)
    planned_as = spec.plans_as or plan.schedule
    straight = all(len(s.ranks) == 1 for s in plan.stages)
    current_ms = evaluate_plan(dataclasses.replace(_named_as(plan, profile),
                                                   schedule=planned_as),
                               profile, at_speed, chunks).bottleneck_ms
    options: dict[str, Any] = {"straight": straight, **spec.planning}
    try:
        best = make_plan(profile, at_speed, schedule=planned_as, chunks=chunks, margin=0.0,
                         **options)
    except PlanningError as err:
        return Replan(None, f"{said}; staying: no plan at the measured speeds ({err})",
                      speeds, current_ms, None, 0.0)

    fastest, note = best, ""
    if at_speed.heterogeneous and options.get("strategy", "dp") == "dp" \
            and options.get("stages_per_rank", 1) == 1:
        keeping = _best_keeping(profile, plan, at_speed, planned_as, straight, chunks)
        if keeping is not None:
            best = keeping
            refused = _problem(plan, fastest)
            if refused is not None:
                note = (f" (the fastest plan, {fastest.bottleneck_ms:.3g} ms, {refused[0]}; "
                        f"this is the fastest that keeps every rank and the loader's)")
    problem = _problem(plan, best)
    if problem is not None:
        return Replan(None, f"{said}; staying: the fastest plan at the measured speeds "
                            f"({best.bottleneck_ms:.3g} ms against {current_ms:.3g} ms now) "
                            f"{problem[0]}: {problem[1]}", speeds, current_ms, best.bottleneck_ms,
                      _gain(current_ms, best.bottleneck_ms))

    best_ms = best.bottleneck_ms
    if _stages_key(best) == _stages_key(plan) or best_ms >= current_ms * (1 - _TIE):
        return Replan(None, f"{said}; staying: the current plan is already the best at the "
                            f"measured speeds ({current_ms:.3g} ms predicted){note}",
                      speeds, current_ms, min(best_ms, current_ms), 0.0)
    gain = _gain(current_ms, best_ms)
    moves = _moves_text(plan, best, len(profile.blocks))
    saving = f"{moves} would save {_pct(gain)} ({current_ms:.3g} -> {best_ms:.3g} ms predicted)"
    if gain < threshold:
        return Replan(None, f"{said}; staying: {saving}{note}, below the {_pct(threshold)} "
                            f"threshold", speeds, current_ms, best_ms, gain)
    saved = step_seconds * gain  # per step
    if move_seconds > payback_steps * saved:
        steps = ("never be paid back" if saved <= 0 else
                 f"take {math.ceil(move_seconds / saved)} steps to pay back")
        return Replan(None, f"{said}; staying: {saving}{note}, but a move of "
                            f"{move_seconds:.3g} s at {saved:.3g} s saved per step would "
                            f"{steps}, over the payback limit of {payback_steps} steps",
                      speeds, current_ms, best_ms, gain)
    best.schedule = plan.schedule  # the runtime builds the schedule it runs, not its stand-in
    best.extra["replan"] = {"speeds": list(speeds), "previous_ms": current_ms}
    steps_needed = max(1, math.ceil(move_seconds / saved))
    payback = ("at once" if move_seconds <= 0 else
               f"in {steps_needed} step{'s' * (steps_needed != 1)}")
    return Replan(best, f"{said}: {moves} saves {_pct(gain)} ({current_ms:.3g} -> "
                        f"{best_ms:.3g} ms predicted){note}, paid back {payback}",
                  speeds, current_ms, best_ms, gain)


def _gain(current_ms: float, best_ms: float) -> float:
    return 1 - best_ms / current_ms if current_ms > 0 else 0.0
