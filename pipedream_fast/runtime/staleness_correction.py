"""Corrections for stale weights in the asynchronous schedules (pipedream, pipedream-vsync, 2bw).

Delay. In an asynchronous schedule a stage's gradient for microbatch m is applied to newer
weights than the ones m's forward read. The stage's delay for m is d = u - k: m's forward read
version k of the stage's weights, and its gradient is applied by the update that makes
version u + 1 (on top of version u), so d of the stage's own updates are missing from what m
saw. The IR names both (the FORWARD's version; the OPTIMIZER_STEP that lists m), so the
executor knows d exactly before the forward runs (it looks ahead to the step). PipeDream's
steady state has d = NOAM - 1 on each stage (S - 1 - s without replicas); vertical sync
gives every stage stage 0's delay; 2BW has d = 1.

Velocity. Each stage keeps v, an exponential moving average (beta = 0.9) of the updates it
applied (delta = weights after - weights before, each update), bias-corrected as
v_hat = v / (1 - beta^t) after t updates (0 before the first): the stage's current velocity,
whatever the optimizer (for SGD with momentum it tracks -lr * momentum buffer).

  predict   m's forward reads w_k + d * v_hat: the weights extrapolated over the d updates
            m will miss at the current velocity (the weight prediction of SpecTrain and
            PipeMare).
  nesterov  m's forward reads w_k + c(d) * v_hat with c(d) = beta + beta^2 + ... + beta^d:
            where momentum alone would carry the weights over d updates, each beta times the
            one before. For d = 1 this is Nesterov's look-ahead point w + beta * v; for long
            delays it extrapolates less than predict (c(d) < beta / (1 - beta) = 9).
  lr-scale  an update applies the optimizer with its learning rate divided by 1 + d_mean,
            d_mean the mean delay of the update's microbatches on this rank: the most delayed
            stages take the smallest steps (PipeMare's delay-scaled step size, without its
            annealing back to the base rate).

Weight stashing stays exact: m's backward differentiates at the very weights its forward read
(autograd keeps the shifted tensors), and the gradient lands in the stage's gradient buffers
like any other; the update is applied to the newest weights w_u. Costs: predict and nesterov
keep v and one scratch copy of the stage's weights, and each microbatch in flight holds its
shifted weights until its backward (one more weight copy per microbatch in flight); lr-scale
costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipedream_fast.schedules.registry import STALENESS

CORRECTIONS: tuple[str, ...] = STALENESS.choices or ()
BETA = 0.9  # the velocity's moving average, and nesterov's per-update decay


def lookahead(kind: str, delay: int, beta: float = BETA) -> float:
    """How many velocities a forward with `delay` moves its weights along (0: none)."""
    if delay <= 0:
        return 0.0
    if kind == "predict":
        return float(delay)
    if kind == "nesterov":
        return beta * (1.0 - beta ** delay) / (1.0 - beta)
    return 0.0


def check_kind(kind: str) -> str:
    if kind not in CORRECTIONS:
        raise ValueError(f"staleness must be one of {', '.join(CORRECTIONS)} (or None for "
                         f"none), got {kind!r}")
    return kind


class StalenessCorrection:
    """One stage's correction: the delays of its microbatches in flight and its velocity."""

    def __init__(self, kind: str, beta: float = BETA) -> None:
        self.kind = check_kind(kind)
        self.beta = beta
        self.delays: dict[int, int] = {}  # microbatch -> its delay, from its forward to its update
        self.velocity: list[torch.Tensor] | None = None  # the moving average v (not corrected)
        self.updates = 0  # t: updates averaged into v
        self._before: list[torch.Tensor] = []  # scratch: the weights before an update

    @property
    def shifts_weights(self) -> bool:
        return self.kind in ("predict", "nesterov")

    def read(self, weights: Sequence[torch.Tensor], microbatch: int, delay: int
             ) -> list[torch.Tensor] | None:
        """The weights microbatch `microbatch`'s forward reads, given the version it names
        (`weights`) and its `delay`; None for `weights` unchanged. Out of place, so its
        gradient flows into `weights`' own."""
        self.delays[microbatch] = delay
        steps = lookahead(self.kind, delay, self.beta)
        if steps == 0.0 or self.velocity is None:
            return None
        scale = steps / (1.0 - self.beta ** self.updates)
        return [w + scale * v.to(w.device, w.dtype) for w, v in zip(weights, self.velocity)]

    def learning_rate_factor(self, microbatches: Sequence[int]) -> float:
        """The factor of this update's learning rate (1 but under lr-scale); forgets the
        delays of `microbatches`, which this update ends."""
        delays = [self.delays.pop(m) for m in microbatches if m in self.delays]
        if self.kind != "lr-scale" or not delays:
            return 1.0
        return 1.0 / (1.0 + sum(delays) / len(delays))

    def before_update(self, params: Sequence[torch.Tensor]) -> None:
        if not self.shifts_weights or not params:
            return
        if len(self._before) != len(params):
            self._before = [torch.empty_like(p, dtype=torch.float32) for p in params]
        with torch.no_grad():
            torch._foreach_copy_(self._before, [p.detach() for p in params])

    def after_update(self, params: Sequence[torch.Tensor]) -> None:
        """v <- beta * v + (1 - beta) * (weights now - weights before the update)."""
        if not self.shifts_weights or not params:
            return
        with torch.no_grad():
            delta = torch._foreach_sub([p.detach().float() for p in params], self._before)
            if self.velocity is None:
                self.velocity = [torch.zeros_like(d) for d in delta]
            elif self.velocity[0].device != delta[0].device:  # restored from a checkpoint
                self.velocity = [v.to(d.device) for v, d in zip(self.velocity, delta)]
            torch._foreach_mul_(self.velocity, self.beta)
            torch._foreach_add_(self.velocity, delta, alpha=1.0 - self.beta)
        self.updates += 1

    def forget_in_flight(self) -> None:
        """A run stopped early: its microbatches in flight never reach their update."""
        self.delays.clear()

    # --- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "beta": self.beta, "updates": self.updates,
                "velocity": None if self.velocity is None
                else [v.detach().clone() for v in self.velocity]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The velocity saved by any correction (it does not depend on the kind)."""
        self.beta = float(state["beta"])
        self.updates = int(state["updates"])
        velocity = state.get("velocity")
        self.velocity = None if velocity is None else [v.detach().clone().float()
                                                       for v in velocity]
