"""`pipedream-fast train`'s settings: the defaults per dataset, the arguments resolved and
checked once (model, data, workers, schedule, chunks, tuning knobs, the Pipeline's options),
and what a run is set up with (`RunSetup`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pipedream_fast.cli import UsageError
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.models import (BUILTIN_MODELS, resolve_model)
from pipedream_fast.options import OptionError, PipelineOptions, from_args
from pipedream_fast.schedules import kind
from pipedream_fast.tuning import OFFLOAD_NEEDS_CUDA, Tuning, TuningError


# Per dataset: the model it goes with and the hyperparameters of its default run. The digits
# defaults end at 97.5-98.1% test accuracy after 10 epochs of pipedream on 2 processes (seeds
# 0-3; over 95% from the fourth epoch on), about 45 s on 2 shared cores.
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"model": "convnet", "epochs": 10, "batch_size": 32, "optimizer": "adam",
               "lr": 1e-3},
    "text": {"model": "charlm", "epochs": 10, "batch_size": 32, "optimizer": "adam",
             "lr": 5e-3},
    "synthetic": {"model": "cnn", "epochs": 1, "batch_size": 32, "optimizer": "sgd",
                  "lr": 0.01},
}
OTHER_DATA_DEFAULTS: dict[str, Any] = {"epochs": 1, "batch_size": 32, "optimizer": "adam",
                                       "lr": 1e-3}
MODEL_DATA = {"convnet": "digits", "charlm": "text"}
DATA_CHOICES = ("digits", "text", "synthetic")
OPTIMIZERS = ("sgd", "adam", "adamw")
PROFILE_OPTIMIZER = {"sgd": "momentum", "adam": "adam", "adamw": "adamw"}
SIM_MAX_STEPS = 256  # steps simulated for the throughput prediction (steady state dominates)


@dataclass
class Settings:
    """Every choice of one invocation, defaults resolved."""

    model: str
    data: str
    epochs: int
    steps: int | None  # bound on steps (None: epochs decide; synthetic: minibatches of data)
    batch_size: int
    optimizer: str
    lr: float
    workers: int
    threads: bool
    schedule: str
    chunks: int | None  # None until the schedule is known (auto)
    target: float | None
    plan_file: Plan | None
    notes: list[str]
    tuning: Tuning
    # every Pipeline option of the flags; each run sets its schedule and chunks
    options: PipelineOptions = field(default_factory=PipelineOptions)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def settings(args: argparse.Namespace) -> Settings:
    """Resolves the model, the data and the defaults that depend on them; checks the options."""
    _positive(args, "batch_size", "steps", "epochs", "chunks", "nproc", "threads",
              "torch_threads", "log_every", "stages_per_rank")
    if args.trace_steps < 0:
        raise UsageError(f"--trace-steps must be >= 0, got {args.trace_steps}")
    try:  # every Pipeline option (and the schedule's own) checked once, naming the flag
        options = from_args(args, schedule=args.schedule, chunks=args.chunks)
    except (OptionError, TypeError) as err:
        raise UsageError(str(err)) from err
    if args.lr is not None and not 0 < args.lr < float("inf"):
        raise UsageError(f"--lr must be a positive, finite learning rate, got {args.lr}")
    _check_outputs(args)
    target = args.target_accuracy
    if target is not None:
        if 1 < target <= 100:
            target /= 100  # given in percent
        if not 0 < target <= 1:
            raise UsageError(f"--target-accuracy must be a fraction in (0, 1] or a percentage, "
                             f"got {args.target_accuracy}")
    plan_file = Plan.load(args.plan) if args.plan else None
    notes: list[str] = []
    model = args.model
    if model is not None:
        resolve_model(model)  # an unknown name or a factory that does not import fails here
    if model is None and plan_file is not None and plan_file.model in BUILTIN_MODELS:
        model = plan_file.model
    data = args.data
    if data is None:
        if model is None:
            data = "digits"
        elif model in MODEL_DATA:
            data = MODEL_DATA[model]
        else:
            data = "synthetic"
            notes.append(f"no built-in dataset goes with model {model!r}: training on synthetic "
                         f"data (random inputs and labels); give --data for real data")
    if data not in DATA_CHOICES and ":" not in data:
        raise UsageError(f"unknown dataset {data!r}: built-in datasets are "
                         f"{', '.join(DATA_CHOICES)}; for your own data give MODULE:FACTORY "
                         f"returning (train_dataset, test_dataset), e.g. 'mypkg.data:load'")
    defaults = DATA_DEFAULTS.get(data, OTHER_DATA_DEFAULTS)
    if model is None:
        if "model" not in defaults:
            raise UsageError(f"--data {data} needs a --model (a built-in: "
                             f"{', '.join(BUILTIN_MODELS)}, or MODULE:FACTORY)")
        model = defaults["model"]
    workers = args.nproc or args.threads or (plan_file.workers if plan_file else 2)
    if plan_file is not None and plan_file.workers != workers:
        raise UsageError(f"{args.plan} is a plan for {plan_file.workers} workers but the run "
                         f"asks for {workers}; drop --nproc/--threads or make a new plan")
    if args.threads is None:
        _check_cores(workers, f"--nproc {workers}" if args.nproc else f"--plan {args.plan}"
                     if plan_file else "the default", args.force)
    epochs = args.epochs or defaults["epochs"]
    if args.epochs is None and args.steps is not None and data != "synthetic":
        epochs = 0  # only --steps: as many epochs as the steps need
    schedule = args.schedule
    chunks = args.chunks
    if chunks is None and schedule != "auto":
        chunks = kind(schedule).default_chunks(workers) if kind(schedule).chunked_steps else 1
    tuning = _tuning(args, on_gpus=args.threads is None and torch.cuda.is_available()
                     and torch.cuda.device_count() >= workers)
    if args.compare == "data-parallel" and schedule == "data-parallel":
        raise UsageError("--compare data-parallel compares a pipeline schedule with data "
                         "parallelism; --schedule is data-parallel already")
    return Settings(model=model, data=data, epochs=epochs, steps=args.steps,
                    batch_size=args.batch_size or defaults["batch_size"],
                    optimizer=args.optimizer or defaults["optimizer"],
                    lr=args.lr if args.lr is not None else defaults["lr"],
                    workers=workers, threads=args.threads is not None, schedule=schedule,
                    chunks=chunks, target=target, plan_file=plan_file, notes=notes,
                    tuning=tuning, options=options)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system tells), else the
    machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _check_cores(workers: int, given: str, force: bool) -> None:
    """Rank processes beyond the cores are refused without --force: each is a whole
    training process (an interpreter, torch, its stage, the data on the first stage), so on
    2 cores 64 of them crawl and together take gigabytes. Two are always allowed: the
    smallest pipeline, slower on one core but fine."""
    cores = usable_cores()
    if workers > max(cores, 2) and not force:
        raise UsageError(f"{given} asks for {workers} rank processes, but this machine lets "
                         f"this process use {cores} core{'s' if cores != 1 else ''}: each rank "
                         f"is a whole training process, so {workers} of them would crawl and "
                         f"take {workers} times the memory of one. Use --nproc {max(cores, 2)} "
                         f"or fewer (or --threads {workers}), or add --force to start them "
                         f"anyway")


def _check_outputs(args: argparse.Namespace) -> None:
    """Where the run will write, checked before any work: --out must be a new or empty
    folder (it will hold the run's checkpoint/ too), --trace a file in an existing folder."""
    from pipedream_fast.run_report import RunDirError, check_out_dir
    try:
        check_out_dir(args.out)
    except RunDirError as err:
        raise UsageError(str(err)) from None
    if args.trace is not None:
        trace = Path(args.trace)
        if trace.is_dir():
            raise UsageError(f"--trace {args.trace} is a folder; name the file to write, e.g. "
                             f"{trace / 'run_trace.json'}")
        if not trace.absolute().parent.is_dir():
            raise UsageError(f"--trace {args.trace}: its folder {trace.parent} does not exist")


def tuning_flag(field_name: str) -> str:
    """The `train` flag of a `Tuning` field: its name, dashed; `transfer_runs` is the one
    a flag switches off (`--python-transfers`)."""
    return "--python-transfers" if field_name == "transfer_runs" else \
        f"--{field_name.replace('_', '-')}"


def tuning_flags(tuning: Tuning) -> list[str]:
    """The flags that give `tuning` (one per field away from its default, with its value
    where it takes one): `_tuning`'s inverse, for a run's report."""
    default = Tuning()
    flags = []
    for f in fields(Tuning):
        value = getattr(tuning, f.name)
        if value == getattr(default, f.name):
            continue
        flag = tuning_flag(f.name)
        if isinstance(value, bool):  # a switch: on, or transfer_runs's off
            flags.append(flag)
        else:
            flags.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return flags


def _tuning(args: argparse.Namespace, on_gpus: bool) -> Tuning:
    """The tuning flags as a `Tuning`; a bad value is reported under its flag. `on_gpus`:
    the ranks will train on GPUs (processes, one GPU each: what `launch` picks)."""
    try:
        tuning = Tuning(queue_depth=args.queue_depth, spin_us=args.spin_us,
                        bucket_mb=args.bucket_mb, weight_slots=args.weight_slots,
                        recv_pool=args.recv_pool, offload_stash=args.offload_stash,
                        link_threads=args.link_threads, io_priority=args.io_priority,
                        transfer_runs=not args.python_transfers,
                        split_channels=args.split_channels, cpu_cache_mb=args.cpu_cache_mb)
    except TuningError as err:
        raise UsageError(f"{tuning_flag(err.field)}: {err}") from None
    if tuning.offload_stash and not on_gpus:
        raise UsageError(f"--offload-stash: {OFFLOAD_NEEDS_CUDA}, and this run trains on the "
                         f"CPU (it needs a GPU per rank, and processes, not --threads)")
    return tuning


@dataclass
class RunSetup:
    name: str
    schedule: str
    plan: Plan
    chunks: int
    profile: Profile | None
    simulated_samples_per_s: float | None
    sim_window: Any  # SimResult of the traced window, or None


def _schedule_options(s: Settings, schedule: str) -> dict[str, Any]:
    """The options the flags gave `schedule` (localsgd's H and R; none for the others: the
    data-parallel comparison run takes none of the main run's)."""
    return dict(s.options.schedule_options) if schedule == s.options.schedule else {}
