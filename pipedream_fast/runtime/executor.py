"""The executor: walks one rank's action list of the schedule IR, and nothing else decides.

Each action kind maps to one small method. Received tensors are posted at RECV and collected
by the compute that needs them; activation stashing lives in `StageRuntime.inflight`, weight
stashing in its weight ring. Before walking, `hoist_snapshots` moves each SNAPSHOT of a version
up to the first forward on that version, so the forward already runs on the retained copy and
the update that follows may overwrite the live weights in place (the values are the same: no
update happens in between).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from pipedream_fast.ir import Action, ActionKind, Schedule
from pipedream_fast.runtime.buckets import GradientBuckets
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.runtime.transport import ACTIVATION, GRADIENT, PendingReduce, Transport
from pipedream_fast.trace import TraceEvent

K = ActionKind

# The first stage's positional arguments for a microbatch, and the last stage's target.
InputSource = Callable[[int], tuple[Any, ...]]
TargetSource = Callable[[int], Any]


class RuntimeFailure(RuntimeError):
    """An action failed on this rank; the message names the rank, the action and the cause."""


def hoist_snapshots(actions: Sequence[Action]) -> list[Action]:
    """Moves every SNAPSHOT(stage, v) to just before the first FORWARD(stage, v) that precedes it
    since the update that created v (see the module docstring)."""
    out: list[Action] = list(actions)
    for i, action in enumerate(actions):
        if action.kind is not K.SNAPSHOT:
            continue
        first = None
        for j in range(i - 1, -1, -1):
            a = actions[j]
            if a.stage != action.stage or a.copy != action.copy:
                continue
            if a.kind in (K.OPTIMIZER_STEP, K.AVERAGE):
                break
            if a.kind is K.FORWARD and a.version == action.version:
                first = j
        if first is not None:
            out.remove(action)
            out.insert(out.index(actions[first]), action)
    return out


@dataclass
class ExecutorStats:
    """Where a rank's time went, in seconds, plus the transport's byte counts."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    total_s: float = 0.0
    actions: int = 0
    transport: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "wait_s": self.wait_s, "update_s": self.update_s,
                "total_s": self.total_s, "actions": self.actions, **self.transport}


class Executor:
    """Runs rank `rank`'s actions of `schedule` with the given stage runtimes and transport."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, StageRuntime],
                 transport: Transport, inputs: InputSource | None = None,
                 targets: TargetSource | None = None, trace: bool = False) -> None:
        self.schedule = schedule
        self.rank = rank
        self.stages = stages
        self.transport = transport
        self.inputs = inputs
        self.targets = targets
        self.actions = hoist_snapshots(schedule.actions[rank])
        self.stats = ExecutorStats()
        self.events: list[TraceEvent] | None = [] if trace else None
        self._outputs: dict[tuple[int, int], tuple[Any, ...]] = {}   # (stage, mb) -> to send
        self._posted: dict[tuple[Any, int, int], int] = {}  # (channel, stage, mb) -> peer
        self._completing = self._completing_backwards(self.actions)
        for index, stage in stages.items():
            ranks = schedule.stage_ranks[index]
            if len(ranks) > 1 and stage.grads:
                def start(tensors: list[torch.Tensor], ranks: tuple[int, ...] = ranks) -> PendingReduce:
                    return transport.allreduce(ranks, tensors)
                if stage.buckets is None:
                    stage.buckets = GradientBuckets(stage.params, stage.grads, start)
                stage.buckets.start_reduce = start

    # --- helpers -------------------------------------------------------------------------
    @staticmethod
    def _completing_backwards(actions: Sequence[Action]) -> set[int]:
        """Indices of the backwards after which a stage's gradients are complete: the last
        BACKWARD of the stage before each of its ALLREDUCEs. Buckets are armed for those."""
        out: set[int] = set()
        last: dict[tuple[int, int], int] = {}
        for i, a in enumerate(actions):
            key = (a.stage, a.copy)
            if a.kind is K.BACKWARD:
                last[key] = i
            elif a.kind is K.ALLREDUCE and key in last:
                out.add(last.pop(key))
        return out

    def _recv(self, channel: Any, stage: int, mb: int) -> list[torch.Tensor]:
        key = (channel, stage, mb)
        if key not in self._posted:
            raise RuntimeError(f"stage {stage} needs the {channel.name.lower()} of microbatch "
                               f"{mb} but the schedule posted no receive for it")
        start = time.perf_counter()
        tensors = self.transport.wait_recv(self._posted.pop(key), channel, mb)
        self.stats.wait_s += time.perf_counter() - start
        return tensors

    # --- one method per action kind ----------------------------------------------------------
    def _forward(self, a: Action) -> Any:
        stage = self.stages[a.stage]
        target = None
        if stage.is_first:
            assert self.inputs is not None, "the first stage needs an input source"
            args = self.inputs(a.microbatch)
        elif (a.stage - 1, a.microbatch) in self._outputs:  # produced on this rank
            args = tuple(t.detach() for t in self._outputs.pop((a.stage - 1, a.microbatch)))
        else:
            args = tuple(self._recv(ACTIVATION, a.stage, a.microbatch))
        if stage.is_last:
            assert self.targets is not None, "the last stage needs a target source"
            target = self.targets(a.microbatch)
        outputs = stage.forward(a.microbatch, a.version, args, target)
        if stage.is_last:
            return outputs[0].detach()
        self._outputs[(a.stage, a.microbatch)] = outputs
        return None

    def _backward(self, a: Action) -> None:
        stage = self.stages[a.stage]
        grads = None
        if not stage.is_last:
            nxt = self.stages.get(a.stage + 1)
            if nxt is not None:  # the next stage is on this rank: its input gradients, directly
                grads = nxt.take_input_grads(a.microbatch)
            else:
                grads = self._recv(GRADIENT, a.stage, a.microbatch)
        stage.backward(a.microbatch, grads)
        stage.finish_backward(a.microbatch)

    def _send_act(self, a: Action) -> None:
        outputs = self._outputs.pop((a.stage, a.microbatch))
        self.transport.send(a.peer, ACTIVATION, a.microbatch,
                            [t.detach() for t in outputs if isinstance(t, torch.Tensor)])

    def _send_grad(self, a: Action) -> None:
        grads = self.stages[a.stage].take_input_grads(a.microbatch)
        self.transport.send(a.peer, GRADIENT, a.microbatch, grads)

    def _post(self, channel: Any, a: Action) -> None:
        self._posted[(channel, a.stage, a.microbatch)] = a.peer
        self.transport.post_recv(a.peer, channel, a.microbatch)

    def _allreduce(self, a: Action) -> None:
        buckets = self.stages[a.stage].buckets
        if buckets is not None:
            buckets.flush()  # buckets that did not start during the backward start now

    def _step(self, a: Action) -> None:
        buckets = self.stages[a.stage].buckets
        if buckets is not None:
            start = time.perf_counter()
            buckets.wait()
            self.stats.wait_s += time.perf_counter() - start
        self.stages[a.stage].step(a.version, a.microbatches)

    def _perform(self, a: Action, index: int) -> Any:
        kind = a.kind
        if kind is K.FORWARD:
            return self._forward(a)
        if kind is K.BACKWARD:
            buckets = self.stages[a.stage].buckets
            if buckets is not None and index in self._completing:
                buckets.arm()
            self._backward(a)
        elif kind is K.SEND_ACT:
            self._send_act(a)
        elif kind is K.SEND_GRAD:
            self._send_grad(a)
        elif kind is K.RECV_ACT:
            self._post(ACTIVATION, a)
        elif kind is K.RECV_GRAD:
            self._post(GRADIENT, a)
        elif kind is K.ALLREDUCE:
            self._allreduce(a)
        elif kind is K.OPTIMIZER_STEP:
            self._step(a)
        elif kind is K.SNAPSHOT:
            self.stages[a.stage].snapshot(a.version)
        elif kind is K.RELEASE:
            self.stages[a.stage].release(a.version)
        else:
            raise NotImplementedError(f"the executor cannot run {kind.value} actions yet")
        return None

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[int, Action, torch.Tensor | None]]:
        """Performs every action; yields (index, action, loss) after each one, where loss is the
        detached loss of a last-stage forward and None otherwise."""
        start = time.perf_counter()
        for index, action in enumerate(self.actions):
            t0 = time.perf_counter()
            try:
                result = self._perform(action, index)
            except Exception as err:
                raise RuntimeFailure(f"rank {self.rank}, action {index} ({action.to_text()}): "
                                     f"{err}") from err
            t1 = time.perf_counter()
            if action.kind.is_compute:
                self.stats.compute_s += t1 - t0
            elif action.kind is K.OPTIMIZER_STEP:
                self.stats.update_s += t1 - t0
            if self.events is not None:
                self.events.append(TraceEvent(
                    # Absolute monotonic time: comparable across the processes of one machine.
                    rank=self.rank, kind=action.kind.value, start_ms=t0 * 1e3,
                    duration_ms=(t1 - t0) * 1e3, stage=action.stage,
                    microbatch=action.microbatch, version=action.version,
                    args={"token": action.to_text()}))
            yield index, action, result
        self.transport.flush()
        self.stats.actions = len(self.actions)
        self.stats.total_s = time.perf_counter() - start
        self.stats.transport = self.transport.stats()
