"""`Tuning`: the core's speed knobs, in one place, for `Pipeline`, `LocalPipeline` and the CLI.

    pipe = Pipeline(model, loss_fn, optimizer, schedule="pipedream",
                    tuning=Tuning(queue_depth=2, spin_us=50))

Every knob changes how fast a run goes or how much memory it holds, never what it computes:
the same seed gives the same losses and weights whatever the knobs (the tests check it). The
defaults are what the runtime does without a `Tuning`. TUNING.md says when to change each one,
and bench/knobs.py measures them on model A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pipedream_fast import _C
from pipedream_fast.runtime.buckets import DEFAULT_BUCKET_BYTES
from pipedream_fast.runtime.transport import IO_PRIORITIES, THREAD_QUEUE_DEPTH

MIB = 1024 * 1024

OFFLOAD_NEEDS_CUDA = ("offload_stash moves stashed weight versions to pinned host memory; it "
                      "needs device='cuda'")


class TuningError(ValueError):
    """A knob with a bad value; `field` names it (the CLI turns it into its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Tuning:
    """Speed knobs of the C++ core; see the docstring of each field."""

    queue_depth: int | None = None
    """Messages queued per link and direction before a send blocks. None: 8 between processes
    (the CommEngine's default), 64 between threads (LocalPipeline). Raise it when a rank's
    trace shows sends waiting for room; lower it to bound the memory held by messages in
    flight. Any depth >= 1 is safe: validated schedules never need more than one."""

    spin_us: float = 0.0
    """Microseconds a waiting queue spins (watching for its message) before it blocks. A spin
    skips the OS wake-up (tens of microseconds) when the other side is quick. Only for ranks
    that each own a core (or more): on shared cores spinning steals the peer's time. 0: block
    at once."""

    bucket_mb: float = DEFAULT_BUCKET_BYTES / MIB
    """Size in MiB of the gradient buckets a replicated stage all-reduces during backward
    (as DDP's bucket_cap_mb). Smaller buckets start reducing earlier and overlap more of the
    backward, at more collectives per step; larger ones amortise each collective's latency.
    Only replicated stages have buckets."""

    weight_slots: int | None = None
    """Weight-version slots of each stage's ring (weight stashing). None: as many as the
    schedule keeps at once. Fewer than that is refused; more only costs memory (one copy of
    the stage's weights per slot)."""

    recv_pool: int = _C.CommEngine.DEFAULT_RECV_POOL
    """Receive buffer sets pooled per link. Received tensors come from the pool once nobody
    holds them any more, so steady state allocates nothing while the pool covers the messages
    a stage holds at once; lower it to cap the memory of a link with large activations."""

    offload_stash: bool = False
    """Keep stashed weight versions in pinned host memory instead of GPU memory, copied on a
    side stream (GPU only: needs device='cuda'). For models whose stashed versions do not fit
    in GPU memory; costs a host-device copy per version."""

    link_threads: bool = False
    """Move CPU (gloo) transfers on a send and a receive thread per link, as on a GPU, instead
    of issuing them on the rank's own thread (the CPU default: gloo's transfers are
    asynchronous already, and each thread hop costs a wake-up; a round trip of a small message
    takes about 1.35x less without them: bench/pingpong.py). For a rank whose compute thread
    should never enter a send or a receive call. GPU runs always use link threads."""

    io_priority: str = "auto"
    """The scheduling priority of gloo's I/O threads in each rank process (CPU runs):
    "normal", "low" (nice 19), "idle" (Linux SCHED_IDLE: they run when a core has nothing
    else to do) or "auto": "idle" when the process computes on one thread
    (torch.get_num_threads() == 1), else "normal". Each process group has one such thread;
    it reads every incoming message and writes a send the peer was not yet ready for. Where
    busy threads outnumber the cores (two ranks of one thread each on two cores) it wakes in
    the middle of the rank's send, preempts it with the link's lock held, and spins until the
    scheduler comes back, a whole time slice; "idle" never preempts, and made a small
    message's step 1.66x faster there (`bench/results/hot_path.md`). With compute threads
    filling every core through long computes an idle I/O thread would wait for a core, and a
    send the peer waits for with it: "auto" keeps "normal" for several compute threads."""

    transfer_runs: bool = True
    """Perform each run of transfer actions between two computes (sends, posted receives) in
    one call into the C++ core (`_C.TransferLoop`) instead of one Python action at a time;
    ranks as processes, plans without replicated stages (whose loss agreement is timed action
    by action). False: the Python executor performs every action itself (the reference the
    exactness tests compare with). Same messages, same order, same results."""

    split_channels: bool = False
    """Carry activations and gradients on process groups of their own (ranks as processes).
    Under NCCL a group is a communicator, and a communicator's transfers with one peer run on
    one stream, in order: a gradient received from the next stage then waits behind an
    activation sent to it (and the other way), where the schedule meant them to overlap. Two
    groups, two streams. Opt-in until a machine of two GPUs or more has measured it
    (`bench/gpu.py --set zoo` times both); on the CPU it changes nothing measurable (gloo has
    no such queue). Same messages, same results."""

    cpu_cache_mb: float = 2048.0
    """MiB of freed CPU tensor memory each process keeps for reuse (CPU runs; blocks of 256
    KiB or more; `csrc/cpu_cache.h`). Without it a block above malloc's mmap threshold is
    mapped fresh at each allocation and unmapped at each free, and the heap's free top goes
    back to the system, so every step faults in and zeroes its activations and gradients
    page by page again: on model A a third of a step, and half of the fully connected
    stages' (`bench/results/cpu_cache.md`). As the CUDA caching allocator, the cache keeps
    freed blocks and hands them out again; the process then holds its peak memory instead
    of giving it back between steps. Installed as c10's CPU allocator while a Pipeline is
    open (the previous one comes back at close). 0: off, malloc's own behaviour."""

    def __post_init__(self) -> None:
        if self.queue_depth is not None and not _is_int_at_least(self.queue_depth, 1):
            raise TuningError("queue_depth", f"queue_depth must be an integer >= 1 (messages "
                                             f"queued per link and direction), or None for the "
                                             f"transport's default; got {self.queue_depth!r}")
        if not _is_finite_at_least(self.spin_us, 0.0):
            raise TuningError("spin_us", f"spin_us must be a finite number of microseconds >= "
                                         f"0 (0: block at once); got {self.spin_us!r}")
        if not _is_finite_at_least(self.bucket_mb, 0.0) or self.bucket_mb == 0:
            raise TuningError("bucket_mb", f"bucket_mb must be a positive finite size in MiB "
                                           f"(25 by default, like DDP's bucket_cap_mb); got "
                                           f"{self.bucket_mb!r}")
        if self.weight_slots is not None and not _is_int_at_least(self.weight_slots, 1):
            raise TuningError("weight_slots", f"weight_slots must be an integer >= 1, or None "
                                              f"for as many as the schedule keeps; got "
                                              f"{self.weight_slots!r}")
        if not _is_int_at_least(self.recv_pool, 1):
            raise TuningError("recv_pool", f"recv_pool must be an integer >= 1 (receive buffer "
                                           f"sets kept per link); got {self.recv_pool!r}")
        if not isinstance(self.offload_stash, bool):
            raise TuningError("offload_stash", f"offload_stash must be True or False; got "
                                               f"{self.offload_stash!r}")
        if not isinstance(self.link_threads, bool):
            raise TuningError("link_threads", f"link_threads must be True or False; got "
                                              f"{self.link_threads!r}")
        if not isinstance(self.transfer_runs, bool):
            raise TuningError("transfer_runs", f"transfer_runs must be True or False; got "
                                               f"{self.transfer_runs!r}")
        if not isinstance(self.split_channels, bool):
            raise TuningError("split_channels", f"split_channels must be True or False; got "
                                                f"{self.split_channels!r}")
        if not _is_finite_at_least(self.cpu_cache_mb, 0.0):
            raise TuningError("cpu_cache_mb", f"cpu_cache_mb must be a finite size in MiB >= 0 "
                                              f"(0: off); got {self.cpu_cache_mb!r}")
        if self.io_priority not in IO_PRIORITIES:
            raise TuningError("io_priority", f"io_priority must be one of "
                                             f"{', '.join(IO_PRIORITIES)}; got "
                                             f"{self.io_priority!r}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * MIB))

    @property
    def process_queue_depth(self) -> int:
        """The queue depth of a CommEngine link (ranks as processes)."""
        return _C.CommEngine.DEFAULT_DEPTH if self.queue_depth is None else self.queue_depth

    @property
    def thread_queue_depth(self) -> int:
        """The queue depth of a ThreadHub link (ranks as threads)."""
        return THREAD_QUEUE_DEPTH if self.queue_depth is None else self.queue_depth

    @property
    def cpu_cache_bytes(self) -> int:
        return int(self.cpu_cache_mb * MIB)

    def check_device(self, device: torch.device) -> None:
        """Refuses offload_stash for weights that do not live on a GPU."""
        if self.offload_stash and device.type != "cuda":
            raise TuningError("offload_stash", f"{OFFLOAD_NEEDS_CUDA} (the stage's weights are "
                                               f"on {device})")


def _is_int_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_finite_at_least(value: Any, low: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= low)
