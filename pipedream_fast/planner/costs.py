"""The planner's cost and memory model, over prefix sums so every range query is O(1).

Times are in ms, sizes in bytes, bandwidths in bytes/s. Blocks are 0..L-1; a stage covers the
half-open block range [i, j); the cut at boundary s (1 <= s < L) lies after block s-1.

    compute(i, j)      = sum of forward_ms + backward_ms over blocks i..j-1
    allreduce(i, j, r) = 2 (r-1) params(i, j) / (r B)            (0 when r = 1)
    update(i, j)       = the profile's optimizer step + gradient clearing (+ the averaging
                         pass when an update covers several microbatches, + a weight copy for
                         2bw, which snapshots every update), 0 where the profile lacks them
    stage_time         = (compute + share (update + allreduce)) / r          on CPU
                         (max(compute, share allreduce) + share update) / r   on GPU
    comm(s)            = 2 activation_bytes[s-1] / B               (activations out, gradients back)

`share` is one over the microbatches each replica processes per update: 1 for pipedream (an
update per microbatch), chunks / r for the schedules that update once per step.

Two departures from PipeDream's formula, both measured (bench/results/sim_accuracy.md,
bench/results/vs_ddp.md): a ring all-reduce sends and receives 2 (r-1)/r of the parameters
per replica at once over full-duplex links, so it takes 2 (r-1) P / (r B), not 4; and on CPU
the all-reduce does not hide behind the backward (gloo's threads copy and sum on the cores
that compute), so it is added, while on GPU NCCL overlaps it with backward kernels
(PipeDream's max). The update costs were missing altogether: a step of model A's fc layers
costs 45 ms against 430 ms of compute.

Memory of one replica of a stage (what a worker must hold), with NOAM = ceil(workers from this
stage to the end of the pipeline / replicas of this stage):

    (1 + versions) x parameters + one gradient buffer + one optimizer state
        + in_flight x activations (+ on the first stage, the minibatch its microbatches view)

(the live weights, and the weight ring's slots: one per version the schedule keeps, even
for a flushing schedule that never retains one, as the runtime allocates them)

    schedule    weight versions   microbatches in flight
    pipedream   NOAM              NOAM
    2bw         2                 NOAM   (1F1B-style steady state)
    1f1b        1                 NOAM
    gpipe       1                 all M microbatches of a minibatch

zb-v, dualpipe-v and interleaved-zb hold several stages per rank, and a rank's stages do not
all peak at once: told the plan's ranks and stages per rank (`MemoryModel.ranks`), a stage
counts its share of what its rank holds at the rank's peak, from the schedule's own order
(`ScheduleKind.stage_stashed`; the rank's sum is the generator's `most_in_flight`: 2p on p
ranks for zb-v and interleaved-zb over 2 stages per rank, 2p + 1 for dualpipe-v, at m >= 2p),
and v weight-version slots for each of its v stages, as the runtime allocates them
(`ScheduleKind.stage_versions`).

Recomputation (`MemoryModel.recompute`) trades a stage's activations for one more forward: a
recomputed stage keeps per microbatch only what enters each of its blocks and what leaves
the last (`Costs.recomputed_activations`), plus, once, the largest block's activations while
its backward re-runs it (`Costs.rerun_bytes`), and its backward costs its forward again:

    recompute   a stage keeps its activations          a stage recomputes
    none        always                                 never
    all         never                                  always
    auto        where that fits the limit              only where keeping them does not fit

`auto` is the memory-capped plan's choice, per stage: recomputing only ever makes a stage
slower and smaller, so a stage keeps its activations whenever they fit, and the dynamic
program, which costs each stage by itself, stays exact.

Assumptions: only parameters are versioned (the optimizer updates the newest version, so its
state and the gradients exist once); "activations" of one in-flight microbatch are the bytes
the stage holds until its backward: its blocks' `held_bytes` (saved tensors, inputs and
outputs, each storage once) less the cuts inside the stage, counted once (`sim_memory` does
the same; older profiles: the `saved_bytes` sum, or the stage's input cut plus every cut its
blocks produce). The profile's batch is the microbatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from pipedream_fast.formats import Profile
from pipedream_fast.schedules import kind, names

# Schedules with memory rules of their own; the others plan as one of these (`plans_as`).
SCHEDULES = tuple(n for n in names() if kind(n).plans_as is None)


def ranges(prefix: np.ndarray) -> np.ndarray:
    """M[i, j] = prefix[j] - prefix[i]: the sum over blocks [i, j) for every pair (j > i)."""
    return prefix[None, :] - prefix[:, None]


@dataclass(frozen=True)
class Costs:
    """Per-block figures of a profile as prefix sums and range matrices."""

    names: tuple[str, ...]
    compute: np.ndarray      # (L+1, L+1) ms of compute for [i, j)
    params: np.ndarray       # (L+1, L+1) parameter bytes of [i, j)
    optimizer: np.ndarray    # (L+1, L+1) optimizer-state bytes of [i, j)
    activations: np.ndarray  # (L+1, L+1) bytes saved per in-flight microbatch by [i, j)
    cut_bytes: np.ndarray    # (L+1,) cut_bytes[s]: bytes crossing boundary s (s = 1..L-1)
    update: np.ndarray       # (L+1, L+1) ms of an optimizer step and gradient clearing
    grad_scale: np.ndarray   # (L+1, L+1) ms of averaging gradients over several microbatches
    snapshot: np.ndarray     # (L+1, L+1) ms of one copy of the weights
    overlap: bool = False    # the all-reduce hides behind compute (GPU) or adds to it (CPU)
    input_bytes: float = 0.0  # the model's input per microbatch, when held per minibatch
    forward: np.ndarray | None = None  # (L+1, L+1) ms of the forward alone: a re-run's cost
    recomputed_activations: np.ndarray | None = None  # (L+1, L+1) per microbatch, recomputed
    rerun_bytes: np.ndarray | None = None  # (L+1, L+1) the largest block's re-run, held once

    @property
    def num_blocks(self) -> int:
        return len(self.names)

    @classmethod
    def from_profile(cls, profile: Profile) -> Costs:
        blocks = profile.blocks
        zero = [0.0]
        compute = np.cumsum(zero + [b.forward_ms + b.backward_ms for b in blocks])
        params = np.cumsum(zero + [float(b.parameter_bytes) for b in blocks])
        optimizer = np.cumsum(zero + [float(b.optimizer_state_bytes) for b in blocks])
        cut = np.array([0.0] + [float(b.activation_bytes) for b in blocks])  # cut[s]: after s-1
        if all("held_bytes" in b.extra for b in blocks):
            # What a stage holds per microbatch (as `sim_memory` and the runtime count it):
            # its blocks' held bytes, the cuts inside it once, stage 0's input aside (a
            # view of the minibatch, held per minibatch: `MemoryModel.minibatch_bytes`).
            held = ranges(np.cumsum(zero + [float(b.extra["held_bytes"]) for b in blocks]))
            after = np.cumsum(zero + [float(b.activation_bytes) for b in blocks])
            before_last = np.concatenate([[0.0], after[:-1]])  # before_last[j] = after[j-1]
            saved = held - (before_last[None, :] - after[:, None])
            saved[0, :] -= float(profile.extra.get("input_bytes", 0))
        elif all("saved_bytes" in b.extra for b in blocks):
            saved = ranges(np.cumsum(zero + [float(b.extra["saved_bytes"]) for b in blocks]))
        else:
            # Fallback: what enters the stage plus everything its blocks produce.
            entering = cut.copy()
            entering[0] = float(profile.extra.get("input_bytes", 0))
            saved = ranges(np.cumsum(np.concatenate([[0.0], cut[1:]]))) + entering[:, None]

        forward = ranges(np.cumsum(zero + [b.forward_ms for b in blocks]))
        # Recomputed: every block keeps only its input (the cut before it; stage 0's is the
        # minibatch's, counted apart) and the last its output, the cuts' sum; while a block's
        # backward re-runs it, its own activations, less those two, are held as well.
        after = np.cumsum(zero + [float(b.activation_bytes) for b in blocks])
        entering = cut.copy()
        entering[0] = 0.0
        recomputed = entering[:, None] + (after[None, :] - after[:, None])
        model_input = float(profile.extra.get("input_bytes", 0))
        inner = [max(0.0, float(b.extra.get("held_bytes", b.extra.get("saved_bytes", 0.0)))
                     - (cut[k] if k else model_input) - cut[k + 1])
                 for k, b in enumerate(blocks)]
        rerun = np.zeros((len(blocks) + 1, len(blocks) + 1))
        for i in range(len(blocks)):
            rerun[i, i + 1:] = np.maximum.accumulate(inner[i:])

        def measured(*keys: str) -> np.ndarray:
            if not all(key in b.extra for b in blocks for key in keys):
                return ranges(np.zeros(len(blocks) + 1))  # older profiles: updates are free
            return ranges(np.cumsum(zero + [sum(float(b.extra[k]) for k in keys) for b in blocks]))

        return cls(names=tuple(b.name for b in blocks), compute=ranges(compute),
                   params=ranges(params), optimizer=ranges(optimizer), activations=saved,
                   cut_bytes=cut, update=measured("optimizer_ms", "grad_zero_ms"),
                   grad_scale=measured("grad_scale_ms"), snapshot=measured("snapshot_ms"),
                   overlap=profile.device.startswith("cuda"),
                   input_bytes=float(profile.extra.get("input_bytes", 0))
                   if all("held_bytes" in b.extra for b in blocks) else 0.0,
                   forward=forward, recomputed_activations=recomputed, rerun_bytes=rerun)


@overload
def allreduce_ms(param_bytes: np.ndarray, replicas: int, bandwidth: float) -> np.ndarray: ...
@overload
def allreduce_ms(param_bytes: float, replicas: int, bandwidth: float) -> float: ...
def allreduce_ms(param_bytes: np.ndarray | float, replicas: int, bandwidth: float) -> np.ndarray | float:
    """2 (r-1) P / (r B) in ms: what a ring all-reduce sends (and, at the same time, receives)
    per replica, over the full-duplex link B."""
    if replicas <= 1:
        return param_bytes * 0.0
    return 2.0 * (replicas - 1) * param_bytes / (replicas * bandwidth) * 1e3


@overload
def comm_ms(cut_bytes: np.ndarray, bandwidth: float) -> np.ndarray: ...
@overload
def comm_ms(cut_bytes: float, bandwidth: float) -> float: ...
def comm_ms(cut_bytes: np.ndarray | float, bandwidth: float) -> np.ndarray | float:
    """2 a / B in ms: activations forward and their gradients backward across one cut."""
    return 2.0 * cut_bytes / bandwidth * 1e3


RECOMPUTE = ("none", "auto", "all")


@dataclass(frozen=True)
class MemoryModel:
    """Per-worker capacity and what the schedule keeps; `limit=None` means unlimited.
    `recompute`: whether a stage may, must or may not recompute its activations (see the
    module's docstring)."""

    schedule: str
    limit: int | None = None
    chunks: int = 1  # microbatches per step (gpipe keeps them all in flight)
    recompute: str = "none"
    # A plan of several stages per rank (one replica each) on its schedule's own placement:
    # its ranks and stages per rank, for the schedules that count a stage's share of its
    # rank's peak (`ScheduleKind.stage_stashed`); None: the per-stage rule (`stashed`).
    ranks: int | None = None
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in names():
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(names())}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} when planning, "
                             f"got {self.recompute!r}")

    @property
    def varies_with_noam(self) -> bool:
        """Whether a stage's footprint depends on how many workers follow it (NOAM)."""
        return any(f(1) != f(2) for f in (self.versions, self.in_flight))

    @property
    def depends_on_position(self) -> bool:
        return self.limit is not None and self.varies_with_noam

    # The rules themselves are declared with each schedule (`ScheduleKind`).
    @property
    def _by_rank(self) -> bool:
        """Whether the rules of a plan of several stages per rank apply (`ranks`)."""
        return self.ranks is not None and self.stages_per_rank > 1

    def versions(self, noam: int) -> int:
        spec = kind(self.schedule)
        if self._by_rank and spec.stage_versions is not None:
            return spec.stage_versions(self.stages_per_rank)
        return spec.weight_versions(noam)

    def in_flight(self, noam: int) -> int:
        spec = kind(self.schedule)
        if self._by_rank and spec.stage_stashed is not None:
            assert self.ranks is not None
            return spec.stage_stashed(self.ranks, self.stages_per_rank, noam, self.chunks)
        return spec.stashed(noam, self.chunks)

    def parts(self, costs: Costs, start: int, stop: int, noam: int,
              recomputed: bool) -> dict[str, float]:
        """Where the bytes of one replica of stage [start, stop) go, by kind."""
        params = float(costs.params[start, stop])
        if recomputed:
            per_mb = float(_required(costs.recomputed_activations)[start, stop])
            rerun = float(_required(costs.rerun_bytes)[start, stop])
        else:
            per_mb, rerun = float(costs.activations[start, stop]), 0.0
        out = {"parameters": params, "weight_versions": self.versions(noam) * params,
               "gradients": params, "optimizer": float(costs.optimizer[start, stop]),
               "activations": self.in_flight(noam) * per_mb + rerun}
        if start == 0:
            out["minibatch"] = self.minibatch_bytes(costs)
        return out

    def stage_bytes(self, costs: Costs, noam: int, recomputed: bool = False) -> np.ndarray:
        """(L+1, L+1) bytes one replica of stage [i, j) needs at this NOAM, keeping its
        activations or (`recomputed`) making them again."""
        if recomputed:
            activations = (self.in_flight(noam) * _required(costs.recomputed_activations)
                           + _required(costs.rerun_bytes))
        else:
            activations = self.in_flight(noam) * costs.activations
        out = (self.versions(noam) + 2) * costs.params + costs.optimizer + activations
        out[0, :] += self.minibatch_bytes(costs)
        return out

    def recomputes(self, costs: Costs, noam: int) -> np.ndarray:
        """(L+1, L+1) whether stage [i, j) recomputes at this NOAM (see the module's
        docstring: `auto` only where keeping its activations does not fit)."""
        if self.recompute == "none" or costs.forward is None:
            return np.zeros_like(costs.params, dtype=bool)
        if self.recompute == "all":
            return np.ones_like(costs.params, dtype=bool)
        if self.limit is None:
            return np.zeros_like(costs.params, dtype=bool)
        return self.stage_bytes(costs, noam) > self.limit

    def replica_bytes(self, costs: Costs, start: int, stop: int, noam: int,
                      recomputed: bool = False) -> int:
        """Bytes one replica of stage [start, stop) needs at this NOAM."""
        return int(sum(self.parts(costs, start, stop, noam, recomputed).values()))

    def minibatch_bytes(self, costs: Costs) -> float:
        """Stage 0's microbatches are views of their minibatch, which stays whole."""
        return costs.input_bytes * self.chunks

    def needed_bytes(self, costs: Costs, noam: int) -> np.ndarray:
        """(L+1, L+1) bytes one replica of stage [i, j) needs at this NOAM, recomputing
        where this model has it recompute."""
        keep = self.stage_bytes(costs, noam)
        if self.recompute == "none" or costs.forward is None:
            return keep
        return np.where(self.recomputes(costs, noam), self.stage_bytes(costs, noam, True), keep)

    def fits(self, costs: Costs, noam: int) -> np.ndarray:
        if self.limit is None:
            return np.ones_like(costs.params, dtype=bool)
        return self.needed_bytes(costs, noam) <= self.limit

    def compute_ms(self, costs: Costs, noam: int) -> np.ndarray:
        """(L+1, L+1) ms of compute of a replica of [i, j) at this NOAM: forward and
        backward, and the forward once more where the stage recomputes."""
        recomputed = self.recomputes(costs, noam)
        if not recomputed.any():
            return costs.compute
        return costs.compute + np.where(recomputed, _required(costs.forward), 0.0)


def _required(table: np.ndarray | None) -> np.ndarray:
    assert table is not None, "Costs made by Costs.from_profile carry the recompute tables"
    return table


def noam(workers_from_here: int, replicas: int) -> int:
    """Number of optimal active minibatches: ceil(workers from this stage on / replicas)."""
    return math.ceil(workers_from_here / replicas)


def update_share(memory: MemoryModel, replicas: int) -> float:
    """One over the microbatches a replica of a stage processes per update: pipedream updates
    after each of its microbatches; the others once per step of `chunks` microbatches, which
    the stage's replicas share."""
    if not kind(memory.schedule).chunked_steps:
        return 1.0
    return 1.0 / max(1, memory.chunks // replicas)


def update_ms(costs: Costs, memory: MemoryModel, replicas: int) -> np.ndarray:
    """(L+1, L+1) ms one update of a replica of [i, j) costs: step and clearing, the averaging
    pass when it covers several microbatches, a weight copy when every update keeps one."""
    ms = costs.update
    if update_share(memory, replicas) < 1.0:
        ms = ms + costs.grad_scale
    if kind(memory.schedule).weight_versions(1) > 1:  # 2bw: a new version on every update
        ms = ms + costs.snapshot
    return ms



def sync_ms(costs: Costs, memory: MemoryModel, replicas: int, bandwidth: float,
            updates: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(L+1, L+1) x 2: per microbatch of one replica of [i, j), its share of the all-reduce
    among `replicas` over `bandwidth` and of the update (zero where `updates` is False: a
    stage's update is charged once, on the innermost level)."""
    share = update_share(memory, replicas)
    reduce = share * allreduce_ms(costs.params, replicas, bandwidth)
    update = share * update_ms(costs, memory, replicas) if updates else reduce * 0.0
    return reduce, update


def stage_ms(costs: Costs, unit: Any, reduce: Any, update: Any, replicas: Any) -> Any:
    """Time per microbatch of a stage whose `replicas` units take `unit` ms each (compute, or
    an inner pipeline's bottleneck) plus their `reduce` and `update` shares; arrays broadcast."""
    hidden = np.maximum(unit, reduce) if costs.overlap else unit + reduce
    return (hidden + update) / replicas
