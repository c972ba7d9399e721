"""What both launchers share about a rank process: its torchrun environment and the job's
rendezvous store (`loopback_store`), its ties to the launcher (a session of its own, death
with the launcher), and the reading of its failure (a peer's symptom or its own; `SETTLE_S`,
the window before blame)."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

SETTLE_S = 0.5
"""After the first failure, how long the launcher keeps collecting others before it decides
which rank to blame (a killed rank's peers fail a moment later, on the closed connection)."""


# What a rank sees when a peer dies or hangs: a closed or reset connection, a timeout.
_PEER_SYMPTOM = re.compile(
    r"time[ds]? ?out|connection (?:closed|reset|refused|abort)|closed by peer|broken pipe|"
    r"is rank \d+ alive|abandoned|(?:send|receiving .*) failed|DistBackendError|"
    r"DistNetworkError|QueueTimeout", re.IGNORECASE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def loopback_store(world_size: int, timeout_s: float = 300.0) -> Iterator[int]:
    """The job's rendezvous store, served by the launcher on 127.0.0.1 only; yields its port.

    A rank 0 that starts the store itself (torch's env:// rendezvous) listens on every
    interface, and the store is unauthenticated while every rank trusts it. Here the launcher
    binds the socket to loopback and hands it to the store (`master_listen_fd`), and every
    rank joins as a client, as under torchrun's agent (`rank_environment`). Binding here also
    closes the race of picking a free port and binding it later."""
    import torch.distributed as dist  # only launchers need it; the rank boot stays light

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(max(128, 2 * world_size))
        port = int(listener.getsockname()[1])
        store = dist.TCPStore("127.0.0.1", port, world_size, True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now, and closes it when it goes
    try:
        yield port
    finally:
        del store


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables, with the store served by the launcher (`loopback_store`):
    torch's env:// rendezvous then joins it as a client on every rank, rank 0 included.
    Unless the user set OMP_NUM_THREADS, each rank gets its share of the cores (torchrun
    gives 1): ranks that each start a thread per core fight over them (a 2-rank script on 2
    cores ran 2.5-3.5x slower)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    if "OMP_NUM_THREADS" not in os.environ and world_size > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


def kill_leftovers(pid: int) -> None:
    """SIGKILL what a rank that has exited left in its session (it is the leader: its process
    group is its pid): DataLoader workers it forked hold its sockets, so its peers would learn
    of its death only when the workers notice it themselves (5 s later)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left, or the group is no longer the rank's


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher dies (even by SIGKILL). Best effort."""
    if not sys.platform.startswith("linux"):
        return
    try:
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def _own_session() -> None:
    """Puts this rank in a session (and process group) of its own, as torchrun does: a signal
    to the launcher's process group (`kill -- -PGID`, `timeout`, Ctrl-C) then reaches the rank
    once, forwarded by the launcher, not twice."""
    try:
        os.setsid()
    except (AttributeError, OSError):  # not POSIX, or already a group leader
        pass


def _is_peer_symptom(err: BaseException) -> bool:
    """Whether a failure looks like the consequence of another rank's death or hang (closed
    connection, timeout) rather than a failure of this rank's own."""
    seen = 0
    current: BaseException | None = err
    while current is not None and seen < 8:
        if isinstance(current, (TimeoutError, ConnectionError, EOFError)) or \
                _PEER_SYMPTOM.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def flush_std_streams() -> None:
    """Flushes stdout and stderr before an `os._exit` (which would drop what they buffer)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
