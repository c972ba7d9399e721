"""What `pipedream-fast train` shows and keeps: the run directory, the metrics CSV, the
loss-and-accuracy plot, the live progress bar and the summary table.

A run is reported as a stream of small dicts ("events"), whichever way its ranks run (one
process per rank sends them through a queue, threads of this process call `handle` directly):

    {"event": "start", "run": "pipedream", "steps": 440, "epochs": 10, "steps_per_epoch": 44,
     "batch_size": 32}
    {"event": "step", "run": ..., "step": 12, "epoch": 0, "samples": 384, "loss": 0.71,
     "train_s": 1.9, "first_step_s": 0.4, "elapsed_s": 2.1}
    # train_s: training time, evaluation excluded; first_step_s: the first step, start-up
    # included (the rates leave it out)
    {"event": "eval", "run": ..., "step": 44, "epoch": 0, "samples": 1408, "loss": 0.21,
     "accuracy": 0.95, "train_s": 6.0, "elapsed_s": 6.4, "epoch_samples_per_s": 240.0}

`RunRecorder` turns them into metrics rows (one per logged step, one per evaluation), drives a
rich progress bar on a terminal (plain lines elsewhere) and keeps what the summary needs.
matplotlib is optional: without it the PNGs are skipped with a note.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn)
from rich.table import Table

METRICS_COLUMNS = ("run", "step", "epoch", "samples", "loss", "test_loss", "test_accuracy",
                   "samples_per_s", "elapsed_s")
MAX_ROWS_KEPT = 4000  # metrics rows a run keeps in memory for the plot (the CSV has them all)


# ---- the run directory -----------------------------------------------------------------------

class RunDirError(ValueError):
    """An --out folder a run must not write into (printed in one line, exit 2)."""


def check_out_dir(out: str | os.PathLike[str] | None) -> None:
    """Refuses an `--out` that is a file or a folder holding anything: a run writes its
    files (summary.json, metrics.csv, checkpoint/, ...) into a new or empty folder only.

    A previous run's folder is refused too, not overwritten: `train` cannot resume a run,
    so writing into one would only destroy its results or mix two runs' files (the old
    run's plots and plan-*.json next to the new summary), and the user's own files in a
    folder must never be replaced or deleted. The way out is a new --out (or none: a fresh
    runs/<timestamp>), or removing the folder, which only the user may decide."""
    if out is None:
        return
    path = Path(out)
    if not path.exists():
        if path.is_symlink():
            raise RunDirError(f"--out {out} is a dangling symbolic link; give a new folder")
        return
    if not path.is_dir():
        raise RunDirError(f"--out {out} is a file, not a folder; give a new or empty folder")
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:4]) + (f" (and {len(entries) - 4} more)" if len(entries) > 4
                                      else "")
    if (path / "checkpoint").exists() and not (path / "checkpoint").is_dir():
        why = "its checkpoint is a file, where the run would save its checkpoint folder"
    else:
        why = ("a run writes into a new or empty folder only: it never overwrites or deletes "
               "files it did not write, nor a previous run's (train does not resume a run)")
    raise RunDirError(f"refusing --out {out}: it holds {shown}; {why}. Give a new or empty "
                      f"folder (without --out: a fresh runs/<timestamp>)")


def missing_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what
    `make_run_dir` will create, and `remove_untrained_run_dir` may remove."""
    missing = []
    current = Path(path).absolute()
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


def remove_untrained_run_dir(path: Path, created: Sequence[Path]) -> None:
    """After a run that failed or was stopped before its first step: removes what the run
    wrote before training (metrics.csv with its header only, an empty checkpoint folder) and
    then the folders it created (`created`, from `missing_dirs`), if empty. Nothing else is
    ever deleted: a folder holding anything more is left as it is."""
    metrics = path / "metrics.csv"
    try:
        if metrics.is_file() and len(metrics.read_text().splitlines()) <= 1:
            metrics.unlink()
        for folder in [path / "checkpoint", *created]:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    except OSError:
        pass  # best effort: the run's own error is what the user must see


def make_run_dir(out: str | os.PathLike[str] | None, root: str | os.PathLike[str] = "runs"
                 ) -> Path:
    """`out` if given (created if missing; `check_out_dir` refuses one that is not new or
    empty), else a fresh `runs/<timestamp>` folder."""
    if out is not None:
        check_out_dir(out)
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / stamp
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{stamp}-{n}")


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ---- metrics ---------------------------------------------------------------------------------

@dataclass
class RunHistory:
    """One training run as the summary and the files need it."""

    name: str
    steps: int = 0  # planned
    epochs: int = 0
    steps_per_epoch: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)  # thinned beyond MAX_ROWS_KEPT
    evals: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    batch_size: int = 0
    train_s: float = 0.0
    first_step_s: float | None = None  # the first step, start-up included
    elapsed_s: float = 0.0
    target_reached_s: float | None = None  # elapsed seconds at the first eval reaching it
    target_reached_step: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        """Training samples per second of training time (evaluations excluded), from the end
        of the first step on, so that start-up does not count."""
        samples, seconds = self.samples, self.train_s
        if self.first_step_s is not None and samples > self.batch_size:
            samples, seconds = samples - self.batch_size, seconds - self.first_step_s
        return samples / seconds if seconds > 0 else None

    @property
    def final(self) -> dict[str, Any] | None:
        return self.evals[-1] if self.evals else None


def write_metrics_csv(path: str | os.PathLike[str], runs: Sequence[RunHistory]) -> int:
    """Every run's rows (logged steps and evaluations) as one CSV; returns the row count."""
    count = 0
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRICS_COLUMNS)
        writer.writeheader()
        for run in runs:
            for row in run.rows:
                writer.writerow({k: _cell(row.get(k)) for k in METRICS_COLUMNS})
                count += 1
    return count


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def plot_memory(path: str | os.PathLike[str], samples: Sequence[Any]) -> bool:
    """The activation memory each rank held over the traced steps (`trace.MemorySample`s,
    measure_memory), beside timeline.png; False without matplotlib."""
    if not have_matplotlib():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.5))
    for rank in sorted({m.rank for m in samples}):
        mine = sorted((m.t_ms, m.bytes) for m in samples if m.rank == rank)
        ax.step([t for t, _ in mine], [b / (1 << 20) for _, b in mine], where="post",
                label=f"rank {rank}")
    ax.set_xlabel("time in the traced steps (ms)")
    ax.set_ylabel("activations held (MiB)")
    ax.set_title("memory of the microbatches in flight, measured")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_curves(path: str | os.PathLike[str], runs: Sequence[RunHistory],
                metric_label: str = "test accuracy") -> bool:
    """Training and test loss, and test accuracy, against samples seen; False without
    matplotlib."""
    if not have_matplotlib():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        steps = [r for r in run.rows if r.get("test_loss") is None and r.get("loss") is not None]
        if steps:
            left.plot([r["samples"] for r in steps], [r["loss"] for r in steps], color=color,
                      alpha=0.6, linewidth=1, label=f"{run.name}: training loss")
        if run.evals:
            x = [e["samples"] for e in run.evals]
            left.plot(x, [e["loss"] for e in run.evals], "o-", color=color, markersize=3,
                      label=f"{run.name}: test loss")
            if any(e.get("accuracy") is not None for e in run.evals):
                right.plot(x, [100 * e["accuracy"] for e in run.evals], "o-", color=color,
                           markersize=3, label=run.name)
    left.set_xlabel("training samples")
    left.set_ylabel("loss")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.set_xlabel("training samples")
    right.set_ylabel(f"{metric_label} (%)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
    return True


# ---- live progress ---------------------------------------------------------------------------

class RunRecorder:
    """Consumes a run's events: metrics rows, the progress bar or plain lines, the history.

    `log_every`: a metrics row every that many steps (default: about 200 rows per run);
    `print_steps`: off a terminal (no bar), a printed line every that many steps (default:
    about 10 per run); `console`: where lines and the bar go.
    """

    def __init__(self, console: Console, log_every: int | None = None,
                 target: float | None = None, live: bool | None = None,
                 print_steps: int | None = None,
                 csv_path: str | os.PathLike[str] | None = None) -> None:
        self.console = console
        self._csv_file = open(csv_path, "w", newline="") if csv_path is not None else None
        self._csv: Any = None
        if self._csv_file is not None:
            self._csv = csv.DictWriter(self._csv_file, fieldnames=METRICS_COLUMNS)
            self._csv.writeheader()
        self.rows_written = 0
        self.log_every = log_every
        self.target = target
        self.live = console.is_terminal if live is None else live
        self.print_steps = print_steps
        self.runs: dict[str, RunHistory] = {}
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._window: dict[str, list[float]] = {}
        self._last_log: dict[str, tuple[int, float]] = {}
        self._every: dict[str, int] = {}
        self._print_every: dict[str, int] = {}

    # -- the bar --
    def __enter__(self) -> RunRecorder:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[loss]}"),
                TextColumn("{task.fields[accuracy]}"), TimeElapsedColumn(),
                console=self.console, transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None

    def _row(self, run: RunHistory, row: dict[str, Any]) -> None:
        """A metrics row: to the CSV at once (flushed, so it can be followed live), and to
        the run's rows; past MAX_ROWS_KEPT every other step row is dropped from memory."""
        if self._csv is not None:
            self._csv.writerow({k: _cell(row.get(k)) for k in METRICS_COLUMNS})
            assert self._csv_file is not None
            self._csv_file.flush()
        self.rows_written += 1
        run.rows.append(row)
        if len(run.rows) > MAX_ROWS_KEPT:
            steps = [i for i, r in enumerate(run.rows) if r.get("test_loss") is None]
            drop = set(steps[1:-1:2])
            run.rows = [r for i, r in enumerate(run.rows) if i not in drop]

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    @property
    def trained(self) -> bool:
        """Whether any run reported a step (or an evaluation) so far."""
        return any(run.samples > 0 or run.evals for run in self.runs.values())

    # -- events --
    def handle(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "note":  # a line about the whole job (a stop, a saved checkpoint)
            self.print(event["text"])
            return
        run = self.runs.setdefault(event["run"], RunHistory(event["run"]))
        if kind == "start":
            run.steps, run.epochs = event["steps"], event["epochs"]
            run.batch_size = event.get("batch_size", 0)
            run.steps_per_epoch = event["steps_per_epoch"]
            self._every[run.name] = self.log_every or max(1, run.steps // 200)
            self._print_every[run.name] = self.print_steps or max(1, run.steps // 10)
            self._last_log[run.name] = (0, 0.0)
            self._window[run.name] = []
            if self._progress is not None:
                self._task = self._progress.add_task(
                    f"{run.name} epoch 1/{run.epochs}", total=run.steps, rate="", loss="",
                    accuracy="")
        elif kind == "step":
            self._step(run, event)
        elif kind == "eval":
            self._eval(run, event)
        elif kind == "phase" and self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=f"{run.name} {event['text']}")

    def _step(self, run: RunHistory, event: dict[str, Any]) -> None:
        step = event["step"]
        run.samples, run.train_s, run.elapsed_s = (event["samples"], event["train_s"],
                                                   event["elapsed_s"])
        run.first_step_s = event.get("first_step_s")
        window = self._window[run.name]
        window.append(event["loss"])
        if self._progress is not None and self._task is not None:
            rate = run.samples_per_s
            self._progress.update(
                self._task, completed=step,
                description=f"{run.name} epoch {event['epoch'] + 1}/{run.epochs}",
                rate=f"{rate:,.0f} samples/s" if rate else "",
                loss=f"loss {event['loss']:.4f}")
        if step % self._every[run.name] == 0 or step == run.steps:
            last_samples, last_train_s = self._last_log[run.name]
            if last_samples == 0 and run.first_step_s is not None and step > 1:
                last_samples, last_train_s = run.batch_size, run.first_step_s
            dt = run.train_s - last_train_s
            row = {"run": run.name, "step": step, "epoch": event["epoch"] + 1,
                   "samples": run.samples, "loss": sum(window) / len(window),
                   "samples_per_s": (run.samples - last_samples) / dt if dt > 0 else None,
                   "elapsed_s": run.elapsed_s}
            self._row(run, row)
            self._last_log[run.name] = (run.samples, run.train_s)
            window.clear()
        if self._progress is None and (step % self._print_every[run.name] == 0
                                       or step == run.steps):
            self.print(f"{run.name} step {step}/{run.steps}  loss {event['loss']:.4f}")

    def _eval(self, run: RunHistory, event: dict[str, Any]) -> None:
        run.samples, run.train_s, run.elapsed_s = (event["samples"], event["train_s"],
                                                   event["elapsed_s"])
        run.evals.append(event)
        accuracy = event.get("accuracy")
        self._row(run, {"run": run.name, "step": event["step"], "epoch": event["epoch"] + 1,
                        "samples": run.samples, "test_loss": event["loss"],
                        "test_accuracy": accuracy,
                        "samples_per_s": event.get("epoch_samples_per_s"),
                        "elapsed_s": run.elapsed_s})
        reached = ""
        if (self.target is not None and accuracy is not None and accuracy >= self.target
                and run.target_reached_s is None):
            run.target_reached_s, run.target_reached_step = run.elapsed_s, event["step"]
            reached = f"  (target {100 * self.target:.1f}% reached)"
        if self._progress is not None and self._task is not None and accuracy is not None:
            self._progress.update(self._task, accuracy=f"test acc {100 * accuracy:.1f}%")
        rate = event.get("epoch_samples_per_s")
        self.print(f"{run.name} epoch {event['epoch'] + 1}/{run.epochs}  step {event['step']}  "
                   f"test loss {event['loss']:.4f}"
                   + (f"  test accuracy {100 * accuracy:.2f}%" if accuracy is not None else "")
                   + (f"  {rate:,.0f} samples/s" if rate else "")
                   + f"  {run.elapsed_s:.1f} s" + reached)


# ---- the summary -----------------------------------------------------------------------------

def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def summary_table(title: str, columns: Sequence[str], rows: Sequence[tuple[str, Sequence[Any]]]
                  ) -> Table:
    """A two-or-more-column rich table: one row per quantity, one column per run."""
    table = Table(title=title, show_lines=False, title_justify="left")
    table.add_column("", style="bold")
    for c in columns:
        table.add_column(c, overflow="fold")
    for label, values in rows:
        table.add_row(label, *[v if isinstance(v, str) else _fmt(v) for v in values])
    return table


def render_text(table: Table, width: int = 100) -> str:
    """The table as plain text (for summary.txt)."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()


# ---- weight delays of the traced window ------------------------------------------------------

def traced_weight_delays(results: Sequence[dict[str, Any]], simulated: Any
                         ) -> dict[str, Any] | None:
    """Steady-state weight delays of a run's traced window, measured on the run's trace (the
    "events" of every rank's result) by `staleness.weight_delays`, next to the simulator's for
    the same schedule and window (`simulated`: its SimResult, or None). None without events.

    They agree when every update ends before or after each other rank's forward in the same
    order in the run as in the simulation: the simulator's costs only approximate the run's,
    and where the two are close (an exact tie in the simulation) the run's order is chance."""
    from pipedream_fast.staleness import trace_delays

    events = [e for r in results for e in r.get("events", [])]
    if not events:
        return None
    sim = simulated.delays if simulated is not None else None
    try:
        measured = trace_delays(events, sim.num_stages if sim else None,
                                sim.num_microbatches if sim else None)
    except ValueError as err:  # a trace that does not hold whole microbatches
        return {"error": str(err)}
    lo, hi = measured.steady_range
    return {"steady_microbatches": [lo, hi],
            "measured": {"max": measured.max_delay, "mean": measured.mean_delay},
            "simulated": None if sim is None else {"max": sim.max_delay,
                                                   "mean": sim.mean_delay}}


def weight_delay_text(delays: dict[str, Any] | None) -> str:
    """One summary cell: 'max 3, mean 2.00 (simulated: max 3, mean 2.00)'."""
    if delays is None:
        return "-"
    if "error" in delays:
        return f"not measured: {delays['error']}"
    lo, hi = delays["steady_microbatches"]

    def text(d: dict[str, Any]) -> str:
        return "no steady state" if d["max"] is None else f"max {d['max']}, mean {d['mean']:.2f}"

    if delays["measured"]["max"] is None:
        return (f"no steady state in the {lo + hi} traced microbatches (needs more than "
                f"{2 * lo}: raise --trace-steps)")
    sim = delays["simulated"]
    return (f"{text(delays['measured'])} (simulated: {text(sim) if sim else '-'}; "
            f"steady microbatches {lo}..{hi - 1})")
