"""`PipelineOptions`: every plain-value option of a `Pipeline`, typed and checked once.

The one declaration the API, the CLI and the ranks share. `Pipeline(..., clip_grad_norm=1.0)`
builds it from keywords; `pipedream-fast train` gets a flag for each field marked for the
command line (`--clip-grad-norm`) and for each option a schedule declares in the registry
(`--local-steps`, localsgd's), builds it from its arguments and hands it to every rank as is.
So an option with its flag is one field here (type, default, help, check) and its use in the
Pipeline: two files. A bad value is refused when the options are made, with an error that
names the argument (and, from the command line, the flag).

What is not a plain value stays an argument of its own: the model, the loss and optimizer
factories, a plan, tuning knobs (`Tuning`, with its own flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipedream_fast.runtime.stage import AUTOCAST_DTYPES
from pipedream_fast.schedules import TRAINABLE, declared_options, kind

# The schedules whose stages `adapt` may move: straight or replicated pipelines of one stage
# per rank group (interleaved ones place stages by a rule, localsgd keeps weight copies per
# stage, data-parallel has nothing to move).
ADAPTABLE = ("gpipe", "1f1b", "zb-h1", "pipedream", "pipedream-vsync", "2bw")


class OptionError(ValueError):
    """A Pipeline option with a bad value; `option` is its name."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def byte_count(text: str) -> int:
    """A flag's number of bytes: a whole number, written plainly or as 16e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of bytes such as 16e9, got {text!r}") from None
    if not math.isfinite(value):  # (zero and negatives: the option's own message)
        raise argparse.ArgumentTypeError(f"expected a finite number of bytes, got {text!r}")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}")
    return int(value)


def _option(default: Any, help: str, *, flag: bool = False,
            choices: Sequence[str] | None = None, metavar: str | None = None,
            parse: Callable[[str], Any] | None = None) -> Any:
    """A field; `flag`: `pipedream-fast train` has a flag for it, made from this (its value
    read by `parse`, else by the field's type)."""
    metadata = {"help": help, "flag": flag, "choices": choices, "metavar": metavar,
                "parse": parse}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class PipelineOptions:
    """The options of a Pipeline (see `Pipeline` for what each does in a run)."""

    schedule: str = _option("pipedream", "the schedule, or 'auto' (the fastest that fits)")
    microbatch_size: int | None = _option(None, "samples per microbatch (sets chunks)")
    chunks: int | None = _option(None, "microbatches per minibatch")
    stages: int | None = _option(None, "a straight pipeline of N stages, planned by time")
    balance: tuple[int, ...] | None = _option(None, "blocks per stage")
    split_points: tuple[str, ...] | None = _option(None, "names of the blocks starting stages")
    clip_grad_norm: float | None = _option(
        None, "clip the gradients by the global norm of every stage's (synchronous schedules)",
        flag=True, metavar="NORM")
    precision: str = _option("fp32", "fp32, or each stage's forward under autocast (bf16, "
                                     "fp16 with loss scaling)", flag=True,
                             choices=tuple(AUTOCAST_DTYPES))
    seed: int = _option(0, "seeds the loader's shuffling (per epoch and batch) and the "
                           "initialisation of stages built on the meta device", flag=True)
    on_nan: str = _option("stop", "a NaN or infinite loss stops the run at its step (stop), or "
                                  "its update is skipped (skip, synchronous schedules)",
                          flag=True, choices=("stop", "skip"))
    checkpoint_dir: str | None = _option(None, "save checkpoint_dir/step-N every "
                                               "checkpoint_every steps and on SIGTERM")
    checkpoint_every: int | None = _option(None, "steps between checkpoints")
    checkpoint_keep: int = _option(3, "checkpoints kept in checkpoint_dir")
    resume: bool = _option(False, "continue the run in checkpoint_dir from its newest complete "
                                  "checkpoint when it holds one (a restarted job), start afresh "
                                  "otherwise")
    timeout: float = _option(300.0, "seconds any wait of a rank may take before the run fails, "
                                    "naming the rank that did not answer", flag=True,
                             metavar="S")
    hang_report: float | None = _option(
        None, "seconds an action may last before its rank reports where it stands (the action, "
              "what it waits for, receives posted, sends not completed), once per action, on "
              "stderr; default: a fifth of the timeout; 0: never", flag=True, metavar="S")
    announce_plan: bool = _option(True, "rank 0 prints the plan in one line each time the "
                                        "stages are set up (the first cut, a move)")
    trace: bool = _option(False, "record the actions of each run (`last_events`; of a train() "
                                 "call, its first run: up to its first checkpoint or adapt "
                                 "check)")
    device: str | None = _option(None, "this rank's device (default: its GPU under NCCL, else "
                                       "the CPU)")
    ranks: str = _option("processes", "where the ranks live: processes, or threads of this "
                                      "process")
    workers: int | None = _option(None, "rank threads (ranks='threads'; default: the plan's)")
    schedule_options: Mapping[str, Any] = _option(
        {}, "options the schedule declares (localsgd's local_steps, model_replicas)")
    adapt: bool = _option(False, "re-plan from each rank's measured speed every adapt_every "
                                 "steps and move blocks between ranks when it pays off",
                          flag=True)
    adapt_every: int = _option(50, "steps between the re-planning checks of adapt", flag=True,
                               metavar="STEPS")
    adapt_threshold: float = _option(0.1, "adapt moves only for at least this predicted "
                                          "fraction of a step saved", flag=True,
                                     metavar="FRACTION")
    adapt_payback: int = _option(200, "adapt moves only if the time saved pays for the move "
                                      "within this many steps", flag=True, metavar="STEPS")
    measure_memory: bool = _option(
        False, "measure what each stage holds (weights, versions, gradients, optimizer state, "
               "the activations of microbatches in flight): pipe.memory, the run summary",
        flag=True)
    recompute: str = _option(
        "auto", "blocks whose activations are not kept by the forward but made again in the "
                "backward (less memory, one more forward): auto (the planner's choice, only "
                "where a stage would not fit memory_per_worker), none, all, stages:0,2 (every "
                "block of those stages) or blocks:NAME,NAME (the model's block names)",
        flag=True, metavar="WHICH")
    memory_per_worker: int | None = _option(
        None, "bytes each rank may hold: the planner picks stages, replicas, recomputation "
              "(and with schedule='auto' the schedule) that fit, or refuses the model before "
              "training, naming the smallest memory that would do", flag=True,
        metavar="BYTES", parse=byte_count)

    @property
    def hang_report_s(self) -> float:
        """Seconds before a rank without progress reports where it stands (0: never)."""
        return self.timeout / 5 if self.hang_report is None else self.hang_report

    def __post_init__(self) -> None:
        checks = [
            ("schedule", self.schedule in TRAINABLE or self.schedule == "auto",
             f"schedule must be 'auto' or one of {', '.join(TRAINABLE)}"),
            ("chunks", self.chunks is None or self.chunks >= 1, "chunks must be >= 1"),
            ("microbatch_size", self.microbatch_size is None or self.microbatch_size >= 1,
             "microbatch_size must be >= 1"),
            ("stages", self.stages is None or self.stages >= 1, "stages must be >= 1"),
            ("precision", self.precision in AUTOCAST_DTYPES,
             f"precision must be one of {', '.join(AUTOCAST_DTYPES)}"),
            ("clip_grad_norm", self.clip_grad_norm is None or self.clip_grad_norm > 0,
             "clip_grad_norm must be a positive norm"),
            ("on_nan", self.on_nan in ("stop", "skip"), "on_nan must be 'stop' or 'skip'"),
            ("checkpoint_every", self.checkpoint_every is None or self.checkpoint_every >= 1,
             "checkpoint_every must be >= 1 steps"),
            ("checkpoint_keep", self.checkpoint_keep >= 1, "checkpoint_keep must be >= 1"),
            ("timeout", 0 < self.timeout < float("inf"), "timeout must be positive, finite "
                                                          "seconds"),
            ("hang_report", self.hang_report is None or 0 <= self.hang_report < float("inf"),
             "hang_report must be seconds >= 0 (0: no report), or None for a fifth of the "
             "timeout"),
            ("ranks", self.ranks in ("processes", "threads"),
             "ranks must be 'processes' (one per process: torchrun, `pipedream-fast run`) or "
             "'threads' (every rank a thread of this process)"),
            ("workers", self.workers is None or self.workers >= 1, "workers must be >= 1"),
            ("adapt_every", self.adapt_every >= 1, "adapt_every must be >= 1 steps"),
            ("adapt_threshold", 0 <= self.adapt_threshold < 1,
             "adapt_threshold must be a fraction in [0, 1)"),
            ("adapt_payback", self.adapt_payback >= 1, "adapt_payback must be >= 1 steps"),
            ("memory_per_worker", self.memory_per_worker is None or self.memory_per_worker > 0,
             "memory_per_worker must be a positive number of bytes"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise OptionError(name, f"{message}, got {getattr(self, name)!r}")
        recompute_spec(self.recompute)  # names the form expected if it is not one
        if self.adapt and self.schedule not in (*ADAPTABLE, "auto"):
            raise OptionError("adapt", f"adapt=True moves the blocks of a pipeline of "
                                       f"{listing(ADAPTABLE)}; it cannot re-plan schedule "
                                       f"{self.schedule!r}")
        if self.resume and self.checkpoint_dir is None:
            raise OptionError("resume", "resume=True continues the run in checkpoint_dir: give "
                                        "checkpoint_dir (and checkpoint_every), the folder the "
                                        "job saves into")
        if (self.checkpoint_dir is None) != (self.checkpoint_every is None):
            raise OptionError("checkpoint_every", "give checkpoint_dir and checkpoint_every "
                                                  "together (save every N steps into "
                                                  "checkpoint_dir/step-N)")
        given = [n for n in ("stages", "balance", "split_points") if getattr(self, n) is not None]
        if len(given) > 1:
            raise OptionError(given[1], f"give one of stages, balance and split_points, got "
                                        f"{' and '.join(given)}")
        if self.memory_per_worker is not None and self.adapt:
            raise OptionError("adapt", "adapt=True re-plans from the ranks' speeds alone and "
                                       "would move blocks without keeping memory_per_worker; "
                                       "drop one of them")
        manual = [n for n in ("balance", "split_points") if getattr(self, n) is not None]
        if self.memory_per_worker is not None and manual:
            raise OptionError("memory_per_worker", f"memory_per_worker is a limit the planner "
                                                   f"plans within, but {manual[0]}= cuts the "
                                                   f"model by hand; drop one of them")
        if self.ranks == "processes" and self.workers is not None:
            raise OptionError("workers", "workers= is the number of rank threads with "
                                         "ranks='threads'; with processes, the job's world "
                                         "size is the number of ranks")
        self._check_schedule_options()
        if self.schedule != "auto" and not kind(self.schedule).synchronous:
            wants = [name for name, on in (("clip_grad_norm", self.clip_grad_norm is not None),
                                           ("precision", self.precision == "fp16"),
                                           ("on_nan", self.on_nan == "skip")) if on]
            if wants:
                raise OptionError(wants[0], f"{wants[0]}={getattr(self, wants[0])!r} needs "
                                            f"every stage to agree before each update, which "
                                            f"only synchronous schedules allow; "
                                            f"{self.schedule!r} updates its stages at different "
                                            f"times")

    def _check_schedule_options(self) -> None:
        """Each schedule option must be declared by the schedule chosen, with its type."""
        declared = declared_options()
        for name in self.schedule_options:
            if name not in declared:
                raise OptionError(name, f"unknown option {name!r}")
            owners = declared[name][1]
            if self.schedule == "auto":
                raise OptionError(name, f"{name} is an option of {listing(owners)}: name one of "
                                        f"them as the schedule (schedule='auto' may choose "
                                        f"another)")
            if self.schedule not in owners:
                raise OptionError(name, f"{name} is an option of {listing(owners)}, not of "
                                        f"{self.schedule!r}")
        if self.schedule == "auto":
            return
        spec = kind(self.schedule)
        for name, value in self.schedule_options.items():
            try:
                spec.check_options({name: value})
            except ValueError as err:
                raise OptionError(name, str(err)) from None
        try:
            spec.check_microbatching(self.chunks, self.microbatch_size)
        except ValueError as err:
            raise OptionError("chunks" if self.chunks not in (None, 1) else "microbatch_size",
                              str(err)) from None

    @classmethod
    def of(cls, **values: Any) -> PipelineOptions:
        """From keywords: fields, and the options schedules declare (collected into
        `schedule_options`); an unknown keyword is named with the ones there are."""
        fields = {f.name for f in dataclasses.fields(cls)}
        declared = declared_options()
        own = {k: v for k, v in values.items() if k in fields}
        extra = {k: v for k, v in values.items() if k not in fields}
        unknown = sorted(k for k in extra if k not in declared)
        if unknown:
            known = sorted(fields - {"schedule_options"}) + sorted(declared)
            raise TypeError(f"Pipeline got an unexpected option {unknown[0]!r}; its options "
                            f"are {', '.join(known)}")
        for name in ("balance", "split_points"):
            if own.get(name) is not None:
                own[name] = tuple(own[name])
        if isinstance(own.get("checkpoint_dir"), os.PathLike):
            own["checkpoint_dir"] = os.fspath(own["checkpoint_dir"])
        if own.get("device") is not None:
            own["device"] = str(own["device"])
        schedule_options = {**own.pop("schedule_options", {}),
                            **{k: v for k, v in extra.items() if v is not None}}
        return cls(**own, schedule_options=schedule_options)

    def replace(self, **values: Any) -> PipelineOptions:
        return dataclasses.replace(self, **values)


def recompute_spec(value: str) -> tuple[str, tuple[Any, ...]]:
    """The `recompute` option read: ("auto" | "none" | "all", ()), ("stages", stage indices)
    or ("blocks", block names)."""
    text = str(value).strip()
    if text in ("auto", "none", "all"):
        return text, ()
    what, _, listed = text.partition(":")
    items = tuple(i.strip() for i in listed.split(",") if i.strip())
    if what == "stages" and items and all(i.isdigit() for i in items):
        return "stages", tuple(sorted({int(i) for i in items}))
    if what == "blocks" and items:
        return "blocks", items
    raise OptionError("recompute", f"recompute must be auto, none, all, stages:I,J (stage "
                                   f"indices) or blocks:NAME,NAME (block names), got {value!r}")


def planned_recompute(value: str) -> str:
    """What the planner is told of the `recompute` option: auto, none or all; a hand-picked
    list of stages or blocks is the user's, so the planner does not recompute by itself."""
    what, _ = recompute_spec(value)
    return what if what in ("auto", "none", "all") else "none"


def listing(names: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def add_flags(parser: argparse._ActionsContainer,
              schedule_group: argparse._ActionsContainer | None = None) -> None:
    """A flag for every option marked for the command line, and for every option a schedule
    declares (its help says which schedules take it), those in `schedule_group` if given (an
    argument group of their own in `--help`)."""
    for f in dataclasses.fields(PipelineOptions):
        if not f.metadata.get("flag"):
            continue
        if str(f.type) == "bool":
            parser.add_argument(flag_name(f.name), dest=f.name, action="store_true",
                                help=f.metadata["help"])
            continue
        kind_of = {"float | None": float, "float": float, "int": int, "int | None": int}
        parser.add_argument(flag_name(f.name), dest=f.name, default=f.default,
                            type=f.metadata["parse"] or kind_of.get(str(f.type), str),
                            choices=f.metadata["choices"],
                            metavar=f.metadata["metavar"],
                            help=f"{f.metadata['help']} (default: {f.default})")
    add_schedule_flags(parser if schedule_group is None else schedule_group)


def add_schedule_flags(parser: argparse._ActionsContainer) -> None:
    """A flag for every option a schedule declares (`--local-steps`), saying which take it."""
    for name, (option, owners) in declared_options().items():
        parser.add_argument(flag_name(name), dest=name, default=None, type=option.type,
                            metavar=option.metavar or name.upper(), choices=option.choices,
                            help=f"{listing(owners)}: {option.help}")


def schedule_values(args: argparse.Namespace) -> dict[str, Any]:
    """The values given to the flags of `add_schedule_flags`."""
    return {name: getattr(args, name) for name in declared_options()
            if getattr(args, name, None) is not None}


def from_args(args: argparse.Namespace, **values: Any) -> PipelineOptions:
    """The options of the flags `add_flags` made (and `values`); a bad value names its flag."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(PipelineOptions)
             if f.metadata.get("flag")}
    given.update({name: getattr(args, name) for name in declared_options()})
    given.update(values)
    try:
        return PipelineOptions.of(**given)
    except OptionError as err:
        raise OptionError(err.option, f"{flag_name(err.option)}: {err}") from None
