"""A job whose rank 0 returns from `init_process_group` a second late, as on a loaded machine
(imported by the ranks of `test_launch_starts_fn_only_once_every_rank_is_through_its_init`).
With SLOW_RANK_INIT set, importing this module (a spawned rank does, to unpickle `job`)
wraps torch's init so that rank 0 sleeps after it and records when it returned."""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

SLOW_S = 1.0
returned_at: list[float] = []


def _slow_on_rank_0(real: Any) -> Any:
    def init(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        if os.environ.get("RANK") == "0":
            time.sleep(SLOW_S)
        returned_at.append(time.monotonic())
    return init


if os.environ.get("SLOW_RANK_INIT"):
    dist.init_process_group = _slow_on_rank_0(dist.init_process_group)


def job(rank: int, world: int) -> tuple[float, float]:
    """When this rank's init returned, and when this fn began (CLOCK_MONOTONIC is one clock
    for every process of the machine)."""
    began = time.monotonic()
    return returned_at[-1], began
