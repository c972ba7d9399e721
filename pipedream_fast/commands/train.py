"""`pipedream-fast train`: the main job, end to end, on real data.

    pipedream-fast train                       # digits + convnet, 2 processes, pipedream
    pipedream-fast train --target-accuracy 0.97 --compare data-parallel
    pipedream-fast train --model charlm        # character LM on this package's docstrings
    pipedream-fast train --model mypkg.nets:build --data mypkg.data:load --epochs 3
    pipedream-fast train --model cnn --data synthetic --plan plan.json --schedule 2bw --chunks 4

With no arguments it loads scikit-learn's digits, builds the built-in `convnet`, profiles it,
plans a 2-stage pipeline for 2 workers, predicts the plan's throughput with the simulator,
starts 2 local worker processes and trains with asynchronous PipeDream (one microbatch per
minibatch), evaluating on the test split after every epoch. Everything lands in a run
directory (`runs/<timestamp>` or `--out`): profile.json, plan.json, run_trace.json (a window
of real steps) and sim_trace.json (the simulator's prediction of the same window), timeline.png,
metrics.csv, loss_accuracy.png, summary.json / summary.txt and the final checkpoint.

`--threads N` runs the N ranks as threads of this process instead of processes. `--steps`
bounds the steps, `--epochs` the epochs, `--target-accuracy` stops at the first evaluation
that reaches it (the exit code is 1 if it is never reached).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.cli import UsageError
from pipedream_fast.commands.train_run import load_datasets, train_processes, train_threads
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.models import (BUILTIN_MODELS, ModelSpecError, build_model, loss_fn,
                                   resolve_model)
from pipedream_fast.options import OptionError, PipelineOptions, add_flags, from_args
from pipedream_fast.schedules import TRAINABLE, kind
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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="train on real data: profile, plan, simulate, train, evaluate, report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("model and data")
    what.add_argument("--model", default=None, metavar="NAME_OR_MODULE:FACTORY",
                      help=f"built-in ({', '.join(BUILTIN_MODELS)}) or package.module:factory "
                           f"(default: the data's model, convnet for digits, charlm for text)")
    what.add_argument("--data", default=None, metavar="NAME_OR_MODULE:FACTORY",
                      help="digits (scikit-learn's 8x8 digits), text (characters of this "
                           "package's docstrings), synthetic (random inputs and labels), or "
                           "package.module:factory returning (train_dataset, test_dataset) "
                           "(default: the model's data, digits without --model)")
    what.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                      help="stop at the first evaluation with test accuracy >= A (0.95 or 95); "
                           "exit code 1 if never reached (default: no target)")
    what.add_argument("--compare", choices=("data-parallel",), default=None,
                      help="also train plain data parallelism (every worker a replica of the "
                           "whole model) on the same data and show both side by side")
    sched = parser.add_argument_group("pipeline")
    sched.add_argument("--schedule", default="pipedream", choices=TRAINABLE + ("auto",),
                       help="default pipedream; auto: the planner compares every trainable "
                            "schedule in the simulator and keeps the fastest")
    workers = sched.add_mutually_exclusive_group()
    workers.add_argument("--nproc", type=int, default=None, help="ranks as processes (default 2)")
    workers.add_argument("--threads", type=int, default=None,
                         help="ranks as threads of this process")
    sched.add_argument("--force", action="store_true",
                       help="start more rank processes than this machine has cores (refused "
                            "without it: each rank is a whole training process)")
    sched.add_argument("--plan", default=None, help="plan JSON (default: profile and plan now)")
    sched.add_argument("--straight", action=argparse.BooleanOptionalAction, default=True,
                       help="when planning: one rank per stage, a pipeline as deep as the "
                            "workers (default); --no-straight lets the planner replicate stages")
    sched.add_argument("--stages-per-rank", type=int, default=None, metavar="V",
                       help="when planning: workers x V stages, looped over the ranks "
                            "(default: the schedule's, 2 for interleaved-1f1b, else 1)")
    sched.add_argument("--bandwidth", type=float, default=1e9,
                       help="link bandwidth in bytes/s assumed when planning and simulating "
                            "(default 1e9)")
    sched.add_argument("--chunks", type=int, default=None,
                       help="microbatches per minibatch (default: 1 for pipedream and the "
                            "other asynchronous schedules, the worker count for the rest)")
    opt = parser.add_argument_group("training")
    opt.add_argument("--epochs", type=int, default=None,
                     help="epochs to train (default: the data's, 10 for digits and text)")
    opt.add_argument("--steps", type=int, default=None,
                     help="at most this many minibatches (default: no bound; 10 for synthetic)")
    opt.add_argument("--batch-size", type=int, default=None, help="samples per minibatch (32)")
    opt.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                     help="sgd (momentum 0.9), adam or adamw (default: adam; sgd for synthetic)")
    opt.add_argument("--lr", type=float, default=None,
                     help="learning rate (default: the data's, 1e-3 for digits)")
    # One flag per Pipeline option marked for the command line, and per option a schedule
    # declares (--local-steps): made from their declarations (pipedream_fast.options).
    add_flags(parser.add_argument_group("pipeline options"))
    opt.add_argument("--torch-threads", type=int, default=1,
                     help="intra-op threads per rank (default 1: ranks share the cores)")
    knobs = parser.add_argument_group(
        "tuning", "speed knobs of the core: they change speed or memory, never results "
                  "(TUNING.md says when to change them)")
    knobs.add_argument("--queue-depth", type=int, default=None, metavar="N",
                       help="messages queued per link and direction before a send blocks "
                            "(default: 8 between processes, 64 between threads)")
    knobs.add_argument("--spin-us", type=float, default=0.0, metavar="US",
                       help="microseconds a waiting queue spins before blocking; only when "
                            "each rank has a core of its own (default 0: block at once)")
    knobs.add_argument("--bucket-mb", type=float, default=Tuning.bucket_mb, metavar="MIB",
                       help=f"gradient all-reduce bucket size in MiB for replicated stages "
                            f"(default {Tuning.bucket_mb:g})")
    knobs.add_argument("--weight-slots", type=int, default=None, metavar="K",
                       help="weight-version slots per stage; at least what the schedule keeps "
                            "(default: exactly that)")
    knobs.add_argument("--recv-pool", type=int, default=Tuning.recv_pool, metavar="N",
                       help=f"receive buffer sets pooled per link between processes "
                            f"(default {Tuning.recv_pool})")
    knobs.add_argument("--offload-stash", action="store_true",
                       help="keep stashed weight versions in pinned host memory (GPU runs only)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, metavar="DIR",
                     help="run directory (default: runs/<timestamp>)")
    out.add_argument("--trace", default=None, metavar="PATH",
                     help="also copy the run's Chrome/Perfetto trace here")
    out.add_argument("--trace-steps", type=int, default=8, metavar="N",
                     help="steps of the first epoch traced (default 8; 0: no traces)")
    out.add_argument("--log-every", type=int, default=None, metavar="N",
                     help="a metrics row every N steps (default: about 200 rows per run); "
                          "off a terminal also print a line")
    parser.set_defaults(func=run)


# ---- settings --------------------------------------------------------------------------------

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
        chunks = workers if kind(schedule).chunked_steps else 1
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


def _tuning(args: argparse.Namespace, on_gpus: bool) -> Tuning:
    """The tuning flags as a `Tuning`; a bad value is reported under its flag. `on_gpus`:
    the ranks will train on GPUs (processes, one GPU each: what `launch` picks)."""
    try:
        tuning = Tuning(queue_depth=args.queue_depth, spin_us=args.spin_us,
                        bucket_mb=args.bucket_mb, weight_slots=args.weight_slots,
                        recv_pool=args.recv_pool, offload_stash=args.offload_stash)
    except TuningError as err:
        raise UsageError(f"--{err.field.replace('_', '-')}: {err}") from None
    if tuning.offload_stash and not on_gpus:
        raise UsageError(f"--offload-stash: {OFFLOAD_NEEDS_CUDA}, and this run trains on the "
                         f"CPU (it needs a GPU per rank, and processes, not --threads)")
    return tuning


# ---- profile, plan, simulate -----------------------------------------------------------------

def _check_fit(module: nn.Module, batch: Any, s: Settings) -> tuple[Any, Any]:
    """One forward and loss of a real minibatch, so a model that does not fit the data fails
    here with a clear message (not inside a rank)."""
    inputs, targets = batch
    try:
        with torch.no_grad():
            out = module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)
            loss_fn(out, targets)
    except Exception as err:
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        dtype = f" {inputs.dtype}" if isinstance(inputs, torch.Tensor) else ""
        raise UsageError(f"model {s.model!r} does not fit data {s.data!r} (inputs {shape}"
                         f"{dtype}, targets {tuple(targets.shape)}): {type(err).__name__}: "
                         f"{err}") from err
    return inputs, targets


def _profile(s: Settings, micro: int, train_data: Any) -> Profile:
    from pipedream_fast.profiler import profile_model

    torch.manual_seed(0)
    module, _ = build_model(s.model, micro)
    inputs, _ = _check_fit(module, next(iter(DataLoader(train_data, batch_size=micro))), s)
    return profile_model(module, inputs, micro, warmup=1, repeat=3, progress=False,
                         model_name=s.model, optimizer=PROFILE_OPTIMIZER[s.optimizer])


def _plan(s: Settings, profile: Profile, args: argparse.Namespace, schedule: str,
          straight: bool) -> Plan:
    from pipedream_fast.planner.choose import choose_schedule, plan_for
    from pipedream_fast.topology import Topology

    topology = Topology.parse(f"{s.workers}x{args.bandwidth}")
    if schedule == "auto":
        plan = choose_schedule(profile, topology, straight=straight)
    else:
        overrides = {"stages_per_rank": args.stages_per_rank} if args.stages_per_rank else {}
        plan = plan_for(schedule, profile, topology, straight=straight, **overrides)
    if plan.workers != s.workers:
        raise UsageError(f"the best plan for {s.model} uses {plan.workers} of {s.workers} "
                         f"workers; run with --nproc {plan.workers} or give a --plan")
    return plan


def _check_plan_fits_model(plan: Plan, s: Settings, micro: int) -> None:
    """A --plan made for another model fails here, in one line, before any rank starts."""
    from pipedream_fast.formats import FormatError
    from pipedream_fast.tracing import trace
    from pipedream_fast.training import check_plan_fits

    with torch.device("meta"):
        module, _ = build_model(s.model, micro)
    try:
        check_plan_fits(plan, trace(module))
    except FormatError as err:
        raise UsageError(f"--plan does not fit model {s.model!r}: {err}") from err


def _schedule_options(s: Settings, schedule: str) -> dict[str, Any]:
    """The options the flags gave `schedule` (localsgd's H and R; none for the others: the
    data-parallel comparison run takes none of the main run's)."""
    return dict(s.options.schedule_options) if schedule == s.options.schedule else {}


def _run_options(s: Settings, setup: RunSetup) -> PipelineOptions:
    """What the ranks of one run build their Pipeline with."""
    return s.options.replace(schedule=setup.schedule, chunks=setup.chunks, microbatch_size=None,
                             schedule_options=_schedule_options(s, setup.schedule))


def _simulate(profile: Profile, plan: Plan, schedule: str, chunks: int, steps: int,
              bandwidth: float, extra: dict[str, Any] | None = None) -> Any:
    from pipedream_fast.schedules import make_schedule
    from pipedream_fast.sim import ProfileCosts, simulate

    options: dict[str, Any] = {"chunks": chunks} if kind(schedule).chunked_steps else {}
    options.update(extra or {})
    generated = make_schedule(schedule, plan.num_stages, steps * chunks,
                              stage_ranks=[list(st.ranks) for st in plan.stages], **options)
    return simulate(generated, ProfileCosts.from_plan(profile, plan, bandwidth))


def describe_plan(plan: Plan, names: list[str] | None = None) -> str:
    def blocks(start: int, stop: int) -> str:
        if names and len(names) >= stop:
            return names[start] if stop - start == 1 else f"{names[start]}..{names[stop - 1]}"
        return f"blocks {start}-{stop - 1}"

    parts = [f"{blocks(st.start, st.stop)} on rank{'s' if len(st.ranks) > 1 else ''} "
             f"{','.join(map(str, st.ranks))}" for st in plan.stages]
    return f"{plan.num_stages} stage{'s' if plan.num_stages > 1 else ''}: " + " | ".join(parts)


# ---- the command -----------------------------------------------------------------------------

@dataclass
class RunSetup:
    name: str
    schedule: str
    plan: Plan
    chunks: int
    profile: Profile | None
    simulated_samples_per_s: float | None
    sim_window: Any  # SimResult of the traced window, or None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pipedream_fast import run_report as rr

    wall = time.perf_counter()
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 110))

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    s = settings(args)
    for note in s.notes:
        say(f"note: {note}")
    torch.set_num_threads(args.torch_threads)
    say(f"loading data: {s.data} ...")
    config = _base_config(s, args)
    try:
        train_data, test_data = load_datasets(config)
    except ValueError as err:
        raise UsageError(str(err)) from err
    say(f"data: {len(train_data)} training samples, {len(test_data)} test samples; "
        f"model {s.model}")
    if s.batch_size > len(train_data):  # a step trains whole minibatches only
        raise UsageError(f"--batch-size {s.batch_size} is larger than the training data "
                         f"({len(train_data)} samples of {s.data}): not one minibatch to train "
                         f"on; use --batch-size {len(train_data)} or less")
    if s.data in ("digits", "text"):  # small: handed to the ranks, which then skip loading
        config["datasets"] = (train_data, test_data)

    # profile and plan the pipeline run
    setups: list[RunSetup] = []
    setups.append(_prepare(s, args, s.schedule, s.chunks, train_data, say, main=True))
    if args.compare == "data-parallel":
        setups.append(_prepare(s, args, "data-parallel", s.workers, train_data, say, main=False))
    # Made only now, when the ranks start; removed again should the run end before its
    # first step (with the folders made for it), so that no run folder without a run is left.
    created = rr.missing_dirs(args.out if args.out is not None else "runs")
    run_dir = rr.make_run_dir(args.out)
    if args.out is None:
        created.insert(0, run_dir.absolute())

    # train
    where = f"{s.workers} {'threads' if s.threads else 'processes'}"
    histories: list[rr.RunHistory] = []
    outcomes: list[list[dict[str, Any]]] = []
    recorder = rr.RunRecorder(console, log_every=args.log_every, target=s.target,
                              print_steps=args.log_every, csv_path=run_dir / "metrics.csv")
    try:
        with recorder:
            for setup in setups:
                cfg = dict(config, run=setup.name, schedule=setup.schedule,
                           chunks=setup.chunks, plan=setup.plan.to_dict(),
                           options=_run_options(s, setup),
                           reporter=setup.plan.stages[-1].ranks[0],
                           trace_steps=args.trace_steps if setup is setups[0] else 0,
                           checkpoint=str((run_dir / "checkpoint").resolve())
                           if setup is setups[0] else None)
                micro = s.batch_size // setup.chunks
                recorder.print(f"training {setup.name} on {where}: batch {s.batch_size} = "
                               f"{setup.chunks} x {micro}, {s.optimizer} lr {s.lr:g}; "
                               f"evaluating on the test split after every epoch ...")
                handle = recorder.handle
                results = (train_threads(cfg, handle) if s.threads
                           else train_processes(cfg, s.workers, handle))
                outcomes.append(results)
                histories.append(recorder.runs[setup.name])
    except BaseException:
        if not recorder.trained:  # failed or stopped before its first step: no run to keep
            rr.remove_untrained_run_dir(run_dir, created)
        raise
    rows = recorder.rows_written

    say(f"writing {run_dir} ...")
    if rows == 0:
        say("note: no metrics were recorded")
    files = _write(run_dir, args, s, setups, histories, outcomes, say)
    reached = [h.target_reached_s is not None for h in histories]
    table = _summary(s, setups, histories, outcomes, time.perf_counter() - wall, run_dir)
    console.print(table)
    (run_dir / "summary.txt").write_text(rr.render_text(table))
    rr.write_json(run_dir / "summary.json",
                  _summary_json(s, setups, histories, outcomes, time.perf_counter() - wall,
                                run_dir, files + ["summary.txt", "summary.json"]))
    if s.target is not None and not reached[0]:
        say(f"target accuracy {100 * s.target:.1f}% not reached")
        return 1
    return 0


def _base_config(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": s.model, "data": s.data, "batch_size": s.batch_size,
        "eval_batch_size": s.batch_size, "epochs": s.epochs, "steps": s.steps,
        "optimizer": s.optimizer, "lr": s.lr, "seed": args.seed, "timeout": args.timeout,
        "on_nan": args.on_nan, "tuning": asdict(s.tuning),
        "torch_threads": args.torch_threads, "target": s.target, "synthetic": None}
    if s.data == "synthetic":
        try:
            module, example = build_model(s.model, 1)
        except ModelSpecError as err:
            raise UsageError(str(err)) from err
        if not isinstance(example, torch.Tensor):
            raise UsageError(f"synthetic data need a model with one tensor input; "
                             f"{s.model!r} takes {type(example).__name__}")
        with torch.no_grad():
            classes = int(module(example).shape[-1])
        config["synthetic"] = (tuple(example.shape[1:]), classes)
    return config


def _prepare(s: Settings, args: argparse.Namespace, schedule: str, chunks: int | None,
             train_data: Any, say: Callable[[str], None], main: bool) -> RunSetup:
    """Profile at the microbatch size, plan (or take --plan), predict with the simulator."""
    straight = args.straight if main else False
    guess = chunks or (s.workers if schedule == "auto" or kind(schedule).chunked_steps else 1)
    if s.batch_size % guess:
        raise UsageError(f"batch size {s.batch_size} does not split into {guess} microbatches "
                         f"(--chunks); choose a multiple")
    micro = s.batch_size // guess
    say(f"profiling {s.model} at microbatch size {micro} ...")
    try:
        profile = _profile(s, micro, train_data)
    except ModelSpecError as err:
        raise UsageError(str(err)) from err
    say(f"planning {schedule} for {s.workers} workers ...")
    if main and s.plan_file is not None:
        plan = s.plan_file
        schedule = plan.schedule if schedule == "auto" else schedule
        _check_plan_fits_model(plan, s, micro)
    else:
        plan = _plan(s, profile, args, schedule, straight)
        schedule = plan.schedule if schedule == "auto" else schedule
    if chunks is None:
        chunks = s.workers if kind(schedule).chunked_steps else 1
        if s.batch_size % chunks:
            raise UsageError(f"batch size {s.batch_size} does not split into {chunks} "
                             f"microbatches for {schedule}; choose a multiple")
        if chunks != guess:  # auto chose a schedule with another microbatch size
            profile = _profile(s, s.batch_size // chunks, train_data)
    names = [b.name for b in profile.blocks]
    say(f"plan: {describe_plan(plan, names)}")
    simulated, window = None, None
    try:
        per_epoch = max(1, len(train_data) // s.batch_size)
        steps = min(per_epoch, SIM_MAX_STEPS, s.steps or SIM_MAX_STEPS)
        result = _simulate(profile, plan, schedule, chunks, steps, args.bandwidth,
                           _schedule_options(s, schedule))
        simulated = steps * s.batch_size / result.makespan * 1e3 if result.makespan else None
        if main and args.trace_steps:
            window = _simulate(profile, plan, schedule, chunks, min(args.trace_steps, steps),
                               args.bandwidth, _schedule_options(s, schedule))
        if simulated:
            say(f"simulated: {simulated:,.0f} samples/s for {schedule} ({steps} steps)")
    except ValueError as err:  # FormatError included: a --plan made for another profile
        say(f"note: no simulation: {err}")
    return RunSetup(name=schedule, schedule=schedule, plan=plan, chunks=chunks, profile=profile,
                    simulated_samples_per_s=simulated, sim_window=window)


def _write(run_dir: Path, args: argparse.Namespace, s: Settings, setups: list[RunSetup],
           histories: list[Any], outcomes: list[list[dict[str, Any]]],
           say: Callable[[str], None]) -> list[str]:
    from pipedream_fast import run_report as rr
    from pipedream_fast.trace import write_chrome_trace, write_simulation_trace

    files: list[str] = []
    main = setups[0]
    if main.profile is not None:
        main.profile.save(run_dir / "profile.json")
        files.append("profile.json")
    main.plan.save(run_dir / "plan.json")
    files.append("plan.json")
    for extra in setups[1:]:
        extra.plan.save(run_dir / f"plan-{extra.name}.json")
        files.append(f"plan-{extra.name}.json")
    events = [e for r in outcomes[0] for e in r.get("events", [])]
    if events:
        origin = min(e.start_ms for e in events)
        events = [type(e)(e.rank, e.kind, e.start_ms - origin, e.duration_ms, e.stage,
                          e.microbatch, e.version, e.args) for e in events]
        write_chrome_trace(events, run_dir / "run_trace.json",
                           process=f"pipedream-fast train {main.schedule} (first "
                                   f"{args.trace_steps} steps)",
                           rank_stages={r: main.plan.stages_of_rank(r)
                                        for r in range(main.plan.workers)})
        files.append("run_trace.json")
        if args.trace:
            shutil.copyfile(run_dir / "run_trace.json", args.trace)
            say(f"wrote {args.trace}")
    elif args.trace_steps:
        say("note: the run recorded no trace events")
    if main.sim_window is not None:
        write_simulation_trace(main.sim_window, run_dir / "sim_trace.json")
        files.append("sim_trace.json")
    files.append("metrics.csv")  # written during the run
    if rr.have_matplotlib():
        if main.sim_window is not None:
            from pipedream_fast.timeline import draw_timeline
            draw_timeline(main.sim_window, run_dir / "timeline.png")
            files.append("timeline.png")
        rr.plot_curves(run_dir / "loss_accuracy.png", histories, _metric_label(s))
        files.append("loss_accuracy.png")
    else:
        say("note: matplotlib is not installed: no timeline.png or loss_accuracy.png "
            "(pip install matplotlib)")
    if (run_dir / "checkpoint").is_dir():
        files.append("checkpoint/")
    return files


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _metric_label(s: Settings) -> str:
    return "test accuracy per character" if s.data == "text" else "test accuracy"


def _summary(s: Settings, setups: list[RunSetup], histories: list[Any],
             outcomes: list[list[dict[str, Any]]], wall_s: float, run_dir: Path) -> Any:
    from pipedream_fast import run_report as rr

    columns = [h.name for h in histories]
    finals = [h.final or {} for h in histories]

    def per(fn: Callable[[RunSetup, Any, dict[str, Any]], Any]) -> list[Any]:
        return [fn(st, h, f) for st, h, f in zip(setups, histories, finals)]

    rows: list[tuple[str, list[Any]]] = [
        ("plan", per(lambda st, h, f: describe_plan(
            st.plan, [b.name for b in st.profile.blocks] if st.profile else None))),
        ("workers", [f"{s.workers} {'threads' if s.threads else 'processes'}"] * len(setups)),
        ("minibatch", per(lambda st, h, f: f"{s.batch_size} = {st.chunks} x "
                                           f"{s.batch_size // st.chunks}")),
        ("trained", per(lambda st, h, f: f"{_plural(f.get('epoch', -1) + 1, 'epoch')}, "
                                         f"{f.get('step', 0)} steps, {h.samples:,} samples")),
        ("samples/s measured", per(lambda st, h, f: h.samples_per_s)),
        ("samples/s simulated", per(lambda st, h, f: st.simulated_samples_per_s)),
        (_metric_label(s), per(lambda st, h, f: f"{100 * f['accuracy']:.2f}%"
                               if f.get("accuracy") is not None else "-")),
        ("test loss", per(lambda st, h, f: f"{f['loss']:.4f}" if "loss" in f else "-")),
    ]
    if s.data == "text":
        rows.append(("bits per character", per(lambda st, h, f: f"{f['loss'] / math.log(2):.3f}"
                                                if "loss" in f else "-")))
    if s.target is not None:
        rows.append((f"time to {100 * s.target:.1f}%", per(
            lambda st, h, f: f"{h.target_reached_s:.1f} s (step {h.target_reached_step})"
            if h.target_reached_s is not None else "not reached")))
    rows.append(("training time", per(lambda st, h, f: f"{h.elapsed_s:.1f} s "
                                                      f"({h.train_s:.1f} s without evaluation)")))
    rows.append(("first step", per(lambda st, h, f: f"{h.first_step_s:.2f} s (start-up, "
                                                   f"not in samples/s)"
                                   if h.first_step_s is not None else "-")))
    delays = rr.traced_weight_delays(outcomes[0], setups[0].sim_window)  # the traced run
    if delays is not None:
        rows.append(("weight delay",
                     [rr.weight_delay_text(delays)] + ["-"] * (len(setups) - 1)))
    changed = _changed_knobs(s.tuning)
    if changed:
        rows.append(("tuning", [changed] * len(setups)))
    table = rr.summary_table(f"pipedream-fast train: {s.model} on {s.data}", columns, rows)
    table.caption = (f"wall time {wall_s:.1f} s (loading, profiling, planning, start-up, "
                     f"training, evaluation, writing); run directory {run_dir}")
    return table


def _changed_knobs(tuning: Tuning) -> str:
    """The knobs set away from their defaults, as their flags: `--queue-depth 2, ...`."""
    default = Tuning()
    flags = []
    for name, value in asdict(tuning).items():
        if value != getattr(default, name):
            flag = f"--{name.replace('_', '-')}"
            flags.append(flag if value is True else f"{flag} {value:g}")
    return ", ".join(flags)


def _summary_json(s: Settings, setups: list[RunSetup], histories: list[Any],
                  outcomes: list[list[dict[str, Any]]], wall_s: float, run_dir: Path,
                  files: list[str]) -> dict[str, Any]:
    runs = []
    for st, h, results in zip(setups, histories, outcomes):
        final = h.final or {}
        runs.append({
            "name": st.name, "schedule": st.schedule, "chunks": st.chunks,
            **_schedule_options(s, st.schedule), "plan": st.plan.to_dict(), "steps": final.get("step", 0),
            "epochs": final.get("epoch", -1) + 1, "samples": h.samples,
            "train_s": h.train_s, "elapsed_s": h.elapsed_s, "first_step_s": h.first_step_s,
            "samples_per_s": h.samples_per_s,
            "simulated_samples_per_s": st.simulated_samples_per_s,
            "test_loss": final.get("loss"), "test_accuracy": final.get("accuracy"),
            "time_to_target_s": h.target_reached_s, "target_step": h.target_reached_step,
            "rank_stats": {r["rank"]: r.get("stats", {}) for r in results}})
    from pipedream_fast import run_report as rr
    runs[0]["weight_delays"] = rr.traced_weight_delays(outcomes[0], setups[0].sim_window)
    return {"model": s.model, "data": s.data, "batch_size": s.batch_size,
            "optimizer": s.optimizer, "lr": s.lr, "workers": s.workers,
            "ranks_as": "threads" if s.threads else "processes", "target_accuracy": s.target,
            "tuning": asdict(s.tuning),
            "wall_s": wall_s, "run_dir": os.fspath(run_dir), "files": files, "runs": runs}
