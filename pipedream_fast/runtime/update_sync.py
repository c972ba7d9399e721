"""What every stage agrees on before a synchronous update, in one place.

A single process clips by the norm of *all* gradients, sums the gradient of a weight used
twice (an embedding tied to the output head) and, under fp16 loss scaling, skips the update
of *every* weight when *any* gradient overflowed. Split over stages, each of these needs the
other stages' gradients, so before the first update of each version a rank:

1. finishes its stages' replica all-reduces and turns the accumulated gradients into the
   update's (averaged over the step's microbatches, unscaled),
2. sums each tied weight's gradient over the stages holding it, this rank's copies first
   and then over the other holding ranks (a replica adds 1/replicas of it, so the sum counts
   each stage once),
3. all-reduces the sum of squared gradients over every rank, each stage counted once and a
   tied weight only on its first stage, then clips, and skips the update everywhere when the
   norm is not finite (an fp16 overflow, or NaN gradients under on_nan="skip").

Only synchronous schedules update every stage once per step, after all its backwards, so only
they can agree this way (the Pipeline refuses the others); all ranks then meet in step 3 in
the same order as their updates, and no rank waits there for a message a peer would send only
after its own update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipedream_fast.runtime.stage import StageRuntime


@dataclass
class TiedWeight:
    """One weight held by several stages: this rank's copies (one per stage of this rank
    holding it: a V puts an embedding and the head it is tied to on one rank), the group of
    the other ranks holding it (None when this rank holds every holder), whether each copy's
    stage is the first holder (that copy counts the weight in the norm), and each copy's
    stage's replica count."""

    params: tuple[nn.Parameter, ...]
    group: Any
    counts_in_norm: tuple[bool, ...]
    replicas: tuple[int, ...]


class LossScaler:
    """fp16 loss scaling as torch.amp.GradScaler does it (same defaults), but with the
    overflow decided across all stages: scale up after `interval` clean updates, down after
    an overflow (whose update is skipped everywhere)."""

    def __init__(self, scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        self.scale = scale
        self.growth = growth
        self.backoff = backoff
        self.interval = interval
        self._clean = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self._clean = 0
            return
        self._clean += 1
        if self._clean == self.interval:
            self.scale *= self.growth
            self._clean = 0


class GlobalUpdateSync:
    """`Executor.update_sync` for a Pipeline whose stages must agree before updating."""

    def __init__(self, group: Any, stage_replicas: dict[int, int],
                 clip_grad_norm: float | None = None, scaler: LossScaler | None = None,
                 tied: Sequence[TiedWeight] = (), skip_nonfinite: bool = False) -> None:
        self.group = group  # every rank (a world.Group); gloo: the norm is a CPU tensor
        self.stage_replicas = stage_replicas  # stage index -> its replica count
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.tied = list(tied)
        self.skip_nonfinite = skip_nonfinite  # on_nan="skip": no update from NaN gradients
        self.skipped = 0  # updates skipped for non-finite gradients
        self._decided: dict[int, list[Any]] = {}  # version -> [skip, stages still to update]
        self.last_norm: float | None = None  # the global gradient norm of the last update

    def before_update(self, version: int, microbatches: Sequence[int],
                      stages: dict[int, StageRuntime]) -> bool:
        if version in self._decided:  # decided at the rank's first stage to update
            decided = self._decided[version]
            decided[1] -= 1
            if decided[1] == 0:
                del self._decided[version]
            return bool(decided[0])
        for index, stage in stages.items():
            if stage.inflight:
                raise RuntimeError(
                    f"stage {index} updates to version {version} with microbatches "
                    f"{sorted(stage.inflight)} still awaiting their backward; clipping, tied "
                    f"weights and fp16 agree across stages only when every stage of a rank has "
                    f"finished its backwards before its first update")
            if stage.buckets is not None:
                stage.buckets.flush()
                stage.buckets.wait()
            stage.prepare_update(microbatches)
        for tie in self.tied:
            _sum_tied(tie)
        squares = self._squared_norm(stages)
        self.group.all_reduce(squares)
        norm = math.sqrt(float(squares))
        overflow = not math.isfinite(norm)
        self.last_norm = norm
        if self.clip_grad_norm is not None and not overflow:
            coef = self.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for stage in stages.values():
                    for g in stage.grads:
                        g.mul_(coef)
        skip = overflow and (self.scaler is not None or self.skip_nonfinite)
        self.skipped += skip
        if self.scaler is not None:
            self.scaler.update(overflow)
            for stage in stages.values():  # as GradScaler scales loss / microbatches
                stage.loss_scale = self.scaler.scale / len(microbatches)
        if len(stages) > 1:
            self._decided[version] = [skip, len(stages) - 1]  # the rank's other stages
        return skip

    def _squared_norm(self, stages: dict[int, StageRuntime]) -> torch.Tensor:
        """This rank's part of the squared global norm (float64, on the CPU for gloo).

        Per parameter: `stage.grads` are the ring's flat buffers (one per dtype), not one per
        parameter, so a tied weight can only be left out of its other holders' sums through
        its own gradient view. Every replica holds the averaged gradient, so each adds
        1/replicas of its square: the sum counts each stage once."""
        skip = {id(p) for t in self.tied for p, counts in zip(t.params, t.counts_in_norm)
                if not counts}
        parts = []
        for index, stage in stages.items():
            grads = [p.grad for p in stage.params if p.grad is not None and id(p) not in skip]
            if grads:
                # Accumulated in float64 (a float32 norm is ~1e-7 off, which ResNet-18's
                # training amplifies to 1e-4 in a few clipped steps).
                norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
                parts.append(norms.pow(2).sum().cpu() / self.stage_replicas[index])
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)


def _sum_tied(tie: TiedWeight) -> None:
    """Every copy of a tied weight gets the sum of all holders' gradients (a replica adds
    1/replicas of its own): this rank's copies summed into the first, that sum all-reduced
    over the other holding ranks, and copied back. Each stage's optimizer then steps its copy
    alike, so the copies stay equal."""
    grads = [(p.grad, r) for p, r in zip(tie.params, tie.replicas) if p.grad is not None]
    if not grads:
        return
    total = grads[0][0]
    for grad, replicas in grads:
        if replicas > 1:
            grad.div_(replicas)
    for grad, _ in grads[1:]:
        total.add_(grad)
    if tie.group is not None:
        tie.group.all_reduce(total)
    for grad, _ in grads[1:]:
        grad.copy_(total)
