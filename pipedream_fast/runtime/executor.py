"""The executor: walks one rank's program of the schedule IR, and nothing else decides.

The program is a stream: actions are made as they are performed, so a run of any length
starts at once and holds memory bounded by the schedule's period; a long run replays its
steady state's period, shifted, rather than lowering every action (`ir.periodic`). Each action kind maps to
one small method. Received tensors are posted at RECV and collected by the compute that needs
them; activation stashing lives in `StageRuntime.inflight`, weight stashing in its weight
ring (the IR places each SNAPSHOT before the first forward of its version, so that forward
already runs on the retained copy and the update that follows may overwrite the live weights
in place). Messages are addressed by (receiving stage, microbatch); a rank holding several
stages hands tensors between its own neighbouring stages directly.

Only the first stage reads data. A microbatch's targets travel with its activations to the
last stage (appended to the activation message), and its loss travels back with its
gradients (appended to the gradient message), so every rank learns each microbatch's loss
when its backward arrives, and no two ranks ever have to read the same data in step.
In training (`sample_counts`) the target travels as (target, counts), the counts giving the
microbatch's share of its step's samples, by which the last stage weighs its loss
(`sample_weight`): microbatches of any size then make the plain loop's step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from pipedream_fast.ir import Action, ActionKind, Schedule
from pipedream_fast.ir.periodic import compiled_program
from pipedream_fast.schedules.lowering import Lookahead
from pipedream_fast.runtime.buckets import GradientBuckets
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.runtime.transport import ACTIVATION, GRADIENT, PendingReduce, Transport
from pipedream_fast.trace import TraceEvent

if TYPE_CHECKING:
    from pipedream_fast.runtime.calibration import Calibration

K = ActionKind
_COMPUTE = frozenset(kind for kind in ActionKind if kind.is_compute)
_UPDATES = frozenset((K.OPTIMIZER_STEP, K.AVERAGE))
# Actions made ahead while a rank waits for a message (`Executor._while_waiting`), in steps.
_PREFETCH, _PREFETCH_STEP = 64, 8
# How `_C.TransferLoop` codes each transfer action (see `Executor._transfer`).
_TRANSFER_CODES = {K.SEND_ACT: 0, K.SEND_GRAD: 1, K.RECV_ACT: 2, K.RECV_GRAD: 3}

# A microbatch's first-stage positional arguments and its target (which travels to the last
# stage with the activations).
InputSource = Callable[[int], tuple[tuple[Any, ...], Any]]
# Evaluation: the last stage's outputs of a microbatch, with its target.
OutputSink = Callable[[int, Any, Any], None]


def _leaves(value: Any) -> list[Any]:
    """`pytree.tree_leaves`, with a shortcut for what a target nearly always is: a tensor, or
    a tuple of tensors (a target with its sample counts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) is tuple:
        if len(value) == 2 and isinstance(value[0], torch.Tensor) and isinstance(value[1],
                                                                               torch.Tensor):
            return [value[0], value[1]]  # a target with its counts: no generator per message
        if all(isinstance(v, torch.Tensor) for v in value):
            return list(value)
    return pytree.tree_leaves(value)


def sample_weight(counts: torch.Tensor) -> float:
    """The weight of a microbatch's loss from the counts that travel with its target
    (`data_feed.MicrobatchFeed(counts=True)`): (its real samples n, its step's samples N, the
    step's microbatches chunks) -> chunks * n / N. The update averages over the step's
    microbatches (`StageRuntime.prepare_update`), so the step's gradient is then the mean over
    its samples, as the plain loop's on the whole batch; 0 for a microbatch of padding.
    Exactly 1.0 when the microbatch holds its even share, so that full, divisible batches are
    multiplied by nothing."""
    n, total, chunks = counts.tolist()  # int64: ints
    return 1.0 if chunks * n == total else chunks * n / total


class UpdateSync(Protocol):
    """What all stages agree on before a synchronous update (global clipping, tied weights,
    fp16 overflow); returns whether to skip the update."""

    def before_update(self, version: int, microbatches: Sequence[int],
                      stages: dict[int, StageRuntime]) -> bool: ...


class RuntimeFailure(RuntimeError):
    """An action failed on this rank; the message names the rank, the action and the cause."""


@dataclass
class ExecutorStats:
    """Where a rank's time went, in seconds, plus the transport's byte counts: computing
    (forwards and backwards, without their waits for a message), waiting for messages,
    updating (optimizer steps, with their gradient all-reduce waits, and averages)."""

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
                 target_spec: pytree.TreeSpec | None = None, trace: bool = False,
                 outputs: OutputSink | None = None, update_sync: UpdateSync | None = None,
                 calibration: Calibration | None = None, sample_counts: bool = False,
                 transfer_runs: bool = False) -> None:
        """`target_spec`: the structure of a microbatch's target (every rank must know it to
        split it off the activations). `outputs` given: evaluation, forwards only, in eval
        mode, each last-stage output handed to it. `update_sync`: called before updates.
        `calibration`: the rank's running estimate of its costs, handed every action.
        `sample_counts`: each target is (target, counts) (`MicrobatchFeed(counts=True)`), and
        the last stage weighs the microbatch's loss by them (`sample_weight`).
        `transfer_runs`: hand each run of transfer actions between two others to the C++ core
        in one call where the transport can (`ProcessTransport.transfer_loop`); those actions
        are then not yielded one by one (see `run`)."""
        self.schedule = schedule
        self.rank = rank
        self.stages = stages
        self.transport = transport
        self.inputs = inputs
        self.target_spec = target_spec if target_spec is not None else pytree.tree_flatten(())[1]
        self.training = outputs is None
        self.sink = outputs
        self.update_sync = update_sync
        self.sample_counts = sample_counts and self.training
        self.stats = ExecutorStats()
        self.calibration = calibration
        # The action in progress (its index, itself, since when): what a stuck rank was doing.
        self.current: tuple[int, Action, float] | None = None
        # What the action in progress waits for inside a compute or an update, if anything:
        # ("receive", channel, stage, mb, peer) or ("all-reduce", stage); read by `standing`
        # (a send in progress is its SEND action itself).
        self._waiting: tuple[Any, ...] | None = None
        self._carried: dict[tuple[int, int], Any] = {}  # (stage, mb) -> target to pass on
        self._losses: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> loss to pass back
        self.events: list[TraceEvent] | None = [] if trace else None
        make_loop = getattr(transport, "transfer_loop", None) if transfer_runs else None
        self._loop = make_loop() if make_loop is not None else None
        self._arrived = getattr(transport, "arrived", None)
        # The run of transfers the loop is performing: (index of its first, its actions).
        self._run_of: tuple[int, list[Action]] | None = None
        # The index the next action performed gets: `run` sets it at each yield, `send_ahead`
        # moves it on past what it performs, and `run` numbers on from it.
        self._next_index = 0
        self._program = Lookahead(compiled_program(schedule, rank))  # replayed by period
        if self.training:  # the schedule's correction for stale weights, if it has one
            for stage in stages.values():
                stage.use_correction(schedule.params.get("staleness"))
        self._outputs: dict[tuple[int, int], tuple[Any, ...]] = {}   # (stage, mb) -> to send
        self._posted: dict[tuple[Any, int, int], int] = {}  # (channel, stage, mb) -> peer
        # stage -> whether the next stage runs on this rank, where one rank holds it (a
        # replicated one depends on the microbatch: `rank_of`)
        self._next_here = {s: schedule.stage_ranks[s + 1] == (rank,) for s in stages
                           if s + 1 < len(schedule.stage_ranks)
                           and len(schedule.stage_ranks[s + 1]) == 1}
        for index, stage in stages.items():
            ranks = schedule.stage_ranks[index]
            if len(ranks) > 1 and stage.grads:
                def start(tensors: list[torch.Tensor], ranks: tuple[int, ...] = ranks) -> PendingReduce:
                    return transport.allreduce(ranks, tensors)
                if stage.buckets is None:
                    stage.buckets = GradientBuckets(stage.params, stage.grads, start,
                                                    stage.bucket_bytes)
                stage.buckets.start_reduce = start

    # --- helpers -------------------------------------------------------------------------
    def _completes_gradients(self, a: Action) -> bool:
        """Whether this backward is the stage's last before its next ALLREDUCE, so that its
        gradients are complete and the buckets may start reducing during it."""
        for b in self._program.ahead():
            if (b.stage, b.copy) == (a.stage, a.copy):
                if b.kind is K.ALLREDUCE:
                    return True
                if b.kind.spec.ends_microbatch:
                    return False
        return False

    def _delay(self, a: Action) -> int:
        """The updates of a forward's stage between the version it reads and the one its
        microbatch's gradient is applied to: the OPTIMIZER_STEP ahead that lists it makes
        version u + 1 on top of u, so the delay is u - the version read (0 if none does)."""
        for b in self._program.ahead():
            if (b.kind is K.OPTIMIZER_STEP and (b.stage, b.copy) == (a.stage, a.copy)
                    and a.microbatch in (b.microbatches or ())):
                return max(0, b.needs("version") - 1 - a.needs("version"))
        return 0

    def _recv(self, channel: Any, stage: int, mb: int) -> list[torch.Tensor]:
        key = (channel, stage, mb)
        if key not in self._posted:
            raise RuntimeError(f"stage {stage} needs the {channel.name.lower()} of microbatch "
                               f"{mb} but the schedule posted no receive for it")
        peer = self._posted.pop(key)
        start = time.perf_counter()
        self._waiting = ("receive", channel, stage, mb, peer)
        self._while_waiting(peer, channel, stage, mb)
        try:
            tensors = self.transport.wait_recv(peer, channel, stage, mb)
        finally:
            self._waiting = None
        self.stats.wait_s += time.perf_counter() - start
        return tensors

    def _while_waiting(self, peer: int, channel: Any, stage: int, mb: int) -> None:
        """Bookkeeping that can wait, done while the message is not there yet, where it costs
        the pipeline nothing: the calibration's records, then the next actions of the
        program, a few at a time until the message comes or enough are made."""
        arrived = self._arrived
        if arrived is not None and arrived(peer, channel, stage, mb):
            return
        calibration = self.calibration
        if calibration is not None and calibration.pending:
            calibration.catch_up()
        program = self._program
        for ahead in range(_PREFETCH_STEP, _PREFETCH + 1, _PREFETCH_STEP):
            if (not program.prefetch(ahead)
                    or (arrived is not None and arrived(peer, channel, stage, mb))):
                return

    def standing(self, now: float) -> str | None:
        """Where this rank stands, in words, for a report on a rank that makes no progress
        (`HangWatch`; called from another thread): the action in progress and for how long,
        what it waits for, the receives posted and not taken, the sends queued. None
        between actions."""
        current, waiting, run_of = self.current, self._waiting, self._run_of
        if current is None:
            return None
        index, action, since = current
        at = self._loop.position if run_of is not None and self._loop is not None else -1
        if run_of is not None and 0 <= at < len(run_of[1]):  # read once: it moves meanwhile
            index, action = run_of[0] + at, run_of[1][at]
        text = f"in action {index} ({action.to_text()}) for {now - since:.1f} s"
        if waiting is not None and waiting[0] == "all-reduce":
            ranks = list(self.schedule.stage_ranks[waiting[1]])
            text += (f", waiting for the gradient all-reduce of stage {waiting[1]} with ranks "
                     f"{ranks}")
        elif waiting is not None:
            _, channel, stage, mb, peer = waiting
            text += (f", waiting for the {channel.name.lower()} of stage {stage}, microbatch "
                     f"{mb} from rank {peer}")
        elif action.kind.spec.sends:
            stage = action.stage + (1 if action.kind is K.SEND_ACT else -1)
            what = "activation" if action.kind is K.SEND_ACT else "gradient"
            text += (f", sending the {what} of stage {stage}, microbatch {action.microbatch} to "
                     f"rank {action.peer} (waiting for room: its earlier sends are not taken)")
        else:
            text += ", not waiting for a message (computing, or in the user's code)"
        for _ in range(3):  # the rank's thread may change the table while it is read
            try:
                posted = sorted(self._posted.items(), key=lambda kv: (kv[0][2], kv[0][1]))
                break
            except RuntimeError:
                posted = []
        if posted:
            text += "; receives posted: " + ", ".join(
                f"{c.name.lower()} of stage {s} mb {m} from rank {p}" for (c, s, m), p in posted)
        unfinished = self.transport.unfinished_sends()
        if unfinished:
            text += "; sends queued: " + ", ".join(
                f"{c.name.lower()} of stage {s} " + (f"mb {m} " if m >= 0 else "")
                + f"to rank {p}" for p, c, s, m in unfinished)
        return text

    # --- one method per action kind ----------------------------------------------------------
    # An action names the fields its kind needs (Action checks that when it is made): the
    # asserts only tell the type checker, where `Action.needs` would be a call per action.
    def _split_target(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], Any]:
        """A received activation message: the activations, then the target's leaves."""
        n = self.target_spec.num_leaves
        if n == 0:
            return tuple(tensors), pytree.tree_unflatten([], self.target_spec)
        return tuple(tensors[:-n]), pytree.tree_unflatten(tensors[-n:], self.target_spec)

    def _forward(self, a: Action) -> Any:
        mb, version = a.microbatch, a.version
        assert mb is not None and version is not None
        stage = self.stages[a.stage]
        if stage.is_first:
            assert self.inputs is not None, "the first stage needs an input source"
            args, target = self.inputs(mb)
        elif (a.stage - 1, mb) in self._outputs:  # produced on this rank
            args = tuple(t.detach() for t in self._outputs.pop((a.stage - 1, mb)))
            target = self._carried.pop((a.stage - 1, mb))
        else:
            args, target = self._split_target(self._recv(ACTIVATION, a.stage, mb))
        if not self.training:
            out = stage.infer(args)
            if stage.is_last:
                assert self.sink is not None
                self.sink(mb, out, target)
            else:
                self._outputs[(a.stage, mb)] = out if isinstance(out, tuple) else (out,)
                self._carried[(a.stage, mb)] = target
            return None
        delay = self._delay(a) if stage.correction is not None else 0
        weight = 1.0
        if stage.is_last and self.sample_counts:  # the counts go no further than the loss
            target, counts = target
            weight = sample_weight(counts)
        outputs = stage.forward(mb, version, args, target, a.copy, delay, weight)
        if stage.is_last:
            loss = outputs[0].detach()
            if not stage.is_first:
                self._losses[(a.stage, mb)] = loss
            return loss
        self._outputs[(a.stage, mb)] = outputs
        self._carried[(a.stage, mb)] = target
        return None

    def _output_grads(self, a: Action) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
        """The gradient of a stage's output for a backward (None on the last stage), and the
        microbatch's loss that came back with it (None where the loss is already known)."""
        mb = a.microbatch
        assert mb is not None
        if self.stages[a.stage].is_last:
            return None, None
        here = self._next_here.get(a.stage)
        if here is None:
            here = self.schedule.rank_of(a.stage + 1, mb) == self.rank
        if here:
            # The next stage ran this microbatch on this rank: its input gradients, directly.
            grads = self.stages[a.stage + 1].take_input_grads(mb)
            loss = self._losses.pop((a.stage + 1, mb))
            if not self.stages[a.stage].is_first:
                self._losses[(a.stage, mb)] = loss
            return grads, None  # this rank knew the loss already
        *grads, loss = self._recv(GRADIENT, a.stage, mb)
        if not self.stages[a.stage].is_first:
            self._losses[(a.stage, mb)] = loss
        return grads, loss

    def _arm_if_complete(self, a: Action) -> None:
        buckets = self.stages[a.stage].buckets
        if buckets is not None and self._completes_gradients(a):
            buckets.arm()

    def _transfer(self, a: Action, code: int) -> tuple[Any, ...]:
        """A transfer action as `_C.TransferLoop.run` takes it, with the Python side's
        bookkeeping done: a send's message taken off the stage, a receive noted as posted.
        `_transfer_now` makes the engine call for an action performed on its own."""
        stage, mb, peer = a.stage, a.microbatch, a.peer
        assert mb is not None and peer is not None
        if code == 0:
            outputs = self._outputs.pop((stage, mb))
            tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
            tensors += _leaves(self._carried.pop((stage, mb)))  # the engine detaches
            return 0, stage, mb, peer, tensors
        if code == 1:
            tensors = self.stages[stage].take_input_grads(mb)
            return 1, stage, mb, peer, [*tensors, self._losses.pop((stage, mb))]
        self._posted[(ACTIVATION if code == 2 else GRADIENT, stage, mb)] = peer
        return code, stage, mb, peer, None

    def _transfer_now(self, a: Action) -> None:
        """A transfer action performed on its own (the Python path, and `drain`)."""
        code, stage, mb, peer, tensors = self._transfer(a, _TRANSFER_CODES[a.kind])
        if code == 0:
            self.transport.send(peer, ACTIVATION, stage + 1, mb, [t.detach() for t in tensors])
        elif code == 1:
            self.transport.send(peer, GRADIENT, stage - 1, mb, tensors)
        else:
            self.transport.post_recv(peer, ACTIVATION if code == 2 else GRADIENT, stage, mb)

    def _run_transfers(self, first: int, actions: list[Action], records: list[Any]) -> None:
        """Performs a run of transfer actions (numbered from `first`) in one call into the
        core, then notes each as the Python loop would: calibration and trace."""
        assert self._loop is not None
        self._run_of = (first, actions)
        self.current = (first, actions[0], time.perf_counter())
        try:
            stamps = self._loop.run(records)
        except Exception as err:
            at = max(self._loop.position, 0)
            raise RuntimeFailure(f"rank {self.rank}, action {first + at} "
                                 f"({actions[at].to_text()}): {err}") from err
        finally:
            self._run_of = None
        self.current = None
        calibration, events = self.calibration, self.events
        if calibration is not None:
            for i, action in enumerate(actions):
                calibration.later(action, stamps[2 * i], stamps[2 * i + 1], 0.0)
        if events is not None:
            for i, action in enumerate(actions):
                self._trace(action, stamps[2 * i], stamps[2 * i + 1], 0.0)

    def _trace(self, action: Action, t0: float, t1: float, waited: float) -> None:
        """The trace's event of an action performed (with `trace`)."""
        assert self.events is not None
        self.events.append(TraceEvent(
            # Absolute monotonic time: comparable across the processes of one machine.
            rank=self.rank, kind=action.kind.value, start_ms=t0 * 1e3,
            duration_ms=(t1 - t0) * 1e3, stage=action.stage,
            microbatch=action.microbatch, version=action.version,
            args={"token": action.to_text(), "waited_ms": waited * 1e3}))

    def send_ahead(self, limit: int) -> None:
        """Called between two yields of `run`, where the caller is about to do a step's
        bookkeeping (and its own code runs): performs now the transfers that come next in the
        program, up to the next other action or a send of a microbatch >= `limit` (the first
        of the steps not yet finished). Otherwise they would wait for that bookkeeping, and a
        peer finishing the step (for the last stage, the first stage waiting for the last
        gradient) with them. Receives posted early are posted early anyway (the lowering posts
        each as soon as it can); nothing is pending afterwards."""
        gathered: list[Action] = []
        for b in self._program.ahead():
            code = _TRANSFER_CODES.get(b.kind)
            if code is None or (code < 2 and (b.microbatch or 0) >= limit):
                break
            gathered.append(b)
        if not gathered:
            return
        for _ in gathered:
            self._program.pop()
        first = self._next_index
        self._next_index += len(gathered)
        if self._loop is not None:
            self._run_transfers(first, gathered, [self._transfer(a, _TRANSFER_CODES[a.kind])
                                                  for a in gathered])
            return
        for index, action in enumerate(gathered, first):  # as `run` performs one
            t0 = time.perf_counter()
            self.current = (index, action, t0)
            try:
                self._transfer_now(action)
            except Exception as err:
                raise RuntimeFailure(f"rank {self.rank}, action {index} ({action.to_text()}): "
                                     f"{err}") from err
            t1 = time.perf_counter()
            self.current = None
            if self.events is not None:
                self._trace(action, t0, t1, 0.0)
            if self.calibration is not None:
                self.calibration.later(action, t0, t1, 0.0)

    def _allreduce(self, a: Action) -> None:
        buckets = self.stages[a.stage].buckets
        if buckets is not None:
            buckets.flush()  # buckets that did not start during the backward start now

    def _step(self, a: Action) -> None:
        version = a.version
        assert version is not None
        buckets = self.stages[a.stage].buckets
        if buckets is not None:
            start = time.perf_counter()
            self._waiting = ("all-reduce", a.stage)
            try:
                buckets.wait()
            finally:
                self._waiting = None
            self.stats.wait_s += time.perf_counter() - start
        skip = False
        if self.update_sync is not None:
            skip = self.update_sync.before_update(version, a.microbatches, self.stages)
        self.stages[a.stage].step(version, a.microbatches, skip, a.copy)

    def _backward(self, a: Action) -> torch.Tensor | None:
        mb = a.microbatch
        assert mb is not None
        self._arm_if_complete(a)
        grads, loss = self._output_grads(a)
        self.stages[a.stage].backward(mb, grads)
        return loss

    def _backward_input(self, a: Action) -> torch.Tensor | None:
        mb = a.microbatch
        assert mb is not None
        grads, loss = self._output_grads(a)
        self.stages[a.stage].backward_input(mb, grads)
        return loss

    def _backward_weight(self, a: Action) -> None:
        mb = a.microbatch
        assert mb is not None
        self._arm_if_complete(a)
        self.stages[a.stage].backward_weight(mb)

    def _handlers(self) -> dict[ActionKind, Callable[[Action], Any]]:
        """How this executor performs each action kind: one entry per kind of the IR."""
        return {K.FORWARD: self._forward, K.BACKWARD: self._backward,
                K.BACKWARD_INPUT: self._backward_input, K.BACKWARD_WEIGHT: self._backward_weight,
                K.SEND_ACT: self._transfer_now, K.SEND_GRAD: self._transfer_now,
                K.RECV_ACT: self._transfer_now, K.RECV_GRAD: self._transfer_now,
                K.ALLREDUCE: self._allreduce, K.OPTIMIZER_STEP: self._step,
                K.SNAPSHOT: lambda a: self.stages[a.stage].snapshot(a.needs("version"), a.copy),
                K.RELEASE: lambda a: self.stages[a.stage].release(a.needs("version"), a.copy),
                K.AVERAGE: self._average}

    def _average(self, a: Action) -> None:
        """localsgd: the stage's weight copies on this rank (one per model replica) become
        their mean. Local: the IR gives every copy of a stage to one rank (localsgd refuses
        replicated stages), so no rank waits for another here."""
        self.stages[a.stage].average(a.needs("version"))

    def drain(self, limit: int, apply_below: int | None = None) -> None:
        """After the caller stopped at a step boundary: every compute of the microbatches below
        `limit` (the steps yielded) has run on this rank, but what follows them may not have:
        their sends, all-reduces and updates, which peers finishing those steps wait for.
        Performs those, skips receives posted for later microbatches, and stops at the next
        compute (or a send of a later microbatch): nothing of a later step starts. Updates
        that include a microbatch >= `apply_below` (default `limit`) are skipped: a step whose
        loss was not finite sends what its peers wait for, but is not applied."""
        apply_below = limit if apply_below is None else apply_below
        handlers = self._handlers()
        while (action := self._program.pop()) is not None:
            mb = action.microbatch
            if action.kind.is_compute:
                break
            if mb is not None and mb >= limit:
                if action.kind in (K.RECV_ACT, K.RECV_GRAD):
                    continue  # a receive for a microbatch that will not come
                break
            if (action.kind in (K.ALLREDUCE, K.OPTIMIZER_STEP)
                    and self._updates_past(action, apply_below)):
                continue  # an update that includes a microbatch not finished (or not to apply)
            handlers[action.kind](action)
        # No flush: sends of later microbatches may wait for receives that never come. The
        # ones queued here go out in order before the transport's shutdown lets go of it.

    def _updates_past(self, action: Action, limit: int) -> bool:
        """Whether this all-reduce or update is for gradients of a microbatch >= limit."""
        step = action
        if action.kind is K.ALLREDUCE:  # its update follows: decide both alike
            step = next((b for b in self._program.ahead() if b.kind is K.OPTIMIZER_STEP
                         and (b.stage, b.copy) == (action.stage, action.copy)), action)
        return any(m >= limit for m in (step.microbatches or ()))

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[int, Action, torch.Tensor | None]]:
        """Performs every action; yields (index, action, loss) after each one, where loss is
        the detached loss of the action's microbatch where this rank learns it (the last
        stage's forward; the backward of a stage before it, from the gradient message) and
        None otherwise. A rank holding several stages may learn a loss twice (same value).

        With a transfer loop (`transfer_runs`), the transfers between two other actions are
        gathered as they come and performed in one call just before the next other action
        (or the program's end), and are not yielded: the indices yielded skip them. Nothing
        is pending at a yield, so a caller that stops there and drains leaves none behind."""
        start = time.perf_counter()
        handlers = self._handlers()
        index = 0
        if self.calibration is not None:
            self.calibration.begin_run()
        stats, clock, pop = self.stats, time.perf_counter, self._program.pop
        codes = _TRANSFER_CODES if self._loop is not None else {}
        gathered: list[Action] = []
        records: list[Any] = []
        while (action := pop()) is not None:
            code = codes.get(action.kind)
            if code is not None:
                try:
                    records.append(self._transfer(action, code))
                except Exception as err:
                    raise RuntimeFailure(f"rank {self.rank}, action {index} "
                                         f"({action.to_text()}): {err}") from err
                gathered.append(action)
                index += 1
                continue
            if gathered:
                self._run_transfers(index - len(gathered), gathered, records)
                gathered, records = [], []
            t0, waited = clock(), stats.wait_s
            self.current = (index, action, t0)
            try:
                result = handlers[action.kind](action)
            except Exception as err:
                raise RuntimeFailure(f"rank {self.rank}, action {index} ({action.to_text()}): "
                                     f"{err}") from err
            t1 = clock()
            waited = stats.wait_s - waited  # for a message, inside a forward or backward
            if action.kind in _COMPUTE:
                stats.compute_s += t1 - t0 - waited
            elif action.kind in _UPDATES:
                stats.update_s += t1 - t0
            if self.events is not None:
                self._trace(action, t0, t1, waited)
            if self.calibration is not None:
                self.calibration.later(action, t0, t1, waited)
            self.current = None
            self._next_index = index + 1
            yield index, action, result
            index = self._next_index  # on past what `send_ahead` performed meanwhile
        if gathered:
            self._run_transfers(index - len(gathered), gathered, records)
        self.transport.flush()
        self.stats.actions = index
        self.stats.total_s = time.perf_counter() - start
        self.stats.transport = self.transport.stats()
