"""Schedule generators and their registry.

    make_schedule("pipedream", num_stages=4, num_microbatches=16)             -> Schedule
    make_schedule("1f1b", 3, 8, replicas=[2, 1, 1])                            # 4 ranks
    make_schedule("localsgd", 4, 16, local_steps=2)                            # R = S = 4

Ranks are numbered stage by stage (stage 0's replicas first) unless `stage_ranks` gives the
mapping (as a Plan does). Each generator lives in its own small module; `common` holds the
layout, the 1F1B order and the lowering passes they share.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules import (data_parallel, gpipe, localsgd, one_f_one_b, pipedream,
                                      pipedream_vsync, two_bw)
from pipedream_fast.schedules.common import Config, Layout

_GENERATORS: dict[str, Callable[[Config], Schedule]] = {
    "gpipe": gpipe.generate,
    "1f1b": one_f_one_b.generate,
    "pipedream": pipedream.generate,
    "pipedream-vsync": pipedream_vsync.generate,
    "2bw": two_bw.generate,
    "data-parallel": data_parallel.generate,
    "localsgd": localsgd.generate,
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_GENERATORS)
SYNCHRONOUS = ("gpipe", "1f1b", "data-parallel")  # one step per minibatch, flushed


def _layout(num_stages: int, num_microbatches: int, replicas: Sequence[int] | None,
            stage_ranks: Sequence[Sequence[int]] | None) -> Layout:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least 1 stage and 1 microbatch, got {num_stages} stages and "
                         f"{num_microbatches} microbatches")
    if stage_ranks is not None:
        ranks = tuple(tuple(int(r) for r in rs) for rs in stage_ranks)
        if replicas is not None and list(replicas) != [len(r) for r in ranks]:
            raise ValueError(f"replicas {list(replicas)} contradict stage_ranks "
                             f"{[list(r) for r in ranks]}")
    else:
        replicas = [1] * num_stages if replicas is None else [int(r) for r in replicas]
        if len(replicas) != num_stages or min(replicas) < 1:
            raise ValueError(f"replicas must list one count >= 1 per stage ({num_stages}), "
                             f"got {list(replicas)}")
        starts = [sum(replicas[:s]) for s in range(num_stages)]
        ranks = tuple(tuple(range(starts[s], starts[s] + replicas[s])) for s in range(num_stages))
    if len(ranks) != num_stages:
        raise ValueError(f"stage_ranks lists {len(ranks)} stages, expected {num_stages}")
    flat = sorted(r for rs in ranks for r in rs)
    if flat != list(range(len(flat))):
        raise ValueError(f"stage_ranks must use each rank 0..{len(flat) - 1} exactly once, "
                         f"got {[list(r) for r in ranks]}")
    return Layout(num_stages, num_microbatches, ranks)


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  replicas: Sequence[int] | None = None, local_steps: int | None = None, *,
                  stage_ranks: Sequence[Sequence[int]] | None = None,
                  step_microbatches: int | None = None,
                  model_replicas: int | None = None) -> Schedule:
    """Generate schedule `name` (one of SCHEDULE_NAMES).

    replicas: ranks per stage (default 1 each); stage_ranks: explicit stage -> ranks mapping.
    step_microbatches: microbatches per optimizer step for gpipe, 1f1b and data-parallel
      (default: all of them, one minibatch) and for 2bw (default: the number of workers,
      rounded up to a multiple of every replica count).
    local_steps (H, default 1) and model_replicas (R, default num_stages): localsgd only.
    Raises ValueError for an unknown name or parameters that do not apply or do not fit.
    """
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    layout = _layout(num_stages, num_microbatches, replicas, stage_ranks)
    reps = [layout.replicas(s) for s in range(num_stages)]
    params: dict = {"replicas": reps}
    if name != "localsgd" and (local_steps is not None or model_replicas is not None):
        raise ValueError(f"local_steps and model_replicas apply only to localsgd, not {name}")
    if step_microbatches is not None and name not in SYNCHRONOUS + ("2bw",):
        raise ValueError(f"step_microbatches applies to {', '.join(SYNCHRONOUS)} and 2bw; "
                         f"{name} steps after every round of microbatches")
    config = Config(layout)
    if name in SYNCHRONOUS:
        m = num_microbatches if step_microbatches is None else step_microbatches
        if m < 1:
            raise ValueError(f"step_microbatches must be >= 1, got {m}")
        config = Config(layout, step_microbatches=m)
        params["step_microbatches"] = m
    elif name == "2bw":
        workers, lcm = layout.num_ranks, math.lcm(*reps)
        m = step_microbatches or math.ceil(workers / lcm) * lcm
        if m < workers or m % lcm:
            raise ValueError(f"2bw needs step_microbatches >= the number of workers ({workers}) "
                             f"and a multiple of every replica count {reps}, so that at most 2 "
                             f"weight versions are live; got {m}")
        config = Config(layout, step_microbatches=m)
        params["step_microbatches"] = m
    elif name == "localsgd":
        if set(reps) != {1}:
            raise ValueError(f"localsgd replicates the whole model (model_replicas), not stages; "
                             f"got stage replicas {reps}")
        h = 1 if local_steps is None else local_steps
        r = num_stages if model_replicas is None else model_replicas
        if h < 1 or r < 1:
            raise ValueError(f"local_steps and model_replicas must be >= 1, got {h} and {r}")
        config = Config(layout, local_steps=h, model_replicas=r)
        params.update(local_steps=h, model_replicas=r)
    schedule = _GENERATORS[name](config)
    schedule.params = params
    return schedule


__all__ = ["SCHEDULE_NAMES", "make_schedule"]
