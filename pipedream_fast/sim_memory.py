"""Each rank's memory over a simulated run, as the schedule holds it (issue 28, item 2).

The simulator says when every action runs; this module says what each rank holds while it
does, from the profile's per-block measurements (never from the runtime's measurement,
which it predicts):

    static (per stage)   parameters, gradients (one flat buffer as large), optimizer state
                         (the profile's, measured for its optimizer), and the weight ring's
                         slots: as many versions as the schedule keeps on the rank
    activations          from each FORWARD's end to the end of its BACKWARD (of its
                         BACKWARD_WEIGHT, for a split backward: zb-h1 keeps the graph
                         between the two parts), the stage's bytes per microbatch; for a
                         stage that recomputes, only its blocks' inputs and its output, and
                         during each backward (its input half, under a split) the largest
                         block's re-run

A stage's bytes per microbatch are additive over its blocks: each block's `held_bytes` (the
profiler counts every storage a block keeps for its backward, its inputs and its outputs
alike, once) minus the tensors crossing each cut inside the stage (the output of one block
is the input of the next: held once). Stage 0's microbatches are views of their minibatch,
whose storage stays as long as any of them is in flight: it is counted once per minibatch
in flight, as the runtime's measurement counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipedream_fast.formats import Plan, Profile
from pipedream_fast.ir import ActionKind as K
from pipedream_fast.planner.costs import Costs
from pipedream_fast.sim import SimResult


@dataclass
class RankMemoryPrediction:
    """One rank's predicted bytes: `static` by kind, the activations' peak and their timeline
    ((time, bytes held) at each change, in the simulation's time unit)."""

    static: dict[str, int]
    activations_peak: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def total_peak(self) -> int:
        return sum(self.static.values()) + self.activations_peak

    def to_dict(self) -> dict[str, Any]:
        return {**self.static, "activations_peak": self.activations_peak,
                "total_peak": self.total_peak}


def stage_activation_bytes(profile: Profile, start: int, stop: int,
                           microbatch_size: int, costs: Costs | None = None,
                           recomputed: bool = False) -> int:
    """What stage [start, stop) holds for one microbatch in flight (see the module's
    docstring), without stage 0's minibatch storage: the planner's figure
    (`Costs.activations`, the same rule; `Costs.recomputed_activations` for a stage that
    recomputes), at `microbatch_size`."""
    missing = [b.name for b in profile.blocks[start:stop] if "held_bytes" not in b.extra]
    if missing:
        raise ValueError(f"the profile has no held_bytes for blocks {missing}: profile the "
                         f"model again with this version (pipedream-fast profile)")
    costs = costs or Costs.from_profile(profile)
    table = costs.recomputed_activations if recomputed else costs.activations
    assert table is not None
    return round(float(table[start, stop]) * microbatch_size / profile.batch_size)


def stage_rerun_bytes(profile: Profile, start: int, stop: int, microbatch_size: int,
                      costs: Costs) -> int:
    """What a recomputing stage holds, besides its kept inputs, while its backward re-runs
    its largest block (`Costs.rerun_bytes`), at `microbatch_size`."""
    assert costs.rerun_bytes is not None
    return round(float(costs.rerun_bytes[start, stop]) * microbatch_size / profile.batch_size)


def stage_static_bytes(costs: Costs, start: int, stop: int, versions: int) -> dict[str, int]:
    params = int(costs.params[start, stop])
    return {"parameters": params, "weight_versions": versions * params, "gradients": params,
            "optimizer": int(costs.optimizer[start, stop])}


def predict_memory(result: SimResult, profile: Profile, plan: Plan, microbatch_size: int,
                   chunks: int) -> dict[int, RankMemoryPrediction]:
    """Every rank's memory over the simulated run of `plan` (its schedule `result`)."""
    schedule = result.schedule
    costs = Costs.from_profile(profile)
    recomputes = {i: bool(s.extra.get("recompute")) for i, s in enumerate(plan.stages)}
    per_mb = {i: stage_activation_bytes(profile, s.start, s.stop, microbatch_size, costs,
                                        recomputes[i])
              for i, s in enumerate(plan.stages)}
    rerun = {i: stage_rerun_bytes(profile, s.start, s.stop, microbatch_size, costs)
             if recomputes[i] else 0 for i, s in enumerate(plan.stages)}
    minibatch = round(int(profile.extra.get("input_bytes", 0)) * microbatch_size
                      / profile.batch_size) * chunks
    out: dict[int, RankMemoryPrediction] = {}
    for rank in range(schedule.num_ranks):
        static: dict[str, int] = {}
        for index in plan.stages_of_rank(rank):
            stage = plan.stages[index]
            for kind, value in stage_static_bytes(costs, stage.start, stage.stop,
                                                  schedule.max_versions[rank]).items():
                static[kind] = static.get(kind, 0) + value
        out[rank] = RankMemoryPrediction(static)
    # (time, adds: ends before starts, stage, microbatch, what: a microbatch's activations
    # or a recomputing stage's re-run during a backward)
    changes: dict[int, list[tuple[float, int, int, int, str]]] = {r: [] for r in out}
    for record in result.records:
        a = record.action
        if a.stage is None or a.microbatch is None:
            continue
        if a.kind is K.FORWARD:
            changes[record.rank].append((record.end, 1, a.stage, a.microbatch, "kept"))
        elif a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
            changes[record.rank].append((record.end, 0, a.stage, a.microbatch, "kept"))
        if a.kind in (K.BACKWARD, K.BACKWARD_INPUT) and rerun[a.stage]:
            changes[record.rank].append((record.ready, 1, a.stage, a.microbatch, "rerun"))
            changes[record.rank].append((record.end, 0, a.stage, a.microbatch, "rerun"))
    for rank, events in changes.items():
        held = 0
        in_flight: dict[int, int] = {}  # minibatch -> its microbatches in flight on stage 0
        prediction = out[rank]
        for time, adds, index, microbatch, what in sorted(events):
            sign = 1 if adds else -1
            if what == "rerun":
                held += sign * rerun[index]
                prediction.timeline.append((time, held))
                prediction.activations_peak = max(prediction.activations_peak, held)
                continue
            held += sign * per_mb[index]
            if index == 0:
                batch = microbatch // chunks
                before = in_flight.get(batch, 0)
                in_flight[batch] = before + sign
                if before == 0 and sign > 0:
                    held += minibatch
                elif in_flight[batch] == 0:
                    held -= minibatch
            prediction.timeline.append((time, held))
            prediction.activations_peak = max(prediction.activations_peak, held)
    return out
