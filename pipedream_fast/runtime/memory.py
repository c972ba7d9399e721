"""Measured memory of a rank's stages (`Pipeline(measure_memory=True)`, `pipe.memory`).

What a stage holds, counted at the tensors themselves (their storages, each counted once),
never from the planner's formulas:

    parameters        the live weights (the weight ring's flat buffers), every weight copy
    weight_versions   the ring's slots, allocated for the stashed versions the schedule keeps
    gradients         the flat gradient buffers every backward accumulates into
    optimizer         the tensors of the optimizers' state (momentum, Adam's moments)
    activations       what the microbatches in flight hold until their backward: every
                      tensor autograd saves in the forward (seen through
                      `torch.autograd.graph.saved_tensors_hooks`), the stage's inputs and
                      its outputs; its peak over the run, and the rank's peak over all its
                      stages at once

Why this is honest on CPU, where torch keeps no allocator statistics: autograd keeps exactly
the tensors its pack hooks see (a recomputed block's are taken by torch.utils.checkpoint's
own hooks, and what it keeps, the block's input, is seen as the block's input), and a
storage held by several saved tensors (a view, an input saved twice) is counted once while
any in-flight microbatch holds it. Parameters, their versions and gradients are excluded from
the activations (autograd saves weights too). Not counted: temporaries inside one forward or
backward (freed before the next action), the re-run of a recomputed block during its
backward, and the transport's buffers. On GPU the CUDA caching allocator's peak
(`max_memory_allocated`) is reported beside it, which sees everything.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen = dict(_storage(t) for t in tensors if isinstance(t, torch.Tensor))
    return sum(seen.values())


class MemoryMeter:
    """One rank's activation bytes held by microbatches in flight, per stage and together.

    Owns: the storages each (stage, microbatch) in flight holds, how many of them hold each
    storage, the bytes held now and the peaks (per stage, and for the rank)."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # storage -> how many in-flight microbatches hold it
        self._sizes: dict[int, int] = {}
        self._owner: dict[int, int] = {}  # storage -> the stage it is counted on
        self._held: dict[tuple[int, int], set[int]] = {}  # (stage, microbatch) -> storages
        self._excluded: set[int] = set()  # weights, versions, gradients: counted elsewhere
        self.now = 0
        self.peak = 0
        self.stage_now: dict[int, int] = {}
        self.stage_peak: dict[int, int] = {}
        # (perf_counter in ms, bytes held) at each change, while a traced run records them
        self.samples: list[tuple[float, int]] | None = None

    def start_samples(self) -> None:
        """From now on, note (time, bytes held) at every change (a traced run)."""
        self.samples = []

    def take_samples(self) -> list[tuple[float, int]]:
        """The samples noted since `start_samples`; sampling stops."""
        taken, self.samples = self.samples or [], None
        return taken

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that are not activations (the stage's weights and gradients)."""
        self._excluded.update(_storage(t)[0] for t in tensors)

    @contextlib.contextmanager
    def recording(self, stage: int, microbatch: int) -> Iterator[None]:
        """Counts what autograd saves in this block of code for (stage, microbatch)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self._add(stage, microbatch, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def hold(self, stage: int, microbatch: int, tensors: Iterable[Any]) -> None:
        """Tensors (the stage's inputs and outputs) kept until the microbatch's backward."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(stage, microbatch, t)

    def release(self, stage: int, microbatch: int) -> None:
        """The microbatch's backward on `stage` is done: what only it held is freed."""
        for ptr in self._held.pop((stage, microbatch), ()):
            self._holders[ptr] -= 1
            if self._holders[ptr] == 0:
                size, owner = self._sizes.pop(ptr), self._owner.pop(ptr)
                del self._holders[ptr]
                self.now -= size
                self.stage_now[owner] -= size
                self._sample()

    def release_all(self) -> None:
        """A run left early: nothing is in flight any more."""
        for stage, microbatch in list(self._held):
            self.release(stage, microbatch)

    def _add(self, stage: int, microbatch: int, t: torch.Tensor) -> None:
        ptr, size = _storage(t)
        if not ptr or ptr in self._excluded:
            return
        held = self._held.setdefault((stage, microbatch), set())
        if ptr in held:
            return
        held.add(ptr)
        self._holders[ptr] = self._holders.get(ptr, 0) + 1
        if self._holders[ptr] > 1:
            return  # already counted while another microbatch holds it
        self._sizes[ptr], self._owner[ptr] = size, stage
        self.now += size
        self.stage_now[stage] = self.stage_now.get(stage, 0) + size
        self.peak = max(self.peak, self.now)
        self.stage_peak[stage] = max(self.stage_peak.get(stage, 0), self.stage_now[stage])
        self._sample()

    def _sample(self) -> None:
        if self.samples is not None:
            self.samples.append((time.perf_counter() * 1e3, self.now))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def stage_memory(runtime: Any, meter: MemoryMeter | None) -> dict[str, int]:
    """The bytes one stage runtime holds, by kind (see the module's docstring)."""
    rings = [c.ring for c in runtime.copies if c.ring is not None]
    optimizer_state = [v for c in runtime.copies if c.optimizer is not None
                       for state in c.optimizer.state.values()
                       for v in state.values() if isinstance(v, torch.Tensor)]
    parts = {
        "parameters": sum(_unique_bytes(r.live_buffers()) for r in rings),
        "weight_versions": sum(r.capacity * r.bytes_per_version for r in rings),
        "gradients": sum(_unique_bytes(r.grad_buffers()) for r in rings),
        "optimizer": _unique_bytes(optimizer_state),
        "activations_peak": meter.stage_peak.get(runtime.stage, 0) if meter else 0,
    }
    parts["total_peak"] = sum(parts.values())
    return parts


def rank_memory(runtimes: dict[int, Any], meter: MemoryMeter | None,
                device: torch.device) -> dict[str, Any]:
    """Every stage's bytes, and the rank's: its stages' weights, versions, gradients and
    optimizer state, plus the peak of the activations of all its stages together."""
    stages = {index: stage_memory(runtime, meter) for index, runtime in sorted(runtimes.items())}
    static = sum(s["total_peak"] - s["activations_peak"] for s in stages.values())
    rank: dict[str, Any] = {"activations_peak": meter.peak if meter else 0,
                            "total_peak": static + (meter.peak if meter else 0)}
    if device.type == "cuda":
        rank["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    return {"stages": stages, "rank": rank, "measured": meter is not None}
