"""A Pipeline's hold on the C++ core's CPU block cache (`csrc/cpu_cache.h`): freed CPU tensor
memory kept for reuse while the Pipeline is open, instead of malloc mapping it fresh and
faulting it in page by page at every step (`Tuning.cpu_cache_mb`). The cache is one per
process, installed as c10's CPU allocator; holds are counted, so the Pipelines of one process
(ranks as threads, a script's several) share it, and the last release puts the previous
allocator back and frees what was kept."""

from __future__ import annotations

import torch

from pipedream_fast import _C


class CpuCacheHold:
    """Holds the cache from construction to `release` (idempotent), where `device` is the CPU
    and `limit_bytes` > 0; otherwise holds nothing."""

    def __init__(self, device: torch.device, limit_bytes: int) -> None:
        self.held = (device.type == "cpu" and limit_bytes > 0
                     and bool(_C.cpu_cache_acquire(limit_bytes)))

    def release(self) -> None:
        if self.held:
            self.held = False
            _C.cpu_cache_release()


def cpu_cache_stats() -> dict[str, int | bool]:
    """The process's cache: whether installed, its users, limit, bytes kept and in use, and
    the large requests it served (hits), passed on (misses) and gave back when full."""
    return dict(_C.cpu_cache_stats())
