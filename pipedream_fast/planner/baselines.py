"""Simple plans to compare the dynamic program against.

Each baseline fixes the stage count and splits the blocks contiguously by one rule:

* `uniform` - the same number of blocks per stage (sizes differ by at most one);
* `params`  - minimise the largest stage's parameter bytes (memory balance);
* `time`    - minimise the largest stage's forward + backward time (torchgpipe's
              balance-by-time, without replication).

Stage count and replicas: with `straight`, S = min(workers, blocks) stages of one worker each;
otherwise S is the largest divisor of the worker count that is <= the block count, and every
stage gets workers / S replicas, so all workers are used. Ranks are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipedream_fast.planner.costs import Costs
from pipedream_fast.planner.flatten import FlatStage

BASELINES = ("uniform", "params", "time")


def uniform_partition(num_blocks: int, parts: int) -> list[int]:
    """Stage start indices plus the end: `parts` runs whose lengths differ by at most one."""
    return [round(k * num_blocks / parts) for k in range(parts + 1)]


def balanced_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries of `parts` non-empty contiguous runs minimising the largest run sum."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    # best[k, j]: smallest possible largest sum when the first j blocks form k runs.
    best = np.full((parts + 1, n + 1), np.inf)
    back = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            starts = np.arange(k - 1, j)
            candidates = np.maximum(best[k - 1, starts], prefix[j] - prefix[starts])
            pick = int(np.argmin(candidates))
            best[k, j], back[k, j] = candidates[pick], starts[pick]
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(int(back[k, bounds[-1]]))
    return bounds[::-1]


def baseline_stages(strategy: str, costs: Costs, workers: int, straight: bool) -> list[FlatStage]:
    """The flat stages of baseline `strategy` on `workers` workers (contiguous ranks)."""
    n = costs.num_blocks
    if straight:
        parts, replicas = min(workers, n), 1
    else:
        parts = max(d for d in range(1, min(workers, n) + 1) if workers % d == 0)
        replicas = workers // parts
    if strategy == "uniform":
        bounds = uniform_partition(n, parts)
    elif strategy == "params":
        bounds = balanced_partition(np.diff(costs.params[0]).tolist(), parts)
    elif strategy == "time":
        bounds = balanced_partition(np.diff(costs.compute[0]).tolist(), parts)
    else:
        raise ValueError(f"unknown baseline {strategy!r}; choose one of {', '.join(BASELINES)}")
    return [FlatStage(start, stop, tuple(range(k * replicas, (k + 1) * replicas)))
            for k, (start, stop) in enumerate(zip(bounds, bounds[1:]))]
