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
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.cli import UsageError
from pipedream_fast.commands import add_straight
from pipedream_fast.commands.train_run import load_datasets, train_processes, train_threads
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.models import (BUILTIN_MODELS, ModelSpecError, build_model, loss_fn)
from pipedream_fast.options import ADAPTABLE, PipelineOptions, add_flags, planned_recompute
from pipedream_fast.planner.choose import predict, prediction_text
from pipedream_fast.schedules import TRAINABLE, kind
from pipedream_fast.commands.train_report import _summary, _summary_json, _write
from pipedream_fast.commands.train_settings import (OPTIMIZERS, SIM_MAX_STEPS,
                                                    PROFILE_OPTIMIZER, RunSetup, Settings,
                                                    _schedule_options, settings)
from pipedream_fast.commands.train_settings import usable_cores as usable_cores
from pipedream_fast.tuning import Tuning


def register(subparsers: Any) -> None:
    from pipedream_fast.commands import DEFAULT_BANDWIDTH
    from pipedream_fast.schedules import SCHEDULE_NAMES

    parser = subparsers.add_parser(
        "train", help="train on real data: profile, plan, simulate, train, evaluate, report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--model M] [--data D] [--schedule S] [--nproc N | --threads N] "
              "[options]")
    # The groups in the order of `--help`: what most runs set first, then what fewer do.
    common = parser.add_argument_group("common")
    common.add_argument("--model", default=None, metavar="NAME_OR_MODULE:FACTORY",
                        help=f"built-in ({', '.join(BUILTIN_MODELS)}) or package.module:factory "
                             f"(default: the data's model, convnet for digits, charlm for text)")
    common.add_argument("--data", default=None, metavar="NAME_OR_MODULE:FACTORY",
                        help="digits (scikit-learn's 8x8 digits), text (characters of this "
                             "package's docstrings), synthetic (random inputs and labels), or "
                             "package.module:factory returning (train_dataset, test_dataset) "
                             "(default: the model's data, digits without --model)")
    # Every schedule, as `plan` and `simulate` offer them; one that cannot train would be
    # refused by the Pipeline's options, naming those that can.
    untrainable = [n for n in SCHEDULE_NAMES if n not in TRAINABLE]
    common.add_argument("--schedule", default="pipedream", choices=SCHEDULE_NAMES + ("auto",),
                        metavar="SCHEDULE",
                        help=f"{', '.join(SCHEDULE_NAMES)} (default pipedream"
                             + (f"; {', '.join(untrainable)}: simulate only" if untrainable
                                else "")
                             + "), or auto: the planner compares every trainable schedule in "
                               "the simulator and keeps the fastest")
    workers = common.add_mutually_exclusive_group()
    workers.add_argument("--nproc", type=int, default=None, metavar="N",
                         help="ranks as processes (default 2)")
    workers.add_argument("--threads", type=int, default=None, metavar="N",
                         help="ranks as threads of this process")
    common.add_argument("--epochs", type=int, default=None, metavar="N",
                        help="epochs to train (default: the data's, 10 for digits and text)")
    common.add_argument("--steps", type=int, default=None, metavar="N",
                        help="at most this many minibatches (default: no bound; 10 for "
                             "synthetic)")
    common.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="samples per minibatch (32)")
    common.add_argument("--out", default=None, metavar="DIR",
                        help="run directory (default: runs/<timestamp>)")
    opt = parser.add_argument_group("training")
    opt.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                     help="sgd (momentum 0.9), adam or adamw (default: adam; sgd for synthetic)")
    opt.add_argument("--lr", type=float, default=None,
                     help="learning rate (default: the data's, 1e-3 for digits)")
    opt.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                     help="stop at the first evaluation with test accuracy >= A (0.95 or 95); "
                          "exit code 1 if never reached (default: no target)")
    opt.add_argument("--compare", choices=("data-parallel",), default=None,
                     help="also train plain data parallelism (every worker a replica of the "
                          "whole model) on the same data and show both side by side")
    opt.add_argument("--torch-threads", type=int, default=1, metavar="N",
                     help="intra-op threads per rank (default 1: ranks share the cores)")
    opt.add_argument("--force", action="store_true",
                     help="start more rank processes than this machine has cores (refused "
                          "without it: each rank is a whole training process)")
    planning = parser.add_argument_group(
        "planning", "how the stages are cut when no --plan is given, and what the simulator "
                    "assumes")
    planning.add_argument("--plan", default=None, metavar="PATH",
                          help="plan JSON (default: profile and plan now)")
    planning.add_argument("--profile", default=None, metavar="PATH",
                          help="profile JSON (`pipedream-fast profile`, at this run's "
                               "microbatch size) to plan and predict from instead of "
                               "profiling now; with --plan nothing is profiled or planned")
    add_straight(planning)
    planning.add_argument("--stages-per-rank", type=int, default=None, metavar="V",
                          help="workers x V stages, looped over the ranks (default: the "
                               "schedule's, 2 for interleaved-1f1b, zb-v and looped-bfs, "
                               "else 1)")
    planning.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH,
                          metavar="BYTES_PER_S",
                          help=f"link bandwidth assumed when planning and simulating (default "
                               f"{DEFAULT_BANDWIDTH / 1e9:g}e9)")
    planning.add_argument("--chunks", type=int, default=None, metavar="N",
                          help="microbatches per minibatch (default: 1 for pipedream and the "
                               "other asynchronous schedules, the worker count for the rest)")
    # One flag per Pipeline option marked for the command line, and per option a schedule
    # declares (--local-steps): made from their declarations (pipedream_fast.options).
    add_flags(parser.add_argument_group("pipeline options"),
              parser.add_argument_group("schedule options",
                                        "options of some schedules only, each saying which"))
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
    knobs.add_argument("--cpu-cache-mb", type=float, default=Tuning.cpu_cache_mb,
                       metavar="MIB",
                       help=f"MiB of freed CPU tensor memory each process keeps for reuse "
                            f"instead of faulting it in again every step (default "
                            f"{Tuning.cpu_cache_mb:g}; 0: off)")
    knobs.add_argument("--link-threads", action="store_true",
                       help="move CPU transfers on a send and a receive thread per link, as "
                            "on a GPU (default: issued on the rank's own thread)")
    knobs.add_argument("--python-transfers", action="store_true",
                       help="perform every transfer action in the Python executor, one at a "
                            "time (the reference path; default: each run of them in one call "
                            "into the C++ core)")
    knobs.add_argument("--split-channels", action="store_true",
                       help="activations and gradients on process groups of their own, so "
                            "that under NCCL a receive never waits behind a send to the same "
                            "peer (default: one group)")
    knobs.add_argument("--io-priority", choices=("auto", "normal", "low", "idle"),
                       default="auto",
                       help="priority of gloo's I/O threads: idle where busy threads outnumber "
                            "the cores (default auto: idle for ranks of one compute thread)")
    knobs.add_argument("--offload-stash", action="store_true",
                       help="keep stashed weight versions in pinned host memory (GPU runs only)")
    out = parser.add_argument_group("output")
    out.add_argument("--trace", default=None, metavar="PATH",
                     help="also copy the run's Chrome/Perfetto trace here")
    out.add_argument("--trace-steps", type=int, default=8, metavar="N",
                     help="steps of the first epoch traced (default 8; 0: no traces)")
    out.add_argument("--log-every", type=int, default=None, metavar="N",
                     help="a metrics row every N steps (default: about 200 rows per run); "
                          "off a terminal also print a line")
    parser.set_defaults(func=run)

# ---- settings --------------------------------------------------------------------------------


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
                         model_name=s.model, optimizer=PROFILE_OPTIMIZER[s.optimizer],
                         cpu_cache_mb=s.tuning.cpu_cache_mb)


def _given_profile(path: str, micro: int) -> Profile:
    """--profile, which must have been made at this run's microbatch size."""
    try:
        profile = Profile.load(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--profile {path}: {err}") from err
    if profile.batch_size != micro:
        raise UsageError(f"--profile {path} was made at batch size {profile.batch_size}, but "
                         f"this run's microbatches hold {micro} samples; profile with "
                         f"--batch-size {micro}, or give --batch-size and --chunks that make "
                         f"microbatches of {profile.batch_size}")
    return profile


def _plan(s: Settings, profile: Profile, args: argparse.Namespace, schedule: str,
          straight: bool) -> Plan:
    from pipedream_fast.planner.choose import choose_schedule, plan_for
    from pipedream_fast.topology import Topology

    topology = Topology.parse(f"{s.workers}x{args.bandwidth}", s.options.memory_per_worker)
    recompute = planned_recompute(s.options.recompute)
    if schedule == "auto":
        plan = choose_schedule(profile, topology, straight=straight, recompute=recompute)
    else:
        overrides = {"stages_per_rank": args.stages_per_rank} if args.stages_per_rank else {}
        plan = plan_for(schedule, profile, topology, straight=straight, recompute=recompute,
                        **overrides)
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


def _run_options(s: Settings, setup: RunSetup) -> PipelineOptions:
    """What the ranks of one run build their Pipeline with."""
    return s.options.replace(schedule=setup.schedule, chunks=setup.chunks, microbatch_size=None,
                             schedule_options=_schedule_options(s, setup.schedule),
                             announce_plan=False,  # this command says the plan itself
                             adapt=s.options.adapt and setup.schedule in ADAPTABLE)


def _simulate(profile: Profile, plan: Plan, schedule: str, chunks: int, steps: int,
              bandwidth: float, extra: dict[str, Any] | None = None) -> Any:
    from pipedream_fast.schedules import make_schedule
    from pipedream_fast.sim import ProfileCosts, simulate

    options: dict[str, Any] = {"chunks": chunks} if kind(schedule).chunked_steps else {}
    options.update(extra or {})
    generated = make_schedule(schedule, plan.num_stages, steps * chunks,
                              stage_ranks=[list(st.ranks) for st in plan.stages], **options)
    return simulate(generated, ProfileCosts.from_plan(profile, plan, bandwidth))


# ---- the command -----------------------------------------------------------------------------


def _user_code_error(err: BaseException, what: str) -> UsageError | None:
    """One line for an error raised in the user's factory (`--model`, `--data`), its
    traceback in a log file the line names; None for an error of ours."""
    from pipedream_fast import user_errors

    root, _ = user_errors.cause(err)
    factory = what.split(":")[-1] if ":" in what else None
    if factory is not None and user_errors.entered(root) == factory:
        what = what.replace(" ", " factory ", 1)  # "model factory pkg.mod:build"
    line = user_errors.describe(err, where_from=what)
    if line is None:
        return None
    path = user_errors.write_log(user_errors.format_traceback(err), user_errors.log_path())
    return UsageError(f"{line}; traceback in {path}")


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
    except Exception as err:
        usage = _user_code_error(err, f"data {s.data}")
        if usage is not None:
            raise usage from None
        if not isinstance(err, ValueError):
            raise
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
    try:
        setups.append(_prepare(s, args, s.schedule, s.chunks, train_data, say, main=True))
    except Exception as err:
        usage = _user_code_error(err, f"model {s.model}")
        if usage is None:
            raise
        raise usage from None
    if args.compare == "data-parallel":
        setups.append(_prepare(s, args, "data-parallel", s.workers, train_data, say, main=False))
    # Made only now, when the ranks start; removed again should the run end before its
    # first step (with the folders made for it), so that no run folder without a run is left.
    created = rr.missing_dirs(args.out if args.out is not None else "runs")
    run_dir = rr.make_run_dir(args.out)
    if args.out is None:
        created.insert(0, run_dir.absolute())
    try:
        _check_room(run_dir, setups[0])
    except UsageError:
        rr.remove_untrained_run_dir(run_dir, created)
        raise

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
                           profile=setup.profile.to_dict() if setup.profile else None,
                           options=_run_options(s, setup),
                           reporter=setup.plan.stages[-1].ranks[0],
                           trace_steps=args.trace_steps if setup is setups[0] else 0,
                           checkpoint=str((run_dir / "checkpoint").resolve())
                           if setup is setups[0] else None)
                micro = s.batch_size // setup.chunks
                given = _schedule_options(s, setup.schedule)
                options = "".join(f" ({k.replace('_', ' ')} {v})" for k, v in given.items())
                recorder.print(f"training {setup.name}{options} on {where}: batch "
                               f"{s.batch_size} = "
                               f"{setup.chunks} x {micro}, {s.optimizer} lr {s.lr:g}; "
                               f"evaluating on the test split after every epoch ...")
                handle = recorder.handle
                results = (train_threads(cfg, handle) if s.threads
                           else train_processes(cfg, s.workers, handle))
                outcomes.append(results)
                histories.append(recorder.runs[setup.name])
    except BaseException as err:
        if not recorder.trained:  # failed or stopped before its first step: no run to keep
            rr.remove_untrained_run_dir(run_dir, created)
        from pipedream_fast.launch import LaunchError
        if isinstance(err, LaunchError):  # a user's error is one line; its traceback a log
            err.log_details(run_dir if recorder.trained else None)
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
    lost = next((r["checkpoint_error"] for results in outcomes for r in results
                 if r.get("checkpoint_error")), None)
    if lost is not None:
        say(f"the run's checkpoint was not saved ({lost}); the metrics and the summary are in "
            f"{run_dir}")
        return 1
    if s.target is not None and not reached[0]:
        say(f"target accuracy {100 * s.target:.1f}% not reached")
        return 1
    return 0


def _check_room(run_dir: Path, setup: RunSetup) -> None:
    """Refuses, before training, a run directory on a disk without room for the run's
    checkpoint (the weights and optimizer state the profile measured, with a margin for the
    traces and plots), rather than losing it after training."""
    if setup.profile is None:
        return
    blocks = setup.profile.blocks
    needed = int(1.1 * sum(b.parameter_bytes + b.optimizer_state_bytes for b in blocks)) + 2 ** 20
    free = shutil.disk_usage(run_dir).free
    if needed > free:
        raise UsageError(f"--out {run_dir}: the run's checkpoint needs about "
                         f"{needed / 2 ** 20:.1f} MiB (weights and optimizer state, with the "
                         f"run's files) and {free / 2 ** 20:.1f} MiB are free on that disk; "
                         f"free some space or give --out on a larger disk")


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
    guess = chunks or (s.workers if schedule == "auto"
                       else kind(schedule).default_chunks(s.workers) if kind(schedule).chunked_steps
                       else 1)
    if s.batch_size % guess:
        raise UsageError(f"batch size {s.batch_size} does not split into {guess} microbatches "
                         f"(--chunks); choose a multiple")
    micro = s.batch_size // guess
    # With --plan, the profile only feeds the prediction, the checkpoint's room check and
    # --adapt's re-planning; nothing is planned.
    if main and args.profile is not None:
        profile = _given_profile(args.profile, micro)
        say(f"profile: {args.profile}")
    else:
        say(f"profiling {s.model} at microbatch size {micro}"
            + (" (for the prediction; --profile reuses one)" if main and s.plan_file else "")
            + " ...")
        try:
            profile = _profile(s, micro, train_data)
        except ModelSpecError as err:
            raise UsageError(str(err)) from err
    if s.plan_file is not None and main:
        plan = s.plan_file
        schedule = plan.schedule if schedule == "auto" else schedule
        _check_plan_fits_model(plan, s, micro)
    else:
        say(f"planning {schedule} for {s.workers} workers ...")
        plan = _plan(s, profile, args, schedule, straight)
        schedule = plan.schedule if schedule == "auto" else schedule
    if chunks is None:
        chunks = kind(schedule).default_chunks(s.workers) if kind(schedule).chunked_steps else 1
        if s.batch_size % chunks:
            raise UsageError(f"batch size {s.batch_size} does not split into {chunks} "
                             f"microbatches for {schedule}; choose a multiple")
        if chunks != guess:  # auto chose a schedule with another microbatch size
            profile = (_given_profile(args.profile, s.batch_size // chunks)
                       if main and args.profile is not None
                       else _profile(s, s.batch_size // chunks, train_data))
    names = [b.name for b in profile.blocks]
    say(f"plan: {plan.describe(names)}")
    simulated, window = None, None
    try:
        per_epoch = max(1, len(train_data) // s.batch_size)
        steps = min(per_epoch, SIM_MAX_STEPS, s.steps or SIM_MAX_STEPS)
        # The figure `plan` and `simulate` give for the same plan and settings (`predict`)
        simulated = predict(profile, plan, schedule, chunks=chunks, bandwidth=args.bandwidth,
                            options=_schedule_options(s, schedule))
        if main and args.trace_steps:
            window = _simulate(profile, plan, schedule, chunks, min(args.trace_steps, steps),
                               args.bandwidth, _schedule_options(s, schedule))
        say(prediction_text(simulated, schedule))
    except ValueError as err:  # FormatError included: a --plan made for another profile
        say(f"note: no simulation: {err}")
    return RunSetup(name=schedule, schedule=schedule, plan=plan, chunks=chunks, profile=profile,
                    simulated_samples_per_s=simulated, sim_window=window)


