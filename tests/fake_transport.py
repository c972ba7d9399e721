"""An in-memory transport for testing the executor in one process, without the C++ engine.

Ranks are threads; messages are Python objects in per-link FIFOs keyed exactly as the real
transports key them: (sender, receiver, channel, receiving stage). Like the real engines, a
link delivers in the order the sender sent, and `wait_recv` checks that the message at the
head of the link is the microbatch the executor asked for, so a schedule whose two ends
disagree on a link's order fails here as it would over gloo, with the link named.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any
from collections.abc import Sequence

import torch


class FakeHub:
    """What the threads of one fake job share: the links and the all-reduce rendezvous."""

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.links: dict[tuple, deque[tuple[int, list[torch.Tensor]]]] = defaultdict(deque)
        self.reduces: dict[tuple[tuple[int, ...], int], list[list[torch.Tensor]]] = {}
        self.closed = False
        self.sent = 0

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _Done:
    def wait(self) -> None:
        return None


class FakeTransport:
    """One rank of a FakeHub; follows `pipedream_fast.runtime.transport.Transport`."""

    def __init__(self, hub: FakeHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.posted: dict[tuple, deque[int]] = defaultdict(deque)
        self.rounds: dict[tuple[int, ...], int] = defaultdict(int)

    def send(self, peer: int, channel: Any, stage: int, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None:
        with self.hub.cond:
            self.hub.links[(self.rank, peer, int(channel), stage)].append(
                (microbatch, [t.detach().clone() for t in tensors]))
            self.hub.sent += 1
            self.hub.cond.notify_all()

    def post_recv(self, peer: int, channel: Any, stage: int, microbatch: int) -> None:
        self.posted[(peer, int(channel), stage)].append(microbatch)

    def wait_recv(self, peer: int, channel: Any, stage: int, microbatch: int) -> list[torch.Tensor]:
        expected = self.posted[(peer, int(channel), stage)].popleft()
        assert expected == microbatch, f"waited out of post order: {microbatch} vs {expected}"
        link = self.hub.links[(peer, self.rank, int(channel), stage)]
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: link or self.hub.closed, self.hub.timeout_s):
                raise TimeoutError(f"rank {self.rank}: nothing from rank {peer} for stage {stage}, "
                                   f"microbatch {microbatch}")
            if not link:
                raise RuntimeError(f"rank {self.rank}: the fake job was closed")
            got, tensors = link.popleft()
        if got != microbatch:
            raise RuntimeError(f"rank {self.rank}: link from rank {peer} to stage {stage} "
                               f"delivered microbatch {got}, expected {microbatch}")
        return tensors

    def allreduce(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> _Done:
        """Sums `tensors` over `ranks` in place: this rank's k-th all-reduce among `ranks`
        meets the others' k-th."""
        group = tuple(sorted(ranks))
        key = (group, self.rounds[group])
        self.rounds[group] += 1
        with self.hub.cond:
            entries = self.hub.reduces.setdefault(key, [])
            entries.append([t.clone() for t in tensors])
            self.hub.cond.notify_all()
            if not self.hub.cond.wait_for(lambda: len(entries) == len(group) or self.hub.closed,
                                          self.hub.timeout_s):
                raise TimeoutError(f"rank {self.rank}: all-reduce among {list(group)} timed out")
            if len(entries) < len(group):
                raise RuntimeError(f"rank {self.rank}: the fake job was closed")
            total = [sum(e[i] for e in entries) for i in range(len(tensors))]
        for t, s in zip(tensors, total):
            t.copy_(s)
        return _Done()

    def flush(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"messages_sent": self.hub.sent}

    def unfinished_sends(self) -> list[tuple[int, Any, int, int]]:
        return []  # sends land in the hub at once

    def close(self) -> None:
        return None
