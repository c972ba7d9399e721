"""The one place a schedule is declared: its generator and everything else about it.

Each schedule module ends with `register(ScheduleKind(...))`; `pipedream_fast.schedules`
imports every module of the package, so adding a schedule is adding one file. Front ends,
the CLI, the planner and the simulator ask the registry (`kind(name)`, `names()`), never a
list of names of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config
from pipedream_fast.schedules.layout import Layout


@dataclass(frozen=True)
class Options:
    """What a caller may set beyond the layout; None means the schedule's default."""

    chunks: int | None = None
    local_steps: int | None = None
    model_replicas: int | None = None


# (layout, options) -> the generator's Config and the parameters to record in the Schedule.
Configure = Callable[[Layout, Options], tuple[Config, dict[str, Any]]]


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule: how to generate it and what it is.

    synchronous: flushes every step, so training equals gradient accumulation over the step's
      microbatches; `Pipeline.step` works. Otherwise microbatches stream across steps.
    trainable: the runtime can train it (else simulate only).
    automatic: `--schedule auto` may choose it by predicted throughput (False for localsgd,
      which trains another algorithm: R models averaged, with H and R chosen by the user).
    chunked_steps: a step is one minibatch split into microbatches; the train command then
      defaults to one microbatch per worker (otherwise one microbatch per step).
    plans_as: the schedule whose memory rules the planner uses for it (default: itself).
    weight_versions(noam) and stashed(noam, microbatches_per_step): the planner's memory
      rules per stage, with noam = ceil(workers from the stage on / its replicas).
    period(config): microbatches after which the steady state repeats (validation windows).
    split_backward: it splits backwards into input and weight parts (stages record the calls
      of their modules for that).
    planning: `make_plan` options this schedule needs (a strategy, stages per rank).
    """

    name: str
    order: int
    generate: Callable[[Config], Schedule]
    options: Configure
    summary: str
    weight_versions: Callable[[int], int]
    stashed: Callable[[int, int], int]
    synchronous: bool = False
    trainable: bool = True
    automatic: bool = True
    chunked_steps: bool = True
    plans_as: str | None = None
    split_backward: bool = False
    planning: Mapping[str, Any] = field(default_factory=dict)
    period: Callable[[Config], int] = field(
        default=lambda c: math.lcm(c.chunks,
                                   *(len(r) for r in c.layout.stage_ranks)))


_KINDS: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> ScheduleKind:
    if kind.name in _KINDS:
        raise ValueError(f"schedule {kind.name!r} is registered twice")
    _KINDS[kind.name] = kind
    return kind


def names(trainable: bool = False) -> tuple[str, ...]:
    """Registered schedule names in display order (only trainable ones if asked)."""
    kinds = sorted(_KINDS.values(), key=lambda k: (k.order, k.name))
    return tuple(k.name for k in kinds if k.trainable or not trainable)


def splits_backward(name: str) -> bool:
    """Whether schedule `name` splits backwards (False for names not registered, such as
    hand-written schedules, which use whole backwards unless they say otherwise)."""
    return name in _KINDS and _KINDS[name].split_backward


def kind(name: str) -> ScheduleKind:
    if name not in _KINDS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(names())}")
    return _KINDS[name]


def no_options(name: str, options: Options) -> None:
    given = [k for k in ("chunks", "local_steps", "model_replicas")
             if getattr(options, k) is not None]
    if given:
        raise ValueError(f"{name} takes no {', '.join(given)}; it updates after every round "
                         f"of microbatches")


def flush_options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    """Synchronous schedules: one update per `chunks` (default: all of them)."""
    if options.local_steps is not None or options.model_replicas is not None:
        raise ValueError("local_steps and model_replicas apply only to localsgd")
    m = layout.num_microbatches if options.chunks is None else \
        options.chunks
    if m < 1:
        raise ValueError(f"chunks must be >= 1, got {m}")
    return Config(layout, chunks=m), {"chunks": m}
