"""The training half of `pipedream-fast train`: one run of a plan, in processes or threads.

Every rank builds the same `Pipeline` a script would (the run's `PipelineOptions` as the
command made them) and runs the library's `fit`: epochs of `Pipeline.train` over a shuffling
`DataLoader` (the Pipeline reads it on the first stage only, shuffled alike on replicas), an
evaluation of the test split after each epoch through the pipeline, until the epochs or steps run out or the
target accuracy is reached. Progress goes out as small event dicts (`start`, `step`, `phase`,
`eval`), from the rank that reports, to the caller's `handle`, which draws the progress bar
and writes the metrics (`run_report`).
"""

from __future__ import annotations

import math
import multiprocessing
import queue as queue_module
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.fit import fit
from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.models import accuracy, build_model, loss_fn
from pipedream_fast.tuning import Tuning


class SyntheticData(torch.utils.data.Dataset):
    """Random inputs of `shape` and labels below `classes`; sample i is the same on every
    rank and every run with the same seed, and nothing is held in memory."""

    def __init__(self, shape: tuple[int, ...], classes: int, size: int, seed: int) -> None:
        self.shape, self.classes, self.size, self.seed = shape, classes, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of {self.size}")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return (torch.randn(self.shape, generator=generator),
                torch.randint(0, self.classes, (), generator=generator))


def load_datasets(config: dict[str, Any]) -> tuple[Any, Any]:
    """(train, test) for `config["data"]`; synthetic data follow config["synthetic"]; the
    built-in datasets, loaded once by the command, come in config["datasets"]."""
    if config.get("datasets") is not None:
        return tuple(config["datasets"])
    if config["data"] == "synthetic":
        shape, classes = config["synthetic"]
        train_size = config["batch_size"] * (config["steps"] or 10)  # default 10 steps
        return (SyntheticData(shape, classes, train_size, config["seed"] + 1),
                SyntheticData(shape, classes, 4 * config["batch_size"], config["seed"] + 2))
    from pipedream_fast.datasets import resolve_data
    return resolve_data(config["data"])


def loaders(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    """The training loader (shuffled unless synthetic, whole minibatches only) and the test
    loader (in order, every sample: a short last batch is fine for evaluation)."""
    train_data, test_data = load_datasets(config)
    train = DataLoader(train_data, batch_size=config["batch_size"],
                       shuffle=config["data"] != "synthetic", drop_last=True)
    return train, DataLoader(test_data, batch_size=config["eval_batch_size"])


def tuning(config: dict[str, Any]) -> Tuning:
    """The run's speed knobs (the defaults where the config has none)."""
    return Tuning(**config.get("tuning", {}))


def optimizer_factory(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def build(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(config["seed"])  # every rank builds the same initial weights
    module, _ = build_model(config["model"], config["batch_size"])
    return module


# The share of a run's epochs whose measured speed calibrates the simulator; it predicts the
# epochs after them. With 3 epochs or more the first one only warms up and calibrates nothing
# (the first messages of each link, the receive pools filling, first calls: a slow start the
# rest of the run does not pay). A run of one epoch gets no prediction.
CALIBRATION_SHARE = 0.2
WHOLE_REST = 1 << 40  # a calibration window no run fills: the mean over all of the rest


def calibration_epochs(config: dict[str, Any], per_epoch: int) -> tuple[int, int]:
    """(warm-up epochs, epochs up to the end of the calibrating ones); (0, 0) when the run
    has too few epochs to predict any."""
    epochs, steps = config["epochs"] or None, config["steps"] or None
    total = per_epoch * epochs if epochs else steps or 0
    if epochs and steps:
        total = min(total, steps)
    rounds = math.ceil(total / per_epoch) if per_epoch else 0
    if rounds < 2:
        return 0, 0
    warm = 1 if rounds >= 3 else 0
    return warm, warm + max(1, round(rounds * CALIBRATION_SHARE))


def train_loop(pipe: Any, train: DataLoader, config: dict[str, Any],
               emit: Callable[[dict[str, Any]], None],
               evaluate: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """The library's `fit` with this command's settings. Every rank's calibration here (this
    process's rank, or every rank thread) is reset after the warm-up epoch and read at the
    end of the calibrating epochs (`calibration_epochs`): the speed the simulator predicts
    the rest of the run from (`train_report.calibrated_prediction`). The calibrations then
    start again, over all of the rest (no window), and are read at the end: the rest's own
    speed, which tells the cost model's error from the machine's drift."""
    from pipedream_fast.runtime.calibration import calibrations, snapshots

    warm, split = calibration_epochs(config, len(train))
    taken: dict[int, Any] = {}

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "eval" and split:
            if event.get("epoch") == warm - 1:
                for calibration in calibrations(pipe):
                    calibration.reset()
            if event.get("epoch") == split - 1:
                taken.update(snapshots(pipe))
                for calibration in calibrations(pipe):
                    calibration.reset(window=WHOLE_REST)
        emit(event)

    result = fit(pipe, train, epochs=config["epochs"] or None, steps=config["steps"] or None,
                 evaluate=evaluate, target_accuracy=config["target"],
                 trace_steps=config["trace_steps"], on_event=on_event, name=config["run"],
                 batch_size=config["batch_size"])
    return {**result.to_dict(), "calibration": taken, "calibration_epochs": split,
            "calibration_warmup": warm, "calibration_rest": snapshots(pipe) if taken else {},
            "adapt": pipe.options.adapt, "moves": list(pipe.moves),
            "memory": pipe.memory if pipe.options.measure_memory else None,
            "final_plan": pipe.plan.to_dict() if pipe.plan else None}


def _profile(config: dict[str, Any]) -> Profile | None:
    """The profile the plan was made from (what `--adapt` re-plans from)."""
    return Profile.from_dict(config["profile"]) if config.get("profile") else None


def _rank_job(rank: int, world: int, config: dict[str, Any], queue: Any) -> dict[str, Any]:
    """One rank of a process run: build, train, evaluate, save; events go to `queue`."""
    from pipedream_fast.launch import Stopped
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(config["torch_threads"])
    train, test = loaders(config)
    pipe = Pipeline(build(config), loss_fn, optimizer_factory(config["optimizer"], config["lr"]),
                    plan=Plan.from_dict(config["plan"]), options=config["options"],
                    tuning=tuning(config), profile=_profile(config))
    emit = queue.put if rank == config["reporter"] else (lambda event: None)
    try:
        outcome = train_loop(pipe, train, config, emit,
                             lambda: pipe.evaluate(test, metrics={"accuracy": accuracy}))
    except Stopped as stopped:
        # SIGTERM: every rank left training after the same step (`Pipeline.train`), so the
        # stages are consistent there and the run's checkpoint can still be written.
        if stopped.step is not None and config["checkpoint"]:
            pipe.save(config["checkpoint"])
            emit({"event": "note", "text": f"the run's checkpoint (step {stopped.step}) "
                                           f"saved to {config['checkpoint']}"})
        raise
    outcome["checkpoint_error"] = _final_save(pipe, config, emit)
    pipe.close()
    return {"rank": rank, **outcome, "stats": pipe.last_stats}


def _final_save(pipe: Any, config: dict[str, Any], emit: Callable[[dict[str, Any]], None]
                ) -> str | None:
    """Saves the run's checkpoint; a save that fails (a full disk) loses the checkpoint, not
    the run: its error is returned, and the metrics and summary are still written."""
    if not config["checkpoint"]:
        return None
    try:
        pipe.save(config["checkpoint"])
    except ckpt.CheckpointError as err:
        emit({"event": "note", "text": f"the run's checkpoint was not saved: {err}"})
        return str(err)
    return None


def train_processes(config: dict[str, Any], workers: int,
                    handle: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Runs `_rank_job` on `workers` processes; their events reach `handle` here, live.

    `launch` runs in this (the main) thread, so SIGINT and SIGTERM reach it: it forwards them
    to the ranks, kills what is left after its grace period, and this command then exits with
    128 + the signal's number and one line saying so. The events are handed to `handle` by a
    helper thread; should `handle` fail, the ranks are stopped and its error raised here."""
    from pipedream_fast.launch import LaunchError, launch, signal_name

    events = multiprocessing.get_context("spawn").Queue()
    done, stop = threading.Event(), threading.Event()
    handler_error: list[BaseException] = []
    drained = [0]  # events read so far: tells a thread busy on a backlog from a stuck one

    def drain() -> None:
        while True:
            try:
                event = events.get(timeout=0.1)
            except queue_module.Empty:
                if done.is_set():  # the ranks are gone: what they sent is all here
                    return
                continue
            drained[0] += 1
            if handler_error:
                continue  # keep reading, so that no rank blocks on a full pipe
            try:
                handle(event)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                handler_error.append(err)
                stop.set()

    thread = threading.Thread(target=drain, name="pipedream-events", daemon=True)
    thread.start()
    try:
        values = launch(_rank_job, workers, config, events, timeout=config["timeout"],
                        stop=stop)
    except (KeyboardInterrupt, LaunchError) as err:
        if handler_error:
            raise handler_error[0] from None
        signum = signal.SIGINT if isinstance(err, KeyboardInterrupt) else err.stopped_by
        if signum is None:
            raise
        print(f"pipedream-fast train: {err or f'stopped by {signal_name(signum)}'}",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        done.set()
        while thread.is_alive():  # the events left: until none came for a second
            seen = drained[0]
            thread.join(timeout=1.0)
            if drained[0] == seen:
                break
        if not thread.is_alive():  # else it is stuck on a truncated event: leave it be
            events.close()
    if handler_error:
        raise handler_error[0]
    return list(values)


def train_threads(config: dict[str, Any], handle: Callable[[dict[str, Any]], None]
                  ) -> list[dict[str, Any]]:
    """The same run with every rank a thread of this process: the same Pipeline
    (`ranks="threads"`), its evaluation and its checkpoint.

    SIGTERM or SIGHUP during training stops every rank after the same step (`Pipeline.train`),
    where the run's checkpoint is saved; elsewhere (evaluating) it stops at once, without
    one. Either way this command says so and exits with 128 + the signal's number."""
    from pipedream_fast.launch import Stopped, raising_stop_signals
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(config["torch_threads"])
    train, test = loaders(config)
    plan = Plan.from_dict(config["plan"])
    pipe = Pipeline(build(config), loss_fn, optimizer_factory(config["optimizer"], config["lr"]),
                    plan=plan, options=config["options"].replace(ranks="threads"),
                    tuning=tuning(config), profile=_profile(config))
    try:
        with raising_stop_signals():
            outcome = train_loop(pipe, train, config, handle,
                                 lambda: pipe.evaluate(test, metrics={"accuracy": accuracy}))
    except Stopped as stopped:
        saved = ""
        if stopped.step is not None and config["checkpoint"]:
            pipe.save(config["checkpoint"])
            saved = f"the run's checkpoint (step {stopped.step}) saved to {config['checkpoint']}"
            handle({"event": "note", "text": saved})
        elif config["checkpoint"]:
            saved = "no checkpoint saved: the ranks were not stopped at an agreed step"
        print(f"pipedream-fast train: {stopped}" + (f"; {saved}" if saved else ""),
              file=sys.stderr, flush=True)
        raise SystemExit(128 + stopped.signum) from None
    outcome["checkpoint_error"] = _final_save(pipe, config, handle)
    pipe.close()
    return [{"rank": 0, **outcome, "stats": pipe.last_stats}]
