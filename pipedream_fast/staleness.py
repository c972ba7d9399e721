"""Weight delay (staleness) of a run, measured on its timeline, never taken from a formula.

The definition is the one of the PipeDream theory paper ("Demystifying Pipeline Parallelism"):

1. Process all compute actions in order of start time, ties by stage index ascending (then
   by rank and position in the rank's list, so the order is total).
2. A forward of microbatch m on stage j records R(m, j) = the number of updates (by any
   stage) processed before it.
3. The update of microbatch m on stage s, processed when k updates have been processed
   before it, has for every stage j the delay d[j] = k - R(m, j).

An update is an OPTIMIZER_STEP; it is "of" every microbatch it lists, so a flushed step over
a minibatch yields one set of delays per microbatch. Replicas of a stage perform the same
logical update (same stage, copy and version): it counts once, at the first of them. Model
averaging (localsgd's AVERAGE) is not an update of a microbatch and is not counted.

Statistics cover the steady state: updates of microbatches m with S <= m < N - S. Because
the input is a list of timed actions, the real runtime's timeline can be analysed the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from pipedream_fast.ir import ActionKind

if TYPE_CHECKING:
    from pipedream_fast.sim import ActionRecord


@dataclass(frozen=True)
class Delay:
    """d[read_stage] of the update of `microbatch` on `update_stage`."""

    microbatch: int
    update_stage: int
    read_stage: int
    delay: int


class DelaySummary(TypedDict):
    """Max, mean and count of some delays; max and mean are None when there are none."""

    max: int | None
    mean: float | None
    count: int


def _summary(values: Sequence[int]) -> DelaySummary:
    if not values:
        return {"max": None, "mean": None, "count": 0}
    return {"max": max(values), "mean": sum(values) / len(values), "count": len(values)}


@dataclass
class DelayReport:
    num_stages: int
    num_microbatches: int
    delays: list[Delay] = field(default_factory=list)  # every update, steady or not

    @property
    def steady_range(self) -> tuple[int, int]:
        """Microbatches m with lo <= m < hi count as steady state (empty when N <= 2S)."""
        return self.num_stages, self.num_microbatches - self.num_stages

    @property
    def steady(self) -> list[Delay]:
        lo, hi = self.steady_range
        return [d for d in self.delays if lo <= d.microbatch < hi]

    @property
    def max_delay(self) -> int | None:
        return _summary([d.delay for d in self.steady])["max"]

    @property
    def mean_delay(self) -> float | None:
        return _summary([d.delay for d in self.steady])["mean"]

    def per_stage(self, by: str = "update_stage") -> dict[int, DelaySummary]:
        """Max/mean/count of steady delays grouped by `update_stage` or `read_stage`."""
        groups: dict[int, list[int]] = {s: [] for s in range(self.num_stages)}
        for d in self.steady:
            groups[getattr(d, by)].append(d.delay)
        return {s: _summary(v) for s, v in groups.items()}

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(d.delay for d in self.steady).items()))

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.steady_range
        return {"definition": "d[j] = k - R(m, j); steady state S <= m < N - S",
                "steady_microbatches": [lo, hi], "max_delay": self.max_delay,
                "mean_delay": self.mean_delay,
                "per_update_stage": {str(s): v for s, v in self.per_stage().items()},
                "per_read_stage": {str(s): v for s, v in self.per_stage("read_stage").items()},
                "histogram": {str(k): v for k, v in self.histogram().items()}}


def weight_delays(records: Sequence[ActionRecord], num_stages: int,
                  num_microbatches: int) -> DelayReport:
    """Apply the definition above to timed actions (anything with rank, index, action, start)."""
    order = sorted((r for r in records
                    if r.action.kind in (ActionKind.FORWARD, ActionKind.OPTIMIZER_STEP)),
                   key=lambda r: (r.start, r.action.stage, r.rank, r.index))
    report = DelayReport(num_stages, num_microbatches)
    read: dict[tuple[int, int], int] = {}  # (mb, stage) -> R(m, j)
    seen: set[tuple[int, int, int | None]] = set()  # (stage, copy, version) of an update
    processed = 0
    for rec in order:
        a = rec.action
        if a.kind is ActionKind.FORWARD:
            assert a.microbatch is not None  # Action() checks that every forward names one
            read[(a.microbatch, a.stage)] = processed
            continue
        update = (a.stage, a.copy, a.version)
        if update in seen:
            continue
        seen.add(update)
        for m in a.microbatches:
            for j in range(num_stages):
                if (m, j) not in read:
                    raise ValueError(f"the update {a.to_text()} on rank {rec.rank} applies "
                                     f"microbatch {m}, but the timeline has no forward of "
                                     f"microbatch {m} on stage {j} before it")
                report.delays.append(Delay(m, a.stage, j, processed - read[(m, j)]))
        processed += 1
    return report
