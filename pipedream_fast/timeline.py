"""The familiar pipeline diagram of a simulated run, as a PNG (matplotlib, Agg backend),
titled as a simulation (a prediction from the profile, not a measurement).

Ranks are rows (rank 0 on top); each forward and backward is a box at its simulated time,
colored by kind, with the microbatch number inside (and the weight version, when the box is
wide enough and the schedule uses more than one), which a key under the plot explains.
Optimizer steps and all-reduces are thin marks, so flushes and their bubbles stand out.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from pipedream_fast.ir import ActionKind  # noqa: E402

if TYPE_CHECKING:
    from pipedream_fast.sim import SimResult

_COLORS = {ActionKind.FORWARD: "#7fb3e0", ActionKind.BACKWARD: "#f0a35e",
           ActionKind.BACKWARD_INPUT: "#f0a35e", ActionKind.BACKWARD_WEIGHT: "#c9dd8a",
           ActionKind.OPTIMIZER_STEP: "#333333", ActionKind.AVERAGE: "#9b59b6",
           ActionKind.ALLREDUCE: "#2ca02c"}


def draw_timeline(result: SimResult, path: str | os.PathLike[str],
                  title: str | None = None) -> tuple[str, str]:
    """Draws `result` to `path`; returns the title and the key under the plot."""
    s = result.schedule
    span = result.makespan or 1.0
    width = min(40.0, max(8.0, 0.25 * len([r for r in result.records
                                            if r.action.kind.is_compute]) / max(s.num_ranks, 1)))
    fig, ax = plt.subplots(figsize=(width, 0.6 * s.num_ranks + 1.4))
    versions = {r.action.version for r in result.records if r.action.kind.is_compute}
    for rec in result.records:
        a = rec.action
        if a.kind not in _COLORS:
            continue
        y = s.num_ranks - 1 - rec.rank
        dur = rec.end - rec.start
        if a.kind.is_compute:
            ax.add_patch(Rectangle((rec.start, y + 0.1), dur, 0.8, facecolor=_COLORS[a.kind],
                                   edgecolor="black", linewidth=0.4))
            label = str(a.microbatch)
            if len(versions) > 1 and dur / span > 0.02:
                label += f"\nv{a.version}"
            if dur / span > 0.006:
                ax.text(rec.start + dur / 2, y + 0.5, label, ha="center", va="center",
                        fontsize=7)
        else:  # an all-reduce is drawn from when its group was complete; the wait is idle
            mark = max(rec.end - rec.ready, span * 0.002)
            ax.add_patch(Rectangle((rec.ready, y + 0.05), mark, 0.9, facecolor=_COLORS[a.kind],
                                   linewidth=0))
    ax.set_xlim(0, span)
    ax.set_ylim(0, s.num_ranks)
    ax.set_yticks([s.num_ranks - 0.5 - r for r in range(s.num_ranks)])
    ax.set_yticklabels([f"rank {r} (stage {','.join(map(str, s.stages_of(r)))})"
                        for r in range(s.num_ranks)], fontsize=8)
    ax.set_xlabel(f"time ({result.time_unit})")
    present = [k for k in _COLORS if any(r.action.kind is k for r in result.records)]
    ax.legend([Rectangle((0, 0), 1, 1, facecolor=_COLORS[k]) for k in present],
              [k.value.replace("_", " ") for k in present], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if s.num_ranks < 4 else -0.12),
              ncol=len(present), fontsize=7, frameon=False)
    title = title or (f"simulated {s.name} (predicted from the profile, not measured): "
                      f"{s.num_stages} stages, {s.num_microbatches} microbatches, makespan "
                      f"{result.makespan:.4g} {result.time_unit}")
    ax.set_title(title, fontsize=9)
    key = "number in a box: its microbatch"
    if len(versions) > 1:
        key += "; vN: the weight version it computes with"
    fig.text(0.01, 0.01, key, fontsize=7, ha="left", va="bottom")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
    return title, key
