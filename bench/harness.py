"""What every benchmark here shares: interleaved repeats, medians with their spread, a rank's
clock, the machine's notes, the results files. A shared machine's speed drifts within minutes,
so only ratios measured side by side mean anything: `alternate` runs drivers in rounds (A B,
B A, ...) after an uncounted warm-up round, and `paired_ratio` takes ratios round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

T, K = TypeVar("T"), TypeVar("K")


def alternate(drivers: Mapping[K, Callable[[], T]], rounds: int,
              warmup: bool = True) -> dict[K, list[T]]:
    """Each driver's result in `rounds` rounds (order reversed every other), after a warm-up."""
    names = list(drivers)
    values: dict[K, list[T]] = {name: [] for name in names}
    for index in range(rounds + (1 if warmup else 0)):
        order = names if index % 2 == 0 else names[::-1]
        measured = {name: drivers[name]() for name in order}
        if warmup and index == 0:
            continue
        for name in names:
            values[name].append(measured[name])
    return values


@dataclass(frozen=True)
class Spread:
    """The median of some repeats and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


def paired_ratio(values: Mapping[str, Sequence[float]], numerator: str, denominator: str) -> Spread:
    """numerator / denominator taken round by round."""
    return Spread.of([a / b for a, b in zip(values[numerator], values[denominator])])


def positive(text: str) -> int:
    value = int(text)  # argparse type: an int >= 1
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sizes(args: argparse.Namespace, default: Mapping[str, int], quick: Mapping[str, int],
          is_quick: bool) -> dict[str, int]:
    """Each of `default`'s keys from `args` where not None, else from `quick` or `default`."""
    base = quick if is_quick else default
    return {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in default}


# ---- a rank's clock ------------------------------------------------------------------------
def machine_busy_s() -> float:
    """CPU seconds the whole machine spent in user and system mode since boot (all cores)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle ...
    except OSError:
        return 0.0
    return (int(fields[1]) + int(fields[2]) + int(fields[3])) / os.sysconf("SC_CLK_TCK")


class Clock:
    """A rank's stamps (comparable across ranks) at the end of the warm-up and of the last
    step, with the machine's busy and this process's CPU time in between, the page faults
    the process took meanwhile (minor: fresh memory faulted in) and its resident memory at
    the end."""

    def __init__(self) -> None:
        self.start = self.busy = self.cpu = 0.0
        self.faults = 0

    def warmed_up(self) -> None:
        self.start, self.busy, self.cpu = time.perf_counter(), machine_busy_s(), time.process_time()
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def done(self) -> dict[str, float]:
        return {"start": self.start, "end": time.perf_counter(),
                "busy_s": machine_busy_s() - self.busy, "cpu_s": time.process_time() - self.cpu,
                "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults,
                "rss_mb": resident_mb()}


def resident_mb() -> float:
    """This process's resident memory in MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def window(ranks: Sequence[Mapping[str, Any]], samples: int) -> dict[str, float]:
    """One run from every rank's `Clock.done()`: from the latest end of warm-up to the latest
    end, as barriers would place it, and the cores other processes took meanwhile."""
    seconds = max(r["end"] for r in ranks) - max(r["start"] for r in ranks)
    return {"samples_per_s": samples / seconds, "seconds": seconds,
            "other_cores": other_cores(ranks, seconds)}


def other_cores(ranks: Sequence[Mapping[str, Any]], seconds: float) -> float:
    """Cores other processes took over `seconds`, from the ranks' `busy_s` and `cpu_s`."""
    machine_s = sum(r["busy_s"] for r in ranks) / len(ranks)
    return max(0.0, machine_s - sum(r["cpu_s"] for r in ranks)) / max(seconds, 1e-9)


_STORE: list[Any] = []  # the launcher's store, kept past the default group's end


def fresh_group(rank: int, world: int, index: int, backend: str = "gloo",
                timeout_s: float = 60.0) -> None:
    """A launched rank's process group of its own for run `index` (a failed run must not
    leave the next a broken group), on the launcher's store under its own prefix."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not _STORE:
        _STORE.append(distributed_c10d._get_default_store())
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(f"run{index}", _STORE[0]),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


RESULT = "BENCH_RESULT "  # a worker's result line, read back by `cluster_results`


def print_result(value: Any) -> None:
    print(RESULT + json.dumps(value), flush=True)


def cluster_results(cluster: Any, argv: Sequence[str], timeout: float) -> list[dict[str, Any]]:
    """Each rank's `print_result` value from `argv` run on every rank of a `netcluster.Cluster`."""
    done = cluster.run(list(argv), timeout=timeout,
                       env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    out = []
    for r in done.ranks:
        line = next((x for x in r.output.splitlines() if x.startswith(RESULT)), None)
        if line is None:
            raise RuntimeError(f"rank {r.rank} printed no result; its output:\n{r.output[-3000:]}")
        out.append(json.loads(line[len(RESULT):]))
    return out


# ---- notes ---------------------------------------------------------------------------------
def machine() -> str:
    """One line on where and when it ran."""
    return (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")


def device_line(device: torch.device) -> str:
    """The device, CUDA and NCCL (on a GPU), torch and Python, in one line."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    nccl = ""
    with contextlib.suppress(Exception):  # a build without NCCL
        nccl = ", NCCL " + ".".join(map(str, torch.cuda.nccl.version())) \
            if device.type == "cuda" else ""
    return f"{where}; torch {torch.__version__}{cuda}{nccl}; Python {platform.python_version()}"


def machine_info(**extra: Any) -> dict[str, Any]:
    """The machine's notes for a results JSON (and `extra`)."""
    return {"cores": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "date": datetime.date.today().isoformat(), **extra}


def machine_line(m: Mapping[str, Any], wall_s: float | None = None) -> str:
    """`machine_info`'s notes as the results' "Date: ... Machine: ..." line."""
    extra = "".join(f", {k} {v}" for k, v in m.items()
                    if k not in ("cores", "processor", "torch", "python", "date"))
    return (f"Date: {m['date']}. Machine: {m['cores']} cores, {m['processor']}, torch "
            f"{m['torch']}{extra}, Python {m['python']}."
            + ("" if wall_s is None else f" Whole run: {wall_s / 60:.1f} min."))


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent.parent,
                              capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def unless_stopped(err: BaseException) -> None:
    """Raises `err` again if the operator stopped the launch (`LaunchError.stopped_by`)."""
    if getattr(err, "stopped_by", None) is not None:
        raise err


def shorten(err: BaseException, limit: int = 240) -> str:
    """The exception and its causes, joined by "<-", each `Type: message` cut to `limit`."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain and len(chain) < 6:
        chain.append(current)
        current = current.__cause__ or current.__context__
    texts = [" ".join(str(e).split()) for e in chain]
    return " <- ".join(f"{type(e).__name__}: " + (t if len(t) <= limit else t[:limit - 3] + "...")
                       for e, t in zip(chain, texts))


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                   left: int = 1) -> list[str]:
    """A markdown table's lines: the first `left` columns left-aligned, the others right."""
    return (["| " + " | ".join(header) + " |",
             "| " + " | ".join(["---"] * left + ["---:"] * (len(header) - left)) + " |"]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def emit(out: str | os.PathLike[str] | None, text: str, data: Any = None) -> None:
    """Prints the markdown `text`; with `out`, writes it there and `data` beside it (.json)."""
    print(text)
    if out:
        Path(out).write_text(text)
        if data is not None:
            Path(out).with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")


def write_results(path: str | os.PathLike[str], title: str, intro: Sequence[str],
                  header: Sequence[str], rows: Sequence[Sequence[Any]],
                  outro: Sequence[str] = (), data: Mapping[str, Any] | None = None) -> None:
    """`path`: title, command, machine, `intro`, a table, `outro`; `data` beside it (.json)."""
    lines = [f"# {title}", "", f"Command: `{command()}`", "", f"Machine: {machine()}.", ""]
    lines += [*intro, ""] if intro else []
    lines += markdown_table(header, rows)
    lines += ["", *outro] if outro else []
    Path(path).write_text("\n".join(lines) + "\n")
    if data is not None:
        write_json(Path(path).with_suffix(".json"), data)


def write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> None:
    """`data` as JSON at `path` (its folder made), non-finite floats as null."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(plain(data), indent=indent) + "\n")


def plain(value: Any) -> Any:
    """A JSON-able copy: non-finite floats as None, a one-element tensor as its number."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


@contextlib.contextmanager
def figure(path: str | os.PathLike[str], rows: int = 1, cols: int = 1,
           size: tuple[float, float] = (8, 5), dpi: int = 110) -> Iterator[Any]:
    """matplotlib (Agg) axes, `rows` x `cols` (a 2-D array), saved to `path` on leaving."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi)
    finally:
        plt.close(fig)


def axes_text(ax: Any, title: str | None, xlabel: str, ylabel: str, legend: Any = None,
              grid: float | None = 0.3) -> None:
    """An axes' title, labels, legend (`legend`: its keyword arguments; None: none) and grid."""
    if title is not None:
        ax.set_title(title)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    if legend is not None:
        ax.legend(**legend)
    if grid is not None:
        ax.grid(True, alpha=grid)


# ---- runs disturbed by other processes -----------------------------------------------------
DISTURBED = 0.25  # cores other processes took during a run beyond which it is run again


def least_disturbed(run: Callable[[], T], others: Callable[[T], float], retries: int,
                    say: Callable[[str], None] = print, deadline: float | None = None
                    ) -> tuple[T, list[T]]:
    """`run()`, again while other processes took more than DISTURBED cores during it (up to
    `retries` more times, before the monotonic `deadline`): the least disturbed run, the rest."""
    best, rest = run(), []
    for _ in range(retries):
        if others(best) <= DISTURBED or (deadline is not None and time.monotonic() >= deadline):
            break
        say(f"    other processes took {others(best):.2f} cores: again")
        again = run()
        best, worse = (again, best) if others(again) < others(best) else (best, again)
        rest.append(worse)
    return best, rest


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def fmt(value: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)
