"""A rank's program compiled once per period: a long run replays one period of its steady
state, shifted, instead of generating and lowering every action as it goes.

Generated schedules are periodic by construction (the validator rests on it: a stream is
proven on a window of its warm-up, three periods and its drain). Lowering a run action by
action (the generator, retention's look-ahead, the placement of sends and receives) costs
microseconds an action, a large part of the runtime's own cost where a stage computes for
little longer. So `compiled_program` lowers the same schedule on two short windows, W and
W + one period microbatches, cuts both into periods and finds the head (warm-up), the period
that repeats and the tail (drain) that give both windows exactly; the run's program is then
the head, the period shifted once per period of the run, and the tail shifted to the run's
end. Where nothing explains both windows, or the run is short, the program streams as
before: the result is always the stream's actions, only made another way.

An action belongs to the period of its microbatch (an update to that of its first
microbatch); one with neither (snapshot, release, all-reduce) to the period in progress. A
period's actions start at the first action of a later period than any before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pipedream_fast.ir.actions import Action
from pipedream_fast.ir.schedule import Schedule

Segments = list[list[Action]]
# (stage, weight copy) -> versions one period adds
VersionSteps = dict[tuple[int, int], int]


def compiled_program(schedule: Schedule, rank: int) -> Iterator[Action]:
    """Rank's actions, equal to `schedule.program(rank)`: replayed by period where the
    schedule's windows show how (see the module's docstring), streamed otherwise."""
    fit = _compile(schedule, rank)
    if fit is None:
        return schedule.program(rank)
    return _replay(*fit)


def _compile(schedule: Schedule, rank: int
             ) -> tuple[Segments, int, int, VersionSteps, int, int] | None:
    period, window = schedule.period, schedule.validation_microbatches
    n = schedule.num_microbatches
    if not schedule.is_stream or period is None or window is None or n % period:
        return None
    window = -(-window // period) * period + period  # whole periods, one more than proven
    if n <= window + period:
        return None  # short: streaming costs as little
    first = _cut(schedule.window(window).program(rank), period, window // period)
    second = _cut(schedule.window(window + period).program(rank), period,
                  window // period + 1)
    if first is None or second is None:
        return None
    found = _fit(first, second, period)
    if found is None:
        return None
    head, tail, steps = found
    return first, head, tail, steps, period, n // period


def _period_of(a: Action, period: int) -> int | None:
    if a.microbatch is not None:
        return a.microbatch // period
    if a.microbatches:
        return a.microbatches[0] // period
    return None


def _cut(actions: Iterator[Action], period: int, count: int) -> Segments | None:
    """The program in periods; None unless it has `count` of them."""
    segments: Segments = [[]]
    for a in actions:
        index = _period_of(a, period)
        while index is not None and index >= len(segments):
            segments.append([])
        segments[-1].append(a)
    return segments if len(segments) == count else None


def _version_steps(one: Sequence[Action], next_one: Sequence[Action]) -> VersionSteps | None:
    """How many versions each (stage, copy) moves from a period to the next; None where the
    two do not pair up action by action."""
    if len(one) != len(next_one):
        return None
    steps: VersionSteps = {}
    for a, b in zip(one, next_one):
        if a.version is not None and b.version is not None:
            step = b.version - a.version
            if step < 0 or steps.setdefault((a.stage, a.copy), step) != step:
                return None
    return steps


def _shift(segment: Sequence[Action], periods: int, period: int,
           steps: VersionSteps) -> list[Action] | None:
    out = []
    for a in segment:
        step = steps.get((a.stage, a.copy))
        if step is None and a.version is not None:
            return None  # a version the repeating period never moves
        out.append(a.shifted(periods * period, periods * (step or 0)))
    return out


def _fit(first: Segments, second: Segments, period: int
         ) -> tuple[int, int, VersionSteps] | None:
    """The shortest head and tail (in periods) that explain both windows: the heads equal,
    every period between head and tail the head's next one shifted, and the longer window's
    tail the shorter one's shifted by a period. At least two repeating periods are seen in
    the shorter window."""
    count = len(first)
    for ends in range(2, count - 1):
        for head in range(1, ends):
            tail = ends - head
            steps = _version_steps(first[head], first[head + 1])
            if steps is None or any(second[k] != first[k] for k in range(head)):
                continue
            if not (all(first[k] == _shift(first[head], k - head, period, steps)
                        for k in range(head, count - tail))
                    and all(second[k] == _shift(first[head], k - head, period, steps)
                            for k in range(head, count + 1 - tail))
                    and all(second[count + 1 - i] == _shift(first[count - i], 1, period, steps)
                            for i in range(1, tail + 1))):
                continue
            return head, tail, steps
    return None


def _replay(first: Segments, head: int, tail: int, steps: VersionSteps, period: int,
            periods: int) -> Iterator[Action]:
    for segment in first[:head]:
        yield from segment
    template = [(a, steps.get((a.stage, a.copy), 0)) for a in first[head]]
    yield from first[head]
    for k in range(1, periods - head - tail):
        moved = k * period
        for a, step in template:
            yield a.shifted(moved, k * step)
    later = periods - len(first)  # the tail: the window's, as many periods on as the run is
    for segment in first[len(first) - tail:]:
        for a in segment:
            yield a.shifted(later * period, later * steps.get((a.stage, a.copy), 0))
