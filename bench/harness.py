"""What every benchmark here shares: interleaved repeats, medians with their spread, the
machine's notes, and the results files.

Only ratios measured side by side mean anything on a shared machine (one thread trained the
same model at 61 samples/s on one machine and 106 on another, and a machine's speed drifts
within minutes). So drivers are never run one after the other in blocks: `alternate` runs
them in rounds, A B then B A then A B ..., each round's first driver swapping, after a
warm-up round that is not counted, and the ratio of two drivers is taken round by round
(`paired_ratio`), so a slow minute slows both sides of the ratios it touches.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def alternate(drivers: Mapping[str, Callable[[], float]], rounds: int,
              warmup: bool = True) -> dict[str, list[float]]:
    """Each driver's measurement (whatever it returns: seconds, us per action...) in each
    of `rounds` rounds, the order of the drivers reversed every other round; a first
    warm-up round is run and dropped."""
    names = list(drivers)
    values: dict[str, list[float]] = {name: [] for name in names}
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


def paired_ratio(values: Mapping[str, Sequence[float]], numerator: str,
                 denominator: str) -> Spread:
    """numerator / denominator taken round by round (see the module's docstring)."""
    return Spread.of([a / b for a, b in zip(values[numerator], values[denominator])])


def machine() -> str:
    """One line on where and when it ran."""
    return (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")


def command() -> str:
    """How this benchmark was run, as it should be run again."""
    return "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the first column left, the others right."""
    return (["| " + " | ".join(header) + " |",
             "| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |"]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_results(path: str | os.PathLike[str], title: str, intro: Sequence[str],
                  header: Sequence[str], rows: Sequence[Sequence[Any]],
                  outro: Sequence[str] = (), data: Mapping[str, Any] | None = None) -> None:
    """`path` (markdown): the title, the command and machine, `intro`, a table, `outro`;
    and beside it (`.json`) `data`, when given."""
    lines = [f"# {title}", "", f"Command: `{command()}`", "", f"Machine: {machine()}.", ""]
    lines += [*intro, ""] if intro else []
    lines += markdown_table(header, rows)
    lines += ["", *outro] if outro else []
    Path(path).write_text("\n".join(lines) + "\n")
    if data is not None:
        Path(path).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
