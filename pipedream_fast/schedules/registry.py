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
class ScheduleOption:
    """An option a schedule declares: a `Pipeline` keyword, and the flag `--name-with-dashes`
    of `pipedream-fast train` and `simulate`, both made from this declaration."""

    name: str
    type: type
    help: str
    metavar: str | None = None  # the flag's value in --help (default: the name, upper case)
    choices: tuple[str, ...] | None = None  # the values a str option takes


# The asynchronous schedules' option: a correction for stale weights (see
# `pipedream_fast.runtime.staleness_correction`), recorded in the schedule's params.
STALENESS = ScheduleOption(
    "staleness", str, "a correction for stale weights: predict (forwards read the weights "
    "extrapolated over their delay), nesterov (a delay-aware look-ahead along the momentum), "
    "lr-scale (each update's learning rate divided by 1 + its delay)", metavar="KIND",
    choices=("predict", "nesterov", "lr-scale"))


def staleness_params(options: Options) -> dict[str, Any]:
    """The schedule params that record the staleness correction asked for, if any."""
    value = options.get("staleness")
    return {} if value is None else {"staleness": value}


@dataclass(frozen=True)
class Options:
    """What a caller may set beyond the layout: chunks, and the values of the options the
    schedule declares (`ScheduleKind.own_options`); absent or None means its default."""

    chunks: int | None = None
    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.values.get(name)


# (layout, options) -> the generator's Config and the parameters to record in the Schedule.
Configure = Callable[[Layout, Options], tuple[Config, dict[str, Any]]]


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule: how to generate it and what it is.

    synchronous: flushes every step, so training equals gradient accumulation over the step's
      microbatches; `Pipeline.step` works. Otherwise microbatches stream across steps.
    trainable: the runtime can train it (else simulate only).
    automatic: `--schedule auto` may choose it by predicted throughput; a schedule joins
      only by saying so (not localsgd, which trains another algorithm: R models averaged,
      with H and R chosen by the user).
    own_options: the options only this schedule takes (localsgd's local_steps and
      model_replicas); callers pass them by name, and nothing else lists them.
    whole_minibatches: a step is one loader minibatch trained as one microbatch (no
      chunks, no microbatch_size).
    chunked_steps: a step is one minibatch split into microbatches; the train command then
      defaults to one microbatch per worker (otherwise one microbatch per step).
    plans_as: the schedule whose memory rules the planner uses for it (default: itself).
    weight_versions(noam) and stashed(noam, microbatches_per_step): the planner's memory
      rules per stage, with noam = ceil(workers from the stage on / its replicas).
    stage_stashed(ranks, stages_per_rank, noam, microbatches_per_step): for a schedule that
      holds several stages per rank on its own placement (`planning`), the microbatches in
      flight the planner counts for the stage at this NOAM (its plan's stages one replica
      each, so NOAM = stages from it on), split so that a rank's stages add up to the most
      the rank holds at once (its generator's `most_in_flight`); `MemoryModel` uses it when
      told the ranks and stages per rank, whatever `plans_as` says (default: `stashed`).
    stage_versions(stages_per_rank): with `stage_stashed`, the weight-version slots of each
      stage: the generator's `max_versions` of its rank, which the runtime allocates for
      every stage of the rank (default: `weight_versions`).
    period(config): microbatches after which the steady state repeats (validation windows).
    split_backward: it splits backwards into input and weight parts (stages record the calls
      of their modules for that).
    planning: `make_plan` options this schedule needs (a strategy, stages per rank).
    placement(num_stages, stages_per_rank): stage -> ranks when `make_schedule` is given
      stages_per_rank (default: the looped placement, stage g on rank g mod p; zb-v: a V).
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
    automatic: bool = False
    own_options: tuple[ScheduleOption, ...] = ()
    whole_minibatches: bool = False
    chunked_steps: bool = True
    # Microbatches per step a command uses unless told (--chunks), for `workers` ranks: one
    # per worker fills a 1F1B pipeline; DualPipeV needs two per worker.
    default_chunks: Callable[[int], int] = field(default=lambda workers: workers)
    plans_as: str | None = None
    stage_stashed: Callable[[int, int, int, int], int] | None = None
    stage_versions: Callable[[int], int] | None = None
    split_backward: bool = False
    planning: Mapping[str, Any] = field(default_factory=dict)
    placement: Callable[[int, int], list[list[int]]] | None = None
    period: Callable[[Config], int] = field(
        default=lambda c: math.lcm(c.chunks,
                                   *(len(r) for r in c.layout.stage_ranks)))

    def check_options(self, values: Mapping[str, Any]) -> None:
        """Refuses options this schedule does not declare, and values below 1."""
        own = {o.name: o for o in self.own_options}
        for name, value in values.items():
            if name not in own:
                raise ValueError(f"{name} is not an option of schedule {self.name!r}"
                                 + (f" (its options: {', '.join(own)})" if own else ""))
            choices = own[name].choices
            if value is not None and choices is not None and value not in choices:
                raise ValueError(f"{self.name}: {name} must be one of {', '.join(choices)}, "
                                 f"got {value!r}")
            wrong = not isinstance(value, own[name].type) or isinstance(value, bool)
            if value is not None and (wrong or (isinstance(value, int) and value < 1)):
                what = "an integer" if own[name].type is int else own[name].type.__name__
                raise ValueError(f"{self.name}: {name} must be {what} >= 1, got {value!r}")

    def check_microbatching(self, chunks: int | None, microbatch_size: int | None) -> None:
        """`whole_minibatches`: no chunks (but 1) and no microbatch size."""
        if not self.whole_minibatches:
            return
        given = [f"{n}={v}" for n, v, ok in (("chunks", chunks, (None, 1)),
                                              ("microbatch_size", microbatch_size, (None,)))
                 if v not in ok]
        if given:
            own = ", ".join(o.name for o in self.own_options) or "no options"
            raise ValueError(f"{self.name} trains each minibatch of the loader as one "
                             f"microbatch; it takes {own}, not {' and '.join(given)}")


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


def declared_options() -> dict[str, tuple[ScheduleOption, list[str]]]:
    """Every option a registered schedule declares, with the schedules declaring it."""
    out: dict[str, tuple[ScheduleOption, list[str]]] = {}
    for name in names():
        for option in _KINDS[name].own_options:
            out.setdefault(option.name, (option, []))[1].append(name)
    return out


def no_options(name: str, options: Options) -> None:
    if options.chunks is not None:
        raise ValueError(f"{name} takes no chunks; it updates after every round of "
                         f"microbatches")


def flush_options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    """Synchronous schedules: one update per `chunks` (default: all of them)."""
    m = layout.num_microbatches if options.chunks is None else \
        options.chunks
    if m < 1:
        raise ValueError(f"chunks must be >= 1, got {m}")
    return Config(layout, chunks=m), {"chunks": m}
