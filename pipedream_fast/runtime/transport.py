"""How tensors move between ranks: the executor only sees this small interface.

`ProcessTransport` (one process per rank) hands point-to-point traffic to the C++
`CommEngine`, whose background threads overlap it with compute, and runs gradient all-reduces
on per-stage c10d groups. `ThreadTransport` (one thread per rank in a single process) hands
tensors over through the C++ `ActivationQueue`s, with no copy at all.

Both follow the IR's contract: a receive is posted (`post_recv`) where the IR says RECV and
collected (`wait_recv`) by the compute that needs it; sends return at once.

Every transfer names its link: the peer rank, the channel and `stage`, the pipeline stage that
receives the message (s+1 for the activation of stage s, s-1 for its gradient). A rank that
holds several stages shares one rank pair between several stage boundaries, so links and
queues are kept per (peer, channel, stage): the boundaries may run the same microbatches in a
different order without ever mixing their tensors. Within one link, receives are collected
in the order they were posted.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipedream_fast import _C

ACTIVATION = _C.Channel.ACTIVATION
GRADIENT = _C.Channel.GRADIENT
# Messages queued per link between threads: cheap (tensors are handed over, not copied).
THREAD_QUEUE_DEPTH = 64
# `Tuning.io_priority`'s values, and the name gloo gives its I/O threads.
IO_PRIORITIES = ("auto", "normal", "low", "idle")
GLOO_IO_THREAD = "gloo_tcp_loop"


def resolve_io_priority(priority: str) -> str:
    """"auto": "idle" for a process that computes on one thread (its I/O threads then never
    compete with compute threads of its own for the cores), else "normal"."""
    if priority != "auto":
        return priority
    return "idle" if torch.get_num_threads() == 1 else "normal"


def set_io_priority(priority: str) -> int:
    """Gives every gloo I/O thread of this process `priority` ("normal", "low": nice 19,
    "idle": SCHED_IDLE, "auto": see `resolve_io_priority`; `Tuning.io_priority` says why);
    returns how many it changed. Threads gloo starts later (a group made afterwards) keep the
    default: call it after making the groups. Linux only (elsewhere a no-op)."""
    tasks = "/proc/self/task"
    if priority not in IO_PRIORITIES:
        raise ValueError(f"io_priority must be one of {', '.join(IO_PRIORITIES)}, got "
                         f"{priority!r}")
    priority = resolve_io_priority(priority)
    if not os.path.isdir(tasks):
        return 0
    changed = 0
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != GLOO_IO_THREAD:
                    continue
            if priority == "idle":
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            else:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, int(tid), 19 if priority == "low" else 0)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        changed += 1
    return changed


class PendingReduce(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    rank: int

    # `stage` is always the stage that receives the message, on the sending and receiving side.
    def send(self, peer: int, channel: _C.Channel, stage: int, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None: ...

    def post_recv(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> None: ...

    def wait_recv(self, peer: int, channel: _C.Channel, stage: int,
                  microbatch: int) -> list[torch.Tensor]: ...

    def arrived(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> bool:
        """Whether `wait_recv` of this posted receive would return at once (a hint: False
        where unknown); never blocks. The executor does its deferred bookkeeping while a
        message is not there yet."""
        ...

    def allreduce(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> PendingReduce: ...

    def flush(self) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def unfinished_sends(self) -> list[tuple[int, _C.Channel, int, int]]:
        """Sends queued and not completed: (peer, channel, stage, microbatch; -1 if unknown).
        Called from another thread (a stuck rank's report); a send the rank itself is blocked
        in shows as the executor's wait instead."""
        ...

    def close(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class _Works:
    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class ProcessTransport:
    """One rank of a c10d process group (gloo on CPU, NCCL on GPU).

    Every rank must build it with the same `stage_groups` (the replica ranks of each
    replicated stage) because creating c10d sub-groups is a collective call.
    """

    def __init__(self, stage_groups: Sequence[Sequence[int]], timeout_s: float,
                 device: torch.device | None = None, group: Any = None, *,
                 depth: int = _C.CommEngine.DEFAULT_DEPTH, spin_us: float = 0.0,
                 recv_pool: int = _C.CommEngine.DEFAULT_RECV_POOL,
                 link_threads: bool = False, io_priority: str = "auto",
                 gradient_group: Any = None) -> None:
        """`group`: the process group of every rank that carries the point-to-point traffic
        (default: the default group). A link's first message fixes what crosses it (the
        number of tensors and their dimensions; sizes and dtypes may vary) and the size of
        its posted receive buffers, so traffic of another structure (evaluation) uses its own
        group.
        `gradient_group`: a group of the same ranks for the gradient channel
        (`Tuning.split_channels`). `depth`, `spin_us`, `recv_pool`, `link_threads`,
        `io_priority`: the engine's speed knobs (see `Tuning`)."""
        if not dist.is_initialized():
            raise RuntimeError("ProcessTransport needs torch.distributed to be initialised "
                               "(run under torchrun or pipedream_fast.launch)")
        self.rank = dist.get_rank()
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        self._engine = _C.CommEngine(group, timeout=timeout_s, depth=depth,
                                     device=device or torch.device("cpu"), spin_us=spin_us,
                                     recv_pool=recv_pool,
                                     background=link_threads,
                                     gradient_group=gradient_group)
        self._closed = False
        self._groups: dict[tuple[int, ...], Any] = {}
        for ranks in stage_groups:
            key = tuple(sorted(ranks))
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = dist.new_group(list(key))  # collective: all ranks, same order
        if io_priority != "normal":  # after the groups: their I/O threads exist now
            set_io_priority(io_priority)

    def send(self, peer: int, channel: _C.Channel, stage: int, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None:
        self._engine.send(peer, channel, stage, microbatch, list(tensors))

    def post_recv(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> None:
        self._engine.post_recv(peer, channel, stage, microbatch)

    def wait_recv(self, peer: int, channel: _C.Channel, stage: int,
                  microbatch: int) -> list[torch.Tensor]:
        return self._engine.wait_recv(peer, channel, stage, microbatch)

    def arrived(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> bool:
        return self._engine.arrived(peer, channel, stage, microbatch)

    def allreduce(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> PendingReduce:
        group = self._groups[tuple(sorted(ranks))]
        # One bucket per dtype: the weight ring keeps each dtype's gradients in one flat buffer.
        return _Works([dist.all_reduce(t, group=group, async_op=True) for t in tensors])

    def transfer_loop(self) -> _C.TransferLoop:
        """A C++ performer of runs of transfer actions on this transport's engine."""
        return _C.TransferLoop(self._engine)

    def flush(self) -> None:
        self._engine.flush()

    def stats(self) -> dict[str, float]:
        return dict(self._engine.stats())

    def unfinished_sends(self) -> list[tuple[int, _C.Channel, int, int]]:
        return self._engine.unfinished_sends()

    def close(self) -> None:
        """Stops the engine's threads and removes the replica groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        if dist.is_initialized():
            for group in self._groups.values():
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # gone with the default group already
        self._groups = {}  # with the engine's, the last references: the groups go now


class ThreadHub:
    """The shared state of ranks that run as threads of one process: a queue per directed
    link, channel and receiving stage, and a rendezvous for all-reduces.

    `close()` stops the run: every queue and all-reduce, existing or made later (the hub
    remembers it is closed), wakes its waiters with an error at once. Every wait is bounded
    by `timeout_s`. `depth` and `spin_us` are the queues' capacity and spin (see `Tuning`)."""

    def __init__(self, world_size: int, timeout_s: float, depth: int = THREAD_QUEUE_DEPTH,
                 spin_us: float = 0.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.depth = depth
        self.spin_us = spin_us
        self._lock = threading.Lock()
        self._closed = False
        self._queues: dict[tuple[int, int, int, int], _C.ActivationQueue] = {}
        self._reduces: dict[tuple[int, ...], _ThreadReduce] = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def queue(self, src: int, dst: int, channel: _C.Channel, stage: int) -> _C.ActivationQueue:
        """The queue from rank `src` to rank `dst` of `channel` messages for `stage` (born
        closed once the hub is closed)."""
        key = (src, dst, int(channel), stage)
        with self._lock:
            if key not in self._queues:
                q = _C.ActivationQueue(
                    self.depth,
                    f"{channel.name.lower()} from rank {src} to rank {dst} for stage {stage}",
                    self.spin_us)
                if self._closed:
                    q.close()
                self._queues[key] = q
            return self._queues[key]

    def reduce(self, ranks: Sequence[int]) -> _ThreadReduce:
        key = tuple(sorted(ranks))
        with self._lock:
            if key not in self._reduces:
                self._reduces[key] = _ThreadReduce(len(key), self.timeout_s)
                if self._closed:
                    self._reduces[key].barrier.abort()
            return self._reduces[key]

    def close(self) -> None:
        """Wakes every waiter of every queue and all-reduce with an error (idempotent)."""
        with self._lock:
            self._closed = True
            for q in self._queues.values():
                q.close()
            for r in self._reduces.values():
                r.barrier.abort()


class _ThreadReduce:
    """Sums equally shaped tensor lists from `parties` threads, in place in each of them.
    Each of its barrier waits is bounded by `timeout_s`."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(parties, timeout=timeout_s)
        self._lock = threading.Lock()
        self._total: list[torch.Tensor] | None = None

    def run(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.barrier.wait() == 0:
            self._total = None
        self.barrier.wait()
        with self._lock:
            if self._total is None:
                self._total = [t.clone() for t in tensors]
            else:
                for total, t in zip(self._total, tensors):
                    total.add_(t)
        self.barrier.wait()
        assert self._total is not None
        for t, total in zip(tensors, self._total):
            t.copy_(total)
        self.barrier.wait()


class ThreadTransport:
    """One rank that is a thread of this process; tensors are handed over, never copied.

    `waiting` says what the rank is blocked on (a queue or an all-reduce), None while it
    computes; `since` is when its current wait began or its last one ended (monotonic). A
    waiter wakes at once when the hub is closed, a computing thread does not."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.rank = rank
        self._hub = hub
        self._sent = 0
        self.waiting: str | None = None
        self.since = time.monotonic()

    def _wait(self, what: str | None) -> None:
        self.since = time.monotonic()
        self.waiting = what

    def _stopped(self, what: str) -> _C.QueueClosed:
        return _C.QueueClosed(f"rank {self.rank} stopped waiting for the {what}: the run was "
                              f"stopped (another rank failed, or the caller left train())")

    def send(self, peer: int, channel: _C.Channel, stage: int, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None:
        q = self._hub.queue(self.rank, peer, channel, stage)
        what = f"room to send the {channel.name.lower()} of stage {stage}, microbatch " \
               f"{microbatch} to rank {peer}"
        self._wait(what)
        try:
            q.push([t.detach() for t in tensors], microbatch=microbatch,
                   timeout=self._hub.timeout_s)
        except _C.QueueClosed:
            raise self._stopped(what) from None
        finally:
            self._wait(None)
        self._sent += 1

    def post_recv(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> None:
        return None  # the queue already holds what the peer sent

    def arrived(self, peer: int, channel: _C.Channel, stage: int, microbatch: int) -> bool:
        return len(self._hub.queue(peer, self.rank, channel, stage)) > 0

    def wait_recv(self, peer: int, channel: _C.Channel, stage: int,
                  microbatch: int) -> list[torch.Tensor]:
        q = self._hub.queue(peer, self.rank, channel, stage)
        what = f"{channel.name.lower()} of stage {stage}, microbatch {microbatch} from rank {peer}"
        self._wait(what)
        try:
            bundle = q.pop(timeout=self._hub.timeout_s)
        except _C.QueueTimeout:
            raise _C.QueueTimeout(
                f"rank {self.rank} waited {self._hub.timeout_s:g} s for the {what}; "
                f"is rank {peer} alive and running the same schedule?") from None
        except _C.QueueClosed:
            raise self._stopped(what) from None
        finally:
            self._wait(None)
        if bundle.microbatch != microbatch:
            raise RuntimeError(f"rank {self.rank}: expected the {what}, got microbatch "
                               f"{bundle.microbatch}; the ranks disagree on the schedule")
        return list(bundle.tensors)

    def allreduce(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> PendingReduce:
        self._wait(f"the all-reduce among ranks {list(ranks)}")
        try:
            self._hub.reduce(ranks).run(tensors)
        except threading.BrokenBarrierError:
            if self._hub.closed:
                raise RuntimeError(f"rank {self.rank}: the all-reduce among ranks {list(ranks)} "
                                   f"was abandoned: the run was stopped (another rank failed, "
                                   f"or the caller left train())") from None
            raise RuntimeError(f"rank {self.rank}: the all-reduce among ranks {list(ranks)} "
                               f"timed out after {self._hub.timeout_s:g} s or was broken; is "
                               f"every replica alive?") from None
        finally:
            self._wait(None)
        return _Done()

    def flush(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"messages_sent": self._sent}

    def unfinished_sends(self) -> list[tuple[int, _C.Channel, int, int]]:
        return []  # a send is handed over whole; a blocked one shows in `waiting`

    def close(self) -> None:
        return None
