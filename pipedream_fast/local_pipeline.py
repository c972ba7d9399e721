"""`LocalPipeline`: kept for one release as the name of `Pipeline(..., ranks="threads")`.

Every rank of a plan as a thread of this process is now a choice of the one `Pipeline`
(`ranks="threads"`, `workers=N`), with everything a Pipeline has: evaluation, save and
`load`, `on_nan`, global clipping, precision, tied weights, checkpoints every N steps and on
SIGTERM. `LocalPipeline(model, loss_fn, optimizer, plan, ...)` builds exactly that; new code
should call `Pipeline` (see `rank_threads` for how the threads are driven).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import Plan
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.rank_threads import WorkerStuck
from pipedream_fast.runtime.stage import OptimizerFactory
from pipedream_fast.tuning import Tuning

__all__ = ["LocalPipeline", "WorkerStuck"]


class LocalPipeline(Pipeline):
    """`Pipeline(model, loss_fn, optimizer, plan=plan, ..., ranks="threads")`, with the rank
    count taken from the plan (the old signature: `plan` is required and positional)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 optimizer: OptimizerFactory, plan: Plan | str | os.PathLike[str],
                 schedule: str = "pipedream", chunks: int | None = None,
                 timeout: float = 300.0, trace: bool = False, seed: int = 0, *,
                 tuning: Tuning | None = None, **options: Any) -> None:
        super().__init__(model, loss_fn, optimizer, plan=plan, schedule=schedule,
                         chunks=chunks, timeout=timeout, trace=trace, seed=seed,
                         tuning=tuning, ranks="threads", **options)
