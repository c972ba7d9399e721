"""Where a Pipeline's ranks live: processes (torch.distributed) or threads of one process.

A rank of a `Pipeline` runs the same code either way; what differs is only how it reaches the
other ranks, and that is this module:

- groups for collectives (`Group`: all-reduce, broadcast, gather of objects, barrier), made
  collectively by every rank in the same order, as `dist.new_group` requires;
- point-to-point transports for the schedule's traffic (`world.transport`);
- the backend name (NCCL's placement rules) and the rank's default device.

`ProcessWorld` is torch.distributed's default group (torchrun, `pipedream-fast run`,
`launch`): c10d groups and the C++ `CommEngine`. `ThreadWorld` is one thread of a
`ThreadShared` set: collectives meet in memory (`_Meeting`), tensors travel through the C++
activation queues of a `ThreadHub`. Everything the threads share can be aborted at once
(`ThreadShared.abort`): a failed rank wakes every other rank's wait, as a dead process's
closed sockets do.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipedream_fast.runtime.transport import ProcessTransport, ThreadHub, ThreadTransport, Transport
from pipedream_fast.tuning import Tuning


class Work(Protocol):
    def wait(self) -> Any: ...


class Group(Protocol):
    """The collectives a Pipeline needs, among `ranks` (global ranks; `src`/`dst` are
    global ranks too). Tensors are CPU tensors (gloo) except under NCCL."""

    ranks: tuple[int, ...]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum",
                   async_op: bool = False) -> Work | None: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def broadcast_object(self, obj: Any, src: int) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None: ...

    def barrier(self) -> None: ...


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class ProcessGroup:
    """A c10d process group of the ranks `ranks`."""

    def __init__(self, group: Any, ranks: Sequence[int]) -> None:
        self.group = group  # the c10d group (the CommEngine takes it as is)
        self.ranks = tuple(ranks)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum",
                   async_op: bool = False) -> Work | None:
        return dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, group_src=self.ranks.index(src), group=self.group)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group_src=self.ranks.index(src), group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        index = self.ranks.index(dst)
        out: list[Any] | None = ([None] * len(self.ranks)
                                 if dist.get_rank() == dst else None)
        dist.gather_object(obj, out, group_dst=index, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _destroy_default_group() -> None:
    """At exit, the process group a Pipeline started: left to interpreter teardown, gloo's
    threads can outlive the objects they use (an abort at exit, 1 run in 10)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessWorld:
    """This process is one rank of torch.distributed's default group (initialised from
    torchrun's environment if needed: gloo on CPU, NCCL with CUDA)."""

    def __init__(self, timeout_s: float) -> None:
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError("Pipeline needs a process group: run under torchrun, "
                                   "`pipedream-fast run --nproc N script.py` or "
                                   "pipedream_fast.launch (or call "
                                   "torch.distributed.init_process_group first), or pass "
                                   "ranks='threads' to run every rank in this process")
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            atexit.register(_destroy_default_group)  # what we start, we tear down
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.timeout_s = timeout_s
        self._groups: list[Any] = []
        self._transports: list[ProcessTransport] = []

    def default_device(self, model: Any = None) -> torch.device:
        """The rank's GPU under NCCL (LOCAL_RANK), else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)))
        return torch.device("cpu")

    def new_group(self, ranks: Sequence[int], backend: str | None = None) -> ProcessGroup | None:
        """A group with the world's timeout; None on a rank outside it. Collective."""
        group = dist.new_group(list(ranks), backend=backend,
                               timeout=timedelta(seconds=self.timeout_s))
        self._groups.append(group)
        if self.rank not in ranks:
            return None
        if dist.get_backend(group) == "gloo":
            # gloo connects the group's mesh inside new_group, and each rank returns once its
            # own side is up: one that closed the group at once (a Pipeline made and closed)
            # would cut a peer still connecting ("Connection closed by peer"). A barrier on it
            # returns only when every member is through.
            dist.barrier(group=group)
        return ProcessGroup(group, ranks)

    def transport(self, stage_ranks: Sequence[Sequence[int]], device: torch.device,
                  tuning: Tuning) -> Transport:
        """Point-to-point links on a group of their own (a run left early abandons them with
        receives posted, which must not disturb any other traffic), the gradients' on another
        where `tuning.split_channels` says so, and the replica groups of `stage_ranks`.
        Collective."""
        group = self.new_group(list(range(self.size)))
        assert group is not None
        gradients = self.new_group(list(range(self.size))) if tuning.split_channels else None
        transport = ProcessTransport(stage_ranks, self.timeout_s, device=device,
                                     group=group.group, depth=tuning.process_queue_depth,
                                     spin_us=tuning.spin_us, recv_pool=tuning.recv_pool,
                                     link_threads=tuning.link_threads,
                                     io_priority=tuning.io_priority,
                                     gradient_group=gradients.group if gradients else None)
        self._transports.append(transport)
        return transport

    def release(self) -> None:
        """Stops the transports' threads and removes the groups (not the default group,
        which a script may still use; one the world started goes at exit)."""
        transports, self._transports = self._transports, []
        for transport in transports:
            transport.close()
        groups, self._groups = self._groups, []
        if dist.is_initialized():
            for group in groups:
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # already gone with the default group


class Aborted(RuntimeError):
    """A wait of a rank thread ended because the run of every thread was stopped."""


_MISSING = object()


class _Meeting:
    """The calls of one thread group: every member brings a value to call number k, and each
    gets every member's value once all have come (in member order, so that results are the
    same on every member). Waits are bounded by the timeout and end at once on abort."""

    def __init__(self, shared: ThreadShared, ranks: Sequence[int]) -> None:
        self._shared = shared
        self.ranks = tuple(ranks)
        self._slots: dict[int, list[Any]] = {}
        self._reads: dict[int, int] = {}
        self.calls = [0] * len(self.ranks)  # each member's calls so far

    def reset(self) -> None:
        self._slots.clear()
        self._reads.clear()
        self.calls = [0] * len(self.ranks)

    def bring(self, member: int, call: int, value: Any) -> None:
        with self._shared.cond:
            slot = self._slots.setdefault(call, [_MISSING] * len(self.ranks))
            slot[member] = value
            self._shared.cond.notify_all()

    def collect(self, call: int, rank: int) -> list[Any]:
        shared = self._shared
        deadline = time.monotonic() + shared.timeout_s
        with shared.cond:
            while True:
                if shared.aborted is not None:
                    raise Aborted(f"rank {rank} stopped waiting for ranks {list(self.ranks)}: "
                                  f"{shared.aborted}")
                slot = self._slots[call]
                missing = [r for r, v in zip(self.ranks, slot) if v is _MISSING]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {rank} waited {shared.timeout_s:g} s for rank"
                                       f"{'s' if len(missing) > 1 else ''} "
                                       f"{', '.join(map(str, missing))} in a collective")
                shared.cond.wait(left)
            self._reads[call] = self._reads.get(call, 0) + 1
            if self._reads[call] == len(self.ranks):
                del self._slots[call], self._reads[call]
            return list(slot)


class _Pending:
    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish = finish

    def wait(self) -> None:
        self._finish()


class ThreadGroup:
    """A group of rank threads; its collectives meet in memory (`_Meeting`)."""

    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self._meeting = meeting
        self.ranks = meeting.ranks
        self.rank = rank
        self._member = meeting.ranks.index(rank)

    def _exchange(self, value: Any) -> Callable[[], list[Any]]:
        call = self._meeting.calls[self._member]
        self._meeting.calls[self._member] += 1
        self._meeting.bring(self._member, call, value)
        return lambda: self._meeting.collect(call, self.rank)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum",
                   async_op: bool = False) -> Work | None:
        collect = self._exchange(tensor.detach().clone())

        def finish() -> None:
            values = torch.stack(collect())
            tensor.copy_(values.sum(0) if op == "sum" else values.amax(0))

        if async_op:
            return _Pending(finish)
        finish()
        return None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        values = self._exchange(tensor.detach().clone() if self.rank == src else None)()
        with torch.no_grad():
            tensor.copy_(values[self.ranks.index(src)])

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self._exchange(obj if self.rank == src else None)()[self.ranks.index(src)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._exchange(obj)()

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        values = self._exchange(obj)()
        return values if self.rank == dst else None

    def barrier(self) -> None:
        self._exchange(None)()


class ThreadShared:
    """What the rank threads of one Pipeline share: the meetings of their groups and the
    hubs of their transports, each made by the first rank to ask for it (every rank makes
    groups and transports in the same order, so the n-th of one rank is the n-th of all)."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.aborted: str | None = None
        self._made: dict[int, Any] = {}

    def made(self, index: int, make: Callable[[], Any]) -> Any:
        with self.cond:
            if index not in self._made:
                self._made[index] = make()
                if self.aborted is not None and isinstance(self._made[index], ThreadHub):
                    self._made[index].close()
            return self._made[index]

    def reset(self) -> None:
        """After an abort, once every rank thread is back: the groups start afresh (the
        aborted hubs stay closed: the ranks make new transports)."""
        with self.cond:
            self.aborted = None
            for made in self._made.values():
                if isinstance(made, _Meeting):
                    made.reset()

    def abort(self, reason: str) -> None:
        """Wakes every wait of every rank thread with an error (idempotent)."""
        with self.cond:
            if self.aborted is None:
                self.aborted = reason
            for made in self._made.values():
                if isinstance(made, ThreadHub):
                    made.close()
            self.cond.notify_all()


class ThreadWorld:
    """Rank `rank` of `shared.size` rank threads of this process."""

    backend = "threads"

    def __init__(self, rank: int, shared: ThreadShared) -> None:
        self.rank = rank
        self.size = shared.size
        self.shared = shared
        self.timeout_s = shared.timeout_s
        self.made = 0  # groups and transports made so far, counted alike on every rank

    def default_device(self, model: Any = None) -> torch.device:
        """Where the caller's model is (rank threads share it), else the CPU."""
        first = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) \
            else None
        if first is None or first.is_meta:
            return torch.device("cpu")
        return first.device

    def _next(self) -> int:
        self.made += 1
        return self.made - 1

    def new_group(self, ranks: Sequence[int], backend: str | None = None) -> ThreadGroup | None:
        index = self._next()
        meeting = self.shared.made(index, lambda: _Meeting(self.shared, sorted(ranks)))
        return ThreadGroup(meeting, self.rank) if self.rank in ranks else None

    def transport(self, stage_ranks: Sequence[Sequence[int]], device: torch.device,
                  tuning: Tuning) -> Transport:
        index = self._next()
        hub = self.shared.made(index, lambda: ThreadHub(
            self.size, self.timeout_s, depth=tuning.thread_queue_depth, spin_us=tuning.spin_us))
        return ThreadTransport(hub, self.rank)

    def release(self) -> None:
        return None  # nothing outlives the threads' objects


World = ProcessWorld | ThreadWorld
