"""`fit`: the epochs of a training run around a `Pipeline`, for scripts and the CLI alike.

    result = fit(pipe, loader, epochs=10, evaluate=lambda: pipe.evaluate(test, metrics),
                 target_accuracy=0.97, on_event=print)

Epochs of `pipe.train`, an evaluation after each, until the epochs or the steps run out or
the target accuracy is reached. Progress goes to `on_event` as plain dicts (`start`, `step`,
`phase`, `eval`), which is how `pipedream-fast train` draws its progress and writes its
metrics; the first epoch can be traced, keeping only its first `trace_steps` steps so that the
trace stays small. Collective like `Pipeline.train`: with processes, every rank calls it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]


@dataclass
class FitResult:
    """What a `fit` trained: steps and samples, training and wall time, the last evaluation,
    when the target was reached (seconds from the start, or None) and the traced window."""

    steps: int = 0
    samples: int = 0
    train_s: float = 0.0
    elapsed_s: float = 0.0
    results: dict[str, float] = field(default_factory=dict)
    reached_at: float | None = None
    events: list[Any] = field(default_factory=list)
    memory_samples: list[Any] = field(default_factory=list)  # measure_memory: traced window

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def trace_window(events: list[Any], microbatches: int) -> list[Any]:
    """A traced run's first `microbatches` microbatches: their actions and the updates and
    other microbatch-less actions up to the last of them."""
    inside = [e for e in events if e.microbatch is not None and e.microbatch < microbatches]
    if not inside:
        return list(events)
    end = max(e.start_ms + e.duration_ms for e in inside)
    return [e for e in events if (e.microbatch is None and e.start_ms <= end)
            or (e.microbatch is not None and e.microbatch < microbatches)]


def fit(pipe: Any, loader: Any, *, epochs: int | None = None, steps: int | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
        target_accuracy: float | None = None, trace_steps: int = 0,
        on_event: Callable[[Event], None] | None = None, name: str = "run",
        batch_size: int | None = None) -> FitResult:
    """Trains `pipe` on `loader` for `epochs` (default 1) or at most `steps` minibatches
    (both: whichever ends first), evaluating after every epoch; stops early at the first
    evaluation whose "accuracy" reaches `target_accuracy`. See the module's docstring."""
    emit = on_event or (lambda event: None)
    per_epoch = len(loader)
    size = batch_size or getattr(loader, "batch_size", None) or 1
    if per_epoch == 0:
        raise ValueError(f"the training data do not fill one minibatch of {size}")
    if epochs is None and steps is None:
        epochs = 1
    total = per_epoch * epochs if epochs else steps or 0
    if epochs and steps:
        total = min(total, steps)
    rounds = math.ceil(total / per_epoch)
    chunks = pipe.options.chunks or 1
    emit({"event": "start", "run": name, "steps": total, "epochs": rounds,
          "steps_per_epoch": per_epoch, "batch_size": size})
    began = time.perf_counter()
    out = FitResult()
    first_s: float | None = None  # the first step: start-up (connections, first calls) included
    for epoch in range(rounds):
        count = min(per_epoch, total - out.steps)
        traced = epoch == 0 and trace_steps > 0
        pipe.trace = traced
        begin = time.perf_counter()
        for loss in pipe.train(loader, steps=count):
            out.steps += 1
            out.samples += size
            now = time.perf_counter()
            if first_s is None:
                first_s = now - begin
            if loss is not None:
                emit({"event": "step", "run": name, "step": out.steps, "epoch": epoch,
                      "samples": out.samples, "loss": float(loss),
                      "train_s": out.train_s + now - begin, "first_step_s": first_s,
                      "elapsed_s": now - began})
        epoch_s = time.perf_counter() - begin
        if traced:
            out.events = trace_window(list(getattr(pipe, "last_events", None) or []),
                                      trace_steps * chunks)
            end = max((e.start_ms + e.duration_ms for e in out.events), default=None)
            out.memory_samples = [m for m in getattr(pipe, "last_memory", None) or []
                          if end is not None and m.t_ms <= end]
        out.train_s += epoch_s
        if evaluate is None:
            continue
        emit({"event": "phase", "run": name, "text": "evaluating"})
        out.results = evaluate()
        elapsed = time.perf_counter() - began
        reached = (target_accuracy is not None
                   and out.results.get("accuracy", 0.0) >= target_accuracy)
        # The epoch's rate; the first epoch's without its first step (start-up).
        timed, timed_s = count, epoch_s
        if epoch == 0 and count > 1 and first_s is not None:
            timed, timed_s = count - 1, epoch_s - first_s
        emit({"event": "eval", "run": name, "step": out.steps, "epoch": epoch,
              "samples": out.samples, "loss": out.results["loss"],
              "accuracy": out.results.get("accuracy"), "train_s": out.train_s,
              "first_step_s": first_s, "elapsed_s": elapsed,
              "epoch_samples_per_s": timed * size / timed_s if timed_s > 0 else None})
        if reached:
            out.reached_at = elapsed
            break
    out.elapsed_s = time.perf_counter() - began
    return out
