"""Bucketed gradient all-reduce for a replicated stage, overlapped with the backward pass.

The weight ring keeps each dtype's gradients in one flat buffer, laid out in parameter order.
Backward produces gradients roughly in reverse parameter order, so the buffer is cut, from the
end, into contiguous buckets of about `bucket_bytes`. During the last backward before an
ALLREDUCE (the executor arms the buckets then), a hook on every weight leaf counts the
gradients that have landed, and a bucket's all-reduce starts as soon as its last gradient is
in, while backward goes on with earlier layers. ALLREDUCE starts whatever is left (parameters
that got no gradient), and OPTIMIZER_STEP waits for all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipedream_fast.runtime.transport import PendingReduce

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Bucket:
    flat: torch.Tensor  # the slice of a flat gradient buffer
    size: int           # how many parameters' gradients it holds
    landed: int = 0
    started: bool = False


class GradientBuckets:
    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 start_reduce: Callable[[list[torch.Tensor]], PendingReduce],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.start_reduce = start_reduce  # rebound per run: the transport may change
        self._bucket_of: list[int] = [0] * len(params)
        self._buckets: list[_Bucket] = []
        self._pending: list[PendingReduce] = []
        self._armed = False
        self._hooked: set[int] = set()
        for flat in grads:
            # Parameters of this buffer with their element offsets, last first.
            members = []
            for i, p in enumerate(params):
                g = p.grad
                if g is not None and g.dtype == flat.dtype and \
                        flat.data_ptr() <= g.data_ptr() < flat.data_ptr() + flat.nbytes:
                    members.append(((g.data_ptr() - flat.data_ptr()) // flat.element_size(), i))
            members.sort(reverse=True)
            hi, count = flat.numel(), 0
            for offset, i in members:
                self._bucket_of[i] = len(self._buckets)
                count += 1
                if (hi - offset) * flat.element_size() >= bucket_bytes:
                    self._buckets.append(_Bucket(flat[offset:hi], count))
                    hi, count = offset, 0
            if count:
                self._buckets.append(_Bucket(flat[:hi], count))
        self.watch(params)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def watch(self, leaves: Sequence[torch.Tensor]) -> None:
        """Hooks the leaves of one weight version (aligned with the parameters), once each."""
        for i, leaf in enumerate(leaves):
            if leaf.requires_grad and id(leaf) not in self._hooked:
                self._hooked.add(id(leaf))
                leaf.register_post_accumulate_grad_hook(lambda _, i=i: self._landed(i))

    def arm(self) -> None:
        """The next backward completes the gradients: start buckets as they fill."""
        self._armed = True
        for bucket in self._buckets:
            bucket.landed = 0

    def _landed(self, index: int) -> None:
        if not self._armed:
            return
        bucket = self._buckets[self._bucket_of[index]]
        bucket.landed += 1
        if bucket.landed == bucket.size and not bucket.started:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        bucket.started = True
        self._pending.append(self.start_reduce([bucket.flat]))

    def flush(self) -> None:
        """ALLREDUCE: start every bucket that has not started yet."""
        self._armed = False
        for bucket in self._buckets:
            if not bucket.started:
                self._start(bucket)

    def wait(self) -> None:
        """OPTIMIZER_STEP: every bucket's reduction is complete. The buckets stay started until
        `forget` (the stage's update calls it), so that a later flush before the update (the
        update sync's, which flushes every stage of the rank) does not reduce the gradients a
        second time (which multiplied them by the replica count)."""
        for pending in self._pending:
            pending.wait()
        self._pending.clear()

    def forget(self) -> None:
        """Back to the start of an update: after the update (its gradients are consumed), or
        after an abandoned run without waiting for reductions begun (their peers may be gone)."""
        self._pending.clear()
        self._armed = False
        for bucket in self._buckets:
            bucket.started = False
            bucket.landed = 0
