"""What every schedule generator shares: the rank layout, the 1F1B order, a per-stage program
builder, and the two lowering passes that turn compute programs into a full `Schedule`.

A generator only decides, for each stage replica, the order of forwards, backwards and
updates and which weight version each forward reads. Everything mechanical is done here:

    compute programs --add_retention--> + SNAPSHOT/RELEASE --add_communication--> + SEND/RECV

so the version bookkeeping and the send/receive placement are identical for every schedule
(as in torch.distributed.pipelining's lowering passes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from pipedream_fast.ir import Action, ActionKind, Schedule
from pipedream_fast.ir import allreduce, backward, forward, optimizer_step

K = ActionKind


@dataclass(frozen=True)
class Layout:
    """Which ranks run which stage; microbatch m goes to replica m mod r of every stage."""

    num_stages: int
    num_microbatches: int
    stage_ranks: tuple[tuple[int, ...], ...]

    @property
    def num_ranks(self) -> int:
        return sum(len(r) for r in self.stage_ranks)

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    def rank_of(self, stage: int, mb: int) -> int:
        return self.stage_ranks[stage][mb % self.replicas(stage)]

    def local_mbs(self, stage: int, replica: int) -> list[int]:
        return list(range(replica, self.num_microbatches, self.replicas(stage)))

    def noam(self, stage: int) -> int:
        """PipeDream's NUM_OPT_ACTIVE_MINIBATCHES: ceil(workers from this stage on / replicas)."""
        behind = sum(self.replicas(s) for s in range(stage, self.num_stages))
        return math.ceil(behind / self.replicas(stage))


@dataclass(frozen=True)
class Config:
    """Everything a generator needs; `make_schedule` fills in and checks the defaults."""

    layout: Layout
    step_microbatches: int = 1  # microbatches per optimizer step (gpipe, 1f1b, 2bw, data-parallel)
    local_steps: int = 1  # localsgd: H
    model_replicas: int = 1  # localsgd: R

    def groups(self) -> list[list[int]]:
        n, m = self.layout.num_microbatches, self.step_microbatches
        return [list(range(g, min(g + m, n))) for g in range(0, n, m)]


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
    """The compute actions of one stage replica, tracking its newest version per copy."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.actions: list[Action] = []
        self.newest: dict[int, int] = defaultdict(int)
        self.used: dict[int, tuple[int, int]] = {}  # mb -> (version, copy) of its forward

    def forward(self, mb: int, version: int | None = None, copy: int = 0) -> int:
        v = self.newest[copy] if version is None else version
        if v > self.newest[copy]:
            raise AssertionError(f"generator bug: stage {self.stage} forward of mb {mb} wants "
                                 f"version {v} before it exists (newest {self.newest[copy]})")
        self.actions.append(forward(self.stage, mb, v, copy))
        self.used[mb] = (v, copy)
        return v

    def backward(self, mb: int) -> None:
        version, copy = self.used[mb]
        self.actions.append(backward(self.stage, mb, version, copy))

    def step(self, mbs: Sequence[int], replicated: bool, copy: int = 0) -> None:
        version = self.newest[copy] + 1
        if replicated:
            self.actions.append(allreduce(self.stage, version, copy))
        self.actions.append(optimizer_step(self.stage, version, mbs, copy))
        self.newest[copy] = version

    def average(self) -> None:
        version = max(self.newest.values()) + 1
        self.actions.append(Action(K.AVERAGE, self.stage, version=version))
        for copy in self.newest:
            self.newest[copy] = version


def add_retention(actions: Sequence[Action]) -> list[Action]:
    """Insert SNAPSHOT v just before the update that supersedes v when v is still used after
    it, and RELEASE v right after its last use, for every (stage, copy) of a rank."""
    newest: dict[tuple[int, int], int] = defaultdict(int)
    superseded: dict[tuple[int, int, int], int] = {}
    last_use: dict[tuple[int, int, int], int] = {}
    copies: dict[int, set[int]] = defaultdict(set)
    for a in actions:
        copies[a.stage].add(a.copy)
    for i, a in enumerate(actions):
        if a.kind in (K.FORWARD, K.BACKWARD):
            last_use[(a.stage, a.copy, a.version)] = i
        elif a.kind in (K.OPTIMIZER_STEP, K.AVERAGE):
            for copy in ([a.copy] if a.kind is K.OPTIMIZER_STEP else copies[a.stage]):
                superseded[(a.stage, copy, newest[(a.stage, copy)])] = i
                newest[(a.stage, copy)] = a.version
    before: dict[int, list[Action]] = defaultdict(list)
    after: dict[int, list[Action]] = defaultdict(list)
    for (stage, copy, version), i in superseded.items():
        last = last_use.get((stage, copy, version), -1)
        if last > i:
            before[i].append(Action(K.SNAPSHOT, stage, version=version, copy=copy))
            after[last].append(Action(K.RELEASE, stage, version=version, copy=copy))
    out: list[Action] = []
    for i, a in enumerate(actions):
        out += before[i] + [a] + after[i]
    return out


def add_communication(rank: int, actions: Sequence[Action], layout: Layout) -> list[Action]:
    """Insert sends and receives; tensors between stages on the same rank move locally.

    A receive only posts a buffer (it never blocks), so receives go as early as their buffer
    can be known: a forward's activation receive right after the previous compute, a
    backward's gradient receive right after its own forward (NOAM buffers at most). Between
    two computes X and Y the gap is: receives, X's sends, then X's bookkeeping (SNAPSHOT,
    ALLREDUCE, OPTIMIZER_STEP, RELEASE, AVERAGE). Early posting is what keeps neighbours that
    send to each other in the same gap (1F1B), or a rank blocked in an all-reduce, from
    deadlocking under the blocking rule of `pipedream_fast.ir`.
    """
    last = layout.num_stages - 1
    out: list[Action] = []
    recvs: list[Action] = []
    sends: list[Action] = []
    held: list[Action] = []
    for a in actions:
        if not a.kind.is_compute:
            held.append(a)
            continue
        s, mb = a.stage, a.microbatch
        if a.kind is K.FORWARD and s > 0 and (src := layout.rank_of(s - 1, mb)) != rank:
            recvs.append(Action(K.RECV_ACT, s, mb, peer=src))
        out += recvs + sends + held + [a]
        recvs, sends, held = [], [], []
        if a.kind is K.FORWARD and s < last and (peer := layout.rank_of(s + 1, mb)) != rank:
            recvs.append(Action(K.RECV_GRAD, s, mb, peer=peer))
            sends.append(Action(K.SEND_ACT, s, mb, peer=peer))
        if a.kind is K.BACKWARD and s > 0 and (dst := layout.rank_of(s - 1, mb)) != rank:
            sends.append(Action(K.SEND_GRAD, s, mb, peer=dst))
    return out + recvs + sends + held


def build(name: str, config: Config, programs: Mapping[int, Sequence[Action]],
          max_versions: Mapping[int, int], max_inflight: Mapping[int, int]) -> Schedule:
    """Lower per-rank compute programs into a Schedule with the declared bounds."""
    layout = config.layout
    ranks = range(layout.num_ranks)
    actions = [add_communication(r, add_retention(programs[r]), layout) for r in ranks]
    return Schedule(name=name, num_stages=layout.num_stages,
                    num_microbatches=layout.num_microbatches, stage_ranks=layout.stage_ranks,
                    actions=actions, max_versions=[max_versions[r] for r in ranks],
                    max_inflight=[max_inflight[r] for r in ranks])
