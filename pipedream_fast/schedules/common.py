"""What every schedule generator shares: its configuration, the 1F1B order, a per-stage
program builder, and `build`, which lowers compute programs into a streaming `Schedule`.

A generator only decides, for each rank, the order of forwards, backwards and updates and
which weight version each forward reads, as a lazy stream of actions. Everything mechanical
is done by the lowering passes of `pipedream_fast.schedules.lowering` (retention, then
communication), identically for every schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from pipedream_fast.ir import Action, ActionKind, Schedule
from pipedream_fast.ir import allreduce, backward, forward, optimizer_step
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.lowering import lower

K = ActionKind
ComputeProgram = Callable[[int], Iterable[Action]]  # rank -> forwards, backwards, updates


@dataclass(frozen=True)
class Config:
    """Everything a generator needs; `make_schedule` fills in and checks the defaults."""

    layout: Layout
    chunks: int = 1  # microbatches per optimizer step (gpipe, 1f1b, 2bw, data-parallel)
    local_steps: int = 1  # localsgd: H
    model_replicas: int = 1  # localsgd: R

    def num_groups(self) -> int:
        return -(-self.layout.num_microbatches // self.chunks)

    def group(self, g: int) -> range:
        """Microbatches of update group g (the last one may be short)."""
        m, n = self.chunks, self.layout.num_microbatches
        return range(g * m, min(g * m + m, n))

    def most_local(self, stage: int, replica: int) -> int:
        """The most microbatches of one group that a replica of `stage` takes. The counts
        repeat every r groups, so r groups and the (short) last one decide."""
        r = self.layout.replicas(stage)
        groups = self.num_groups()
        probe = set(range(min(groups, r))) | {groups - 1}
        return max(len(self.group(g)[(replica - self.group(g).start) % r::r]) for g in probe)


def one_f_one_b(mbs: Sequence[int], warmup: int) -> Iterator[tuple[str, int]]:
    """`warmup` forwards, then alternate backward/forward, then drain: ('F'|'B', mb) pairs.

    Backwards come first as soon as the warm-up is over: this is where "ready backwards take
    priority over forwards" lives, so executors and the simulator never reorder.
    """
    warmup = max(1, min(warmup, len(mbs)))
    for m in mbs[:warmup]:
        yield "F", m
    for i, m in enumerate(mbs):
        yield "B", m
        if warmup + i < len(mbs):
            yield "F", mbs[warmup + i]


class Program:
    """Makes the compute actions of one stage replica, tracking its newest version per copy
    and the version each in-flight forward read (for its backward)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.newest: dict[int, int] = {}
        self.used: dict[int, tuple[int, int]] = {}  # in-flight mb -> (version, copy)

    def forward(self, mb: int, version: int | None = None, copy: int = 0) -> Action:
        newest = self.newest.get(copy, 0)
        v = newest if version is None else version
        if v > newest:
            raise AssertionError(f"generator bug: stage {self.stage} forward of mb {mb} wants "
                                 f"version {v} before it exists (newest {newest})")
        self.used[mb] = (v, copy)
        return forward(self.stage, mb, v, copy)

    def backward(self, mb: int) -> Action:
        version, copy = self.used.pop(mb)
        return backward(self.stage, mb, version, copy)

    def backward_input(self, mb: int) -> Action:
        """The input-gradient part of a split backward (its weight part follows later)."""
        version, copy = self.used[mb]
        return Action(K.BACKWARD_INPUT, self.stage, mb, version=version, copy=copy)

    def backward_weight(self, mb: int) -> Action:
        version, copy = self.used.pop(mb)
        return Action(K.BACKWARD_WEIGHT, self.stage, mb, version=version, copy=copy)

    def step(self, mbs: Iterable[int], replicated: bool, copy: int = 0) -> list[Action]:
        version = self.newest.get(copy, 0) + 1
        self.newest[copy] = version
        update = optimizer_step(self.stage, version, mbs, copy)
        return [allreduce(self.stage, version, copy), update] if replicated else [update]

    def average(self, copies: int) -> Action:
        version = max(self.newest.get(c, 0) for c in range(copies)) + 1
        for c in range(copies):
            self.newest[c] = version
        return Action(K.AVERAGE, self.stage, version=version)


    def act(self, kind: str, mb: int) -> Action:
        """The action a rank order names: "F" forward, "B" whole backward, "I" and "W" the
        input and weight parts of a split one."""
        return {"F": self.forward, "B": self.backward, "I": self.backward_input,
                "W": self.backward_weight}[kind](mb)


def ordered_steps(config: Config, programs: Sequence[Program],
                  order: Callable[[int], Iterable[tuple[str, int, int]]]) -> Iterator[Action]:
    """A rank's stream for schedules that give each step's compute as a rank order: for every
    step (group of microbatches), the actions of `order(microbatches in the step)`, each a
    (kind, index of the program, microbatch index in the step), then every program's update,
    the last stage's first."""
    for g in range(config.num_groups()):
        group = config.group(g)
        for kind, chunk, index in order(len(group)):
            yield programs[chunk].act(kind, group.start + index)
        for prog in reversed(programs):
            yield from prog.step(group, replicated=False)


def build(name: str, config: Config, compute: ComputeProgram,
          max_versions: Mapping[int, int], max_inflight: Mapping[int, int],
          gradients: bool = True, early_inputs: bool = False) -> Schedule:
    """A streaming Schedule: every rank's compute program, lowered lazily (`gradients`
    False: a forward-only program, no gradient messages; `early_inputs`: see
    `lowering.add_communication`)."""
    layout = config.layout
    ranks = range(layout.num_ranks)
    return Schedule(name, layout.num_stages, layout.num_microbatches, layout.stage_ranks, None,
                    [max_versions[r] for r in ranks], [max_inflight[r] for r in ranks],
                    stream=lambda rank: lower(rank, compute(rank), layout, gradients,
                                              early_inputs))
