"""Schedule generators and their registry.

    make_schedule("pipedream", num_stages=4, num_microbatches=16)             -> Schedule
    make_schedule("1f1b", 3, 8, replicas=[2, 1, 1])                            # 4 ranks
    make_schedule("localsgd", 4, 16, local_steps=2)                            # R = S = 4

A Schedule is a stream: each rank's actions are generated lazily as the executor walks them,
so `make_schedule("pipedream", 4, 10**6)` returns at once. Ranks are numbered stage by stage
(stage 0's replicas first) unless `stage_ranks` gives the mapping (as a Plan does). Each
schedule lives in its own module and declares itself with `registry.register`; every module
of this package is imported here, so a new schedule is one new file.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, declared_options, kind, names

_INFRASTRUCTURE = {"common", "layout", "lowering", "registry"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _INFRASTRUCTURE:
        importlib.import_module(f"{__name__}.{_module.name}")

SCHEDULE_NAMES: tuple[str, ...] = names()
TRAINABLE: tuple[str, ...] = names(trainable=True)
AUTOMATIC: tuple[str, ...] = tuple(n for n in TRAINABLE if kind(n).automatic)  # auto's choices
SYNCHRONOUS: tuple[str, ...] = tuple(n for n in SCHEDULE_NAMES if kind(n).synchronous)


def looped_ranks(num_stages: int, stages_per_rank: int) -> list[list[int]]:
    """Stage g on rank g mod (num_stages / stages_per_rank): the interleaved placement."""
    if stages_per_rank < 1 or num_stages % stages_per_rank:
        raise ValueError(f"stages_per_rank must divide the {num_stages} stages, got "
                         f"{stages_per_rank}")
    return [[g % (num_stages // stages_per_rank)] for g in range(num_stages)]


def _layout(num_stages: int, num_microbatches: int, replicas: Sequence[int] | None,
            stage_ranks: Sequence[Sequence[int]] | None, stages_per_rank: int | None,
            placement: Callable[[int, int], list[list[int]]] = looped_ranks) -> Layout:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least 1 stage and 1 microbatch, got {num_stages} stages and "
                         f"{num_microbatches} microbatches")
    if stages_per_rank is not None:
        if stage_ranks is not None or replicas is not None:
            raise ValueError("give stages_per_rank or a placement (stage_ranks, replicas), "
                             "not both")
        stage_ranks = placement(num_stages, stages_per_rank)
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
    used = sorted({r for rs in ranks for r in rs})
    if used != list(range(len(used))) or any(len(set(rs)) != len(rs) or not rs for rs in ranks):
        raise ValueError(f"stage_ranks must use every rank 0..{len(used) - 1}, each at most once "
                         f"per stage, got {[list(r) for r in ranks]}")
    return Layout(num_stages, num_microbatches, ranks)


def validation_window(layout: Layout, period: int) -> int:
    """Microbatches that hold a schedule's warm-up, three periods of its steady state and its
    drain: the warm-up of any rank is at most (workers x largest replica count) microbatches."""
    warmup = layout.num_ranks * max(len(r) for r in layout.stage_ranks)
    return period * (math.ceil(2 * warmup / period) + 3)


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  replicas: Sequence[int] | None = None, *,
                  stage_ranks: Sequence[Sequence[int]] | None = None,
                  chunks: int | None = None,
                  stages_per_rank: int | None = None, **schedule_options: Any) -> Schedule:
    """Generate schedule `name` (one of SCHEDULE_NAMES) as a stream.

    replicas: ranks per stage (default 1 each); stage_ranks: explicit stage -> ranks mapping;
      stages_per_rank: v stages per rank in the looped placement (interleaved schedules), or
      in the schedule's own (`ScheduleKind.placement`: zb-v's V).
    chunks: microbatches per optimizer step for gpipe, 1f1b and data-parallel
      (default: all of them, one minibatch) and for 2bw (default: the number of workers,
      rounded up to a multiple of every replica count).
    schedule_options: the options the schedule declares (`registry.ScheduleOption`), such as
      localsgd's local_steps (H, default 1) and model_replicas (R, default num_stages).
    Raises ValueError for an unknown name or parameters that do not apply or do not fit.
    """
    spec = kind(name)
    layout = _layout(num_stages, num_microbatches, replicas, stage_ranks, stages_per_rank,
                     spec.placement or looped_ranks)
    given = {k: v for k, v in schedule_options.items() if v is not None}
    spec.check_options(given)
    options = Options(chunks, given)
    config, params = spec.options(layout, options)
    schedule = spec.generate(config)
    schedule.params = {"replicas": [layout.replicas(s) for s in range(num_stages)], **params}
    period = spec.period(config)
    ranks = [list(r) for r in layout.stage_ranks]

    def window(n: int) -> Schedule:
        return make_schedule(name, num_stages, n, stage_ranks=ranks, chunks=chunks,
                             **schedule_options)

    schedule.attach_window(window, validation_window(layout, period), period)
    return schedule


__all__ = ["AUTOMATIC", "SCHEDULE_NAMES", "SYNCHRONOUS", "TRAINABLE", "declared_options", "kind",
           "looped_ranks", "make_schedule", "names"]
