"""Type stub of `pipedream_fast._C`, the pybind11 module built from csrc/bindings.cpp.

Hand-written: keep it in step with the bindings (every `m.def`, `py::class_`, `py::enum_`,
`py::register_exception` and property there has an entry here). Argument names are the
`py::arg` names, so keyword calls type-check as they run. Sequences of tensors are accepted
wherever the C++ side takes a `std::vector<at::Tensor>` (pybind11 converts any non-str
sequence); lists of tensors come back.
"""

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch.distributed import ProcessGroup

# True when the module was compiled with PIPEDREAM_FAST_WITH_CUDA (FORCE_CUDA=1 or a GPU).
cuda_enabled: bool

class QueueClosed(RuntimeError):
    """push/pop on a closed queue (pop raises only once the queue is drained)."""

class QueueTimeout(TimeoutError):
    """push/pop (or a CommEngine transfer) waited longer than its timeout."""

class VersionError(LookupError):
    """A weight version is unknown or released, or every slot of the ring is held."""

def now_ns() -> int:
    """Monotonic clock in ns (the clock that stamps Bundle.enqueued_ns)."""

CPU_CACHE_MIN_BYTES: int

def cpu_cache_acquire(limit_bytes: int) -> bool:
    """Installs the CPU block cache as c10's CPU allocator (counted: one release each),
    keeping up to `limit_bytes` of freed blocks; False when another allocator has a higher
    priority (nothing installed)."""

def cpu_cache_release() -> None:
    """One user of the CPU block cache less; the last one puts the previous allocator back
    and frees the cached blocks."""

def cpu_cache_empty() -> None:
    """Frees the CPU block cache's free blocks."""

def cpu_cache_stats() -> dict[str, int | bool]:
    """The CPU block cache's state and counts (requests of at least CPU_CACHE_MIN_BYTES)."""

class Bundle:
    """Tensors handed between pipeline stages, with their tags.

    No constructor is bound: bundles come out of `ActivationQueue.pop`/`try_pop`.
    """

    @property
    def tensors(self) -> list[torch.Tensor]: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def enqueued_ns(self) -> int: ...

class ActivationQueue:
    """Bounded, blocking, closable FIFO of tensor bundles.

    `timeout` is in seconds; None waits forever, a negative value raises ValueError.
    """

    def __init__(self, capacity: int, name: str = "queue", spin_us: float = 0.0) -> None: ...
    def push(self, tensors: Sequence[torch.Tensor], microbatch: int = -1, version: int = -1,
             timeout: float | None = None) -> None: ...
    def pop(self, timeout: float | None = None) -> Bundle: ...
    def try_pop(self) -> Bundle | None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def name(self) -> str: ...
    def __len__(self) -> int: ...
    def stats(self) -> dict[str, float]:
        """A new dict: pushed, popped, high_water (int); push_wait_s, pop_wait_s (float)."""

class WeightRing:
    """K preallocated weight-version slots of a stage (weight stashing)."""

    def __init__(self, params: Sequence[torch.Tensor], slots: int,
                 offload: bool = False) -> None: ...
    def snapshot(self, version: int | None = None) -> int: ...
    def tensors(self, version: int) -> list[torch.Tensor]: ...
    def release(self, version: int) -> None: ...
    def holds(self, version: int) -> bool: ...
    def held_versions(self) -> list[int]: ...
    def attach_grad_buffers(self) -> list[torch.Tensor]: ...
    def grad_buffers(self) -> list[torch.Tensor]: ...
    def live_tensors(self) -> list[torch.Tensor]: ...
    def live_buffers(self) -> list[torch.Tensor]: ...
    @property
    def capacity(self) -> int: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def bytes_per_version(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    @property
    def offloaded(self) -> bool: ...

class Channel:
    """What a link carries: activations forward, gradients back (a pybind11 `py::enum_`,
    not an `enum.Enum`: no iteration over the class; use `__members__`)."""

    ACTIVATION: ClassVar[Channel]
    GRADIENT: ClassVar[Channel]
    __members__: ClassVar[dict[str, Channel]]

    def __init__(self, value: int) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class CommEngine:
    """Point-to-point transfers of one rank over a c10d ProcessGroup.

    One link per (peer, channel, stage), where `stage` is the pipeline stage that receives the
    message (0 <= stage < 512). send() and post_recv() start a transfer and return;
    wait_recv() blocks (GIL released) until the tensors arrive or `timeout` seconds pass. On
    CPU the caller's thread issues each transfer (gloo's are asynchronous); on a GPU, or with
    `background=True`, each link's send and receive threads do. `depth`: messages in flight
    per link and direction before a send waits; `spin_us`: how long the link threads' queues
    spin before blocking; `recv_pool`: receive buffer sets pooled per link (>= 1);
    `gradient_group`: a group of the same ranks, in the same order, for the gradient channel's
    links (under NCCL its own communicator, hence its own streams).
    """

    DEFAULT_DEPTH: ClassVar[int]  # 8
    DEFAULT_RECV_POOL: ClassVar[int]  # 64

    # device defaults to torch.device("cpu"); pybind11 takes a torch.device only, not a str.
    def __init__(self, group: ProcessGroup, timeout: float = 300.0, depth: int = 8,
                 device: torch.device = ..., spin_us: float = 0.0,
                 recv_pool: int = 64, background: bool = False,
                 gradient_group: ProcessGroup | None = None) -> None: ...
    def send(self, peer: int, channel: Channel, stage: int, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None: ...
    def post_recv(self, peer: int, channel: Channel, stage: int, microbatch: int) -> None: ...
    def wait_recv(self, peer: int, channel: Channel, stage: int,
                  microbatch: int) -> list[torch.Tensor]: ...
    def arrived(self, peer: int, channel: Channel, stage: int, microbatch: int) -> bool:
        """Whether wait_recv of this posted receive would return at once (a hint)."""
    def flush(self) -> None: ...
    def shutdown(self, grace: float = 1.0) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def depth(self) -> int: ...
    @property
    def spin_us(self) -> float: ...
    @property
    def recv_pool(self) -> int: ...
    @property
    def background(self) -> bool: ...
    @property
    def split_channels(self) -> bool:
        """Whether the gradient channel runs on a group of its own."""
    def unfinished_sends(self) -> list[tuple[int, Channel, int, int]]:
        """The sends queued on link threads and not yet completed: (peer, channel, receiving
        stage, -1), one per send; none where the caller's thread issues transfers."""
    def stats(self) -> dict[str, float]:
        """A new dict: messages_sent, messages_received, bytes_sent, bytes_received (int);
        send_s, recv_s, wait_recv_s (float)."""


class TransferLoop:
    """Performs a run of transfer actions of a rank's program in one call on `engine`."""

    def __init__(self, engine: CommEngine) -> None: ...
    def run(self, actions: list[tuple[int, int, int, int, list[torch.Tensor] | None]]
            ) -> list[float]:
        """(kind, stage, microbatch, peer, tensors) in order: kind 0 sends the activation of
        `stage` to stage + 1 on `peer`, 1 the gradient to stage - 1, 2 and 3 post the receive
        of an activation or a gradient for `stage`. Each action's start and end on
        time.perf_counter's clock, 2 floats per action."""
    @property
    def position(self) -> int:
        """The index in the run in progress of the action being performed (-1: none)."""
