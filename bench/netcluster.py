"""An emulated bandwidth-limited cluster on one Linux machine: K network namespaces on a bridge.

    root namespace:            bridge <P>br
                          ┌───────┼────────┐ ...
    host side veth        <P>h0   <P>h1        tbf (egress: traffic towards the rank)
                            │       │
    namespace side veth   <P>n0   <P>n1        tbf (egress: traffic from the rank)
    namespace             <P>s0   <P>s1        10.231.0.1, 10.231.0.2, ... /24

Every rank gets a namespace of its own, joined to the others by a veth pair on a bridge in the
root namespace; both ends of every veth are shaped by `tc ... tbf`, so each direction of each
link is limited to the rate (full duplex, as a switched Ethernet port is). One rank's process
runs in each namespace with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR =
rank 0's address, MASTER_PORT) and GLOO_SOCKET_IFNAME = its veth, so gloo's traffic between
ranks crosses the shaped links and nothing else does (a rank has no other way out).

    with Cluster(world=2, rate="1gbit") as cluster:
        result = cluster.run([sys.executable, "train.py"], timeout=600)
        print(result.elapsed_s, result.tx_bytes, [r.output for r in result.ranks])

Needs root, `ip` and `tc` (iproute2), network namespaces, veth, bridge and the tbf qdisc;
`available()` says whether this machine has them and why not. Standard library only.

Token bucket sizing. tbf sends at most `burst` bytes at once above the rate, and a packet larger
than the burst is split in software (or dropped). Veth hands TCP packets of up to ~64 KiB
(GSO, headers per segment included), so the burst is max(1 ms at the rate, 128 KiB): 1 ms keeps
the kernel timer from capping high rates, and 128 KiB lets a whole GSO packet through; at
100mbit that is 10 ms of line rate, 1-2% of a multi-megabyte transfer. The queue holds
`latency` (default 20 ms) at the rate beyond the burst; TCP sees drops past that, as on a
switch with a small buffer.

Cleanup. Everything is named `pdn<harness pid><letter>...` (interface names have at most 15
characters): bridge `<P>br`, veths `<P>h<i>`/`<P>n<i>`, namespaces `<P>s<i>`. Leaving the
`with` block (normally, by an exception, or by SIGINT/SIGTERM, which raise inside it) kills
every rank still running (its whole process group) and deletes the namespaces, veths and the
bridge. A harness killed with SIGKILL cannot clean up: its ranks die with it (parent-death
signal) and `remove_stale()` (also run before every new cluster) deletes what is named after a
PID that no longer exists.

    python bench/netcluster.py --rate 100mbit        # self-test: measure a TCP transfer
    python bench/netcluster.py --remove-stale        # delete what dead harnesses left
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import IO, Any

PREFIX = "pdn"
SUBNET = "10.231.0"  # rank i is SUBNET.(i + 1)/24; each bridge is its own L2 domain
MASTER_PORT = 29500  # every namespace has its own port space: no clash with anything
MIN_BURST = 128 * 1024
DEFAULT_LATENCY_MS = 20.0
FAIL_GRACE_S = 5.0  # after one rank fails, how long the others get to exit on their own
KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL of a rank's process group
OUTPUT_TAIL = 3000  # characters of a rank's output quoted in an error

_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_sequence = itertools.count()


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or a run on it failed."""


class RankFailed(ClusterError):
    """A rank exited with a non-zero code (the first to fail is named; the rest were killed)."""

    def __init__(self, message: str, rank: int, returncode: int, output: str) -> None:
        super().__init__(message)
        self.rank, self.returncode, self.output = rank, returncode, output


class RunTimeout(ClusterError):
    """Ranks were still running at the run's timeout; every rank was killed."""

    def __init__(self, message: str, ranks: list[int], timeout: float) -> None:
        super().__init__(message)
        self.ranks, self.timeout = ranks, timeout


class Interrupted(BaseException):
    """SIGTERM received inside a `Cluster` block (SIGINT raises KeyboardInterrupt): raised so
    that the block is left and cleaned up. Not an `Exception`, so `except Exception` in the
    caller's code does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# ---- rates -------------------------------------------------------------------------------------

def parse_rate(rate: str | float | None) -> int | None:
    """Bits per second from 10e9, "1e9", "100mbit", "2.5gbit", ...; None, "none" or
    "unlimited": no shaping (None)."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("none", "unlimited")):
        return None
    if isinstance(rate, bool):
        raise ValueError(f"link rate must be bits/s, got {rate!r}")
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        match = _RATE.match(rate)
        if match is None or match.group(2).lower() not in _RATE_UNITS:
            raise ValueError(
                f"cannot read link rate {rate!r}: give bits per second as a number (1e9) or a "
                f"number with one of the units {', '.join(u for u in _RATE_UNITS if u)} "
                f"(e.g. '100mbit', '2.5gbit'), or 'unlimited'; byte units such as 'mbps' "
                f"(megabytes/s for tc) are refused as ambiguous")
        bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if not bits >= 1000 or bits != bits or bits == float("inf"):
        raise ValueError(f"link rate must be at least 1000 bits/s and finite, got {rate!r}")
    return int(bits)


def format_rate(bits: int | None) -> str:
    """'100mbit', '2.5gbit', 'unlimited'."""
    if bits is None:
        return "unlimited"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def burst_bytes(rate_bits: int) -> int:
    """tbf burst for a rate: max(1 ms at the rate, 128 KiB); see the module docstring."""
    return max(rate_bits // 8 // 1000, MIN_BURST)


# ---- commands ----------------------------------------------------------------------------------

def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an iproute2 command; a failure names the command and quotes its error."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") when clusters can be built here, else (False, why). Probes in a throwaway
    namespace: a veth pair, a bridge and a tbf qdisc, all deleted with the namespace."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root, or in a container with " \
                      "CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found (install iproute2)"
    probe = f"{PREFIX}{os.getpid()}zprobe"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb")
        _sh("ip", "-n", probe, "link", "add", "name", "pbr", "type", "bridge")
        _sh("tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit",
            "burst", str(MIN_BURST), "latency", "20ms")
    except (ClusterError, OSError, subprocess.SubprocessError) as err:
        return False, f"cannot build an emulated cluster here: {err}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return True, ""


def _die_with_parent() -> None:
    """In a rank, before exec: SIGKILL it when the harness dies, even by SIGKILL (Linux's
    parent-death signal, which survives the exec of `ip netns exec` and of the command)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(process: subprocess.Popen[bytes], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the rank's process group, SIGKILL it `grace` seconds later if still there."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever the rank started in its group
    except (ProcessLookupError, PermissionError):
        pass


def _pids_in(namespace: str) -> list[int]:
    done = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL everything still inside the namespace: a namespace with processes in it
    outlives `ip netns del`, and so would its veth."""
    for pid in _pids_in(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _our_names() -> tuple[list[str], list[str]]:
    """(namespaces, links) in the root namespace whose names start with PREFIX."""
    namespaces = [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines()
                  if line.startswith(PREFIX)]
    links = []
    for line in _sh("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            links.append(name)
    return namespaces, links


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and links in the root namespace whose names start with `prefix`."""
    namespaces, links = _our_names()
    return [n for n in namespaces + links if n.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Kill what runs in the namespaces, delete them (their veths go with them, and so do the
    veths' peers), then the links left in the root namespace (bridges, unpaired veths)."""
    for namespace in namespaces:
        _kill_namespace_processes(namespace)
    for namespace in namespaces:
        _sh("ip", "netns", "del", namespace, check=False)
    present = set(_our_names()[1])
    for link in links:
        if link in present:
            _sh("ip", "link", "del", link, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces and links left by harnesses whose PID no longer runs (killed with
    SIGKILL, or a machine crash). Returns the names removed. A stale name whose PID was
    reused by a live process is kept (it cannot be told apart from a live cluster)."""
    namespaces, links = _our_names()

    def stale(name: str) -> bool:
        match = _NAME.match(name)
        return match is not None and not _pid_alive(int(match.group(1)))

    dead_namespaces = [n for n in namespaces if stale(n)]
    dead_links = [n for n in links if stale(n)]
    _delete(dead_namespaces, dead_links)
    return dead_namespaces + dead_links


# ---- results -----------------------------------------------------------------------------------

@dataclass
class RankResult:
    """One rank of a run: its exit code (negative: killed by that signal), its stdout and
    stderr together, and the bytes its veth sent and received during the run."""

    rank: int
    returncode: int
    output: str
    tx_bytes: int
    rx_bytes: int


@dataclass
class RunResult:
    ranks: list[RankResult]
    elapsed_s: float
    argv: list[str] = field(default_factory=list)

    @property
    def tx_bytes(self) -> int:
        """Bytes all ranks put on the wire (frames at the veth: payload plus TCP/IP/Ethernet
        headers, ACKs and rendezvous traffic included)."""
        return sum(r.tx_bytes for r in self.ranks)

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)


def _tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# ---- the cluster -------------------------------------------------------------------------------

class Cluster:
    """`world` namespaces on a bridge, every link shaped to `rate` in each direction; see the
    module docstring. Build it with `with Cluster(...) as cluster:` (or `start()` / `close()`).

    rate: bits/s (a number, or "10gbit", "100mbit", ...; None or "unlimited": no shaping).
    latency_ms: how long a full tbf queue takes to drain beyond the burst (its buffer).
    master_port: rank 0's port for MASTER_PORT.
    """

    def __init__(self, world: int = 2, rate: str | float | None = "1gbit",
                 latency_ms: float = DEFAULT_LATENCY_MS, master_port: int = MASTER_PORT) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= 254:
            raise ValueError(f"world must be an integer from 2 to 254 ranks, got {world!r}")
        if not latency_ms > 0:
            raise ValueError(f"latency_ms must be positive, got {latency_ms!r}")
        self.world = world
        self.rate_bits = parse_rate(rate)
        self.latency_ms = float(latency_ms)
        self.master_port = master_port
        self.prefix = f"{PREFIX}{os.getpid()}{_sequence_letter()}"
        self.bridge = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}s{i}" for i in range(world)]
        self.ifnames = [f"{self.prefix}n{i}" for i in range(world)]  # inside the namespaces
        self.host_ifnames = [f"{self.prefix}h{i}" for i in range(world)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(world)]
        self._built = False
        self._previous_handlers: dict[int, Any] = {}
        self._deferred: list[int] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def rate(self) -> str:
        return format_rate(self.rate_bits)

    # -- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces, bridge and shaped veths (remove_stale() first)."""
        ok, why = available()
        if not ok:
            raise ClusterError(why)
        remove_stale()
        self._built = True  # from here on close() has something to delete
        _sh("ip", "link", "add", "name", self.bridge, "type", "bridge")
        # Bridged frames must not cross the host's firewall (br_netfilter would pass them to
        # iptables' FORWARD chain, which a Docker host sets to DROP).
        _sh("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
            check=False)
        _disable_ipv6(self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for rank in range(self.world):
            self._add_rank(rank)

    def _add_rank(self, rank: int) -> None:
        ns, inner, host = self.namespaces[rank], self.ifnames[rank], self.host_ifnames[rank]
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # No IPv6: its router solicitations and DAD would add stray bytes to the counters.
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1", check=False)
        _sh("ip", "link", "add", "name", host, "type", "veth", "peer", "name", inner, "netns", ns)
        _disable_ipv6(host)
        _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[rank]}/24", "dev", inner)
        _sh("ip", "-n", ns, "link", "set", inner, "up")
        _sh("ip", "link", "set", host, "master", self.bridge)
        _sh("ip", "link", "set", host, "up")
        if self.rate_bits is not None:
            shape = ["root", "tbf", "rate", f"{self.rate_bits}bit",
                     "burst", str(burst_bytes(self.rate_bits)),
                     "latency", f"{self.latency_ms:g}ms"]
            _sh("tc", "-n", ns, "qdisc", "add", "dev", inner, *shape)  # rank -> bridge
            _sh("tc", "qdisc", "add", "dev", host, *shape)               # bridge -> rank

    def close(self) -> None:
        """Kill every rank still running and delete everything this cluster made. Idempotent;
        SIGINT/SIGTERM arriving meanwhile are held until the end, then delivered to the
        handlers that were there before the cluster."""
        self._defer_signals()
        try:
            for process in self._processes:
                _kill_group(process)
            self._processes = []
            if self._built:
                _delete(self.namespaces, [self.bridge, *self.host_ifnames])
                self._built = False
                left = leftovers(self.prefix)
                if left:
                    print(f"netcluster: could not delete {', '.join(left)}; run "
                          f"`python bench/netcluster.py --remove-stale`", file=sys.stderr)
        finally:
            self._restore_signal_handlers()

    # -- signals ----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        """SIGINT raises KeyboardInterrupt and SIGTERM `Interrupted` inside the block, so that
        the block is left through __exit__. Only the main thread can install handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, _raise_for_signal)

    def _defer_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(signum, self._record_signal)
            self._previous_handlers.setdefault(signum, previous)

    def _record_signal(self, signum: int, frame: FrameType | None) -> None:
        self._deferred.append(signum)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}
        deferred, self._deferred = self._deferred, []
        if deferred:
            signal.raise_signal(deferred[0])  # now the caller's own handler decides

    # -- counters ---------------------------------------------------------------------------

    def counter(self, rank: int, name: str = "tx_bytes") -> int:
        """A statistic of the rank's veth as the namespace sees it (tx_bytes, rx_bytes, ...)."""
        path = f"/sys/class/net/{self.ifnames[rank]}/statistics/{name}"
        return int(_sh("ip", "netns", "exec", self.namespaces[rank], "cat", path).stdout)

    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of every rank's veth."""
        return [(self.counter(r, "tx_bytes"), self.counter(r, "rx_bytes"))
                for r in range(self.world)]

    # -- running ranks ----------------------------------------------------------------------

    def rank_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables for `rank`, and GLOO_SOCKET_IFNAME = the rank's veth."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(self.master_port),
                "GLOO_SOCKET_IFNAME": self.ifnames[rank]}

    def run(self, argv: Sequence[str] | Callable[[int], Sequence[str]], timeout: float,
            env: Mapping[str, str] | None = None, check: bool = True,
            fail_grace: float = FAIL_GRACE_S) -> RunResult:
        """Run one process per rank (`argv`, or `argv(rank)`) in its namespace and wait for all.

        Each gets this process's environment, `rank_env(rank)` and `env`. When a rank fails
        the others get `fail_grace` seconds to exit, then are killed. At `timeout` seconds
        every rank still running is killed and `RunTimeout` names them. With `check`, a
        failed run raises `RankFailed` naming the first rank that failed."""
        if not self._built:
            raise ClusterError("the cluster is not built: use `with Cluster(...) as cluster:`")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        commands = [list(argv(rank)) if callable(argv) else list(argv)
                    for rank in range(self.world)]
        before = self.counters()
        self._processes = []
        logs = [tempfile.TemporaryFile() for _ in range(self.world)]
        began = time.monotonic()
        try:
            for rank in range(self.world):  # one by one: a failed spawn still kills the rest
                self._processes.append(self._spawn(rank, commands[rank], env, logs[rank]))
            hung, failed_first = self._wait(began + timeout, fail_grace)
            elapsed = time.monotonic() - began
        finally:
            for process in self._processes:
                _kill_group(process)
        after = self.counters()
        outputs = [_read_log(log) for log in logs]
        results = [RankResult(rank, p.returncode, outputs[rank],
                              after[rank][0] - before[rank][0], after[rank][1] - before[rank][1])
                   for rank, p in enumerate(self._processes)]
        self._processes = []
        if hung:
            raise RunTimeout(self._timeout_message(hung, timeout, outputs), hung, timeout)
        result = RunResult(results, elapsed, commands[0])
        if check and failed_first is not None:
            bad = results[failed_first]
            raise RankFailed(f"rank {bad.rank} (namespace {self.namespaces[bad.rank]}) "
                             f"{_describe_exit(bad.returncode)}; the other ranks were stopped. "
                             f"Its output:\n{_tail(bad.output)}",
                             bad.rank, bad.returncode, bad.output)
        return result

    def _spawn(self, rank: int, argv: list[str], env: Mapping[str, str] | None,
               log: IO[bytes]) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, **self.rank_env(rank), **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[rank], *argv],
                                env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)

    def _wait(self, deadline: float, fail_grace: float) -> tuple[list[int], int | None]:
        """Poll the ranks until all exit, one fails (then `fail_grace` more), or the deadline.
        Returns (ranks still running at the deadline, first rank that failed)."""
        failed_first: int | None = None
        give_up = deadline
        while True:
            codes = [p.poll() for p in self._processes]
            if failed_first is None:
                failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    failed_first = failed[0]
                    give_up = min(deadline, time.monotonic() + fail_grace)
            running = [r for r, code in enumerate(codes) if code is None]
            if not running:
                return [], failed_first
            now = time.monotonic()
            if now >= give_up:  # a failure is blamed on its rank, never reported as a hang
                return ([] if failed_first is not None else running), failed_first
            time.sleep(0.02)

    def _timeout_message(self, hung: list[int], timeout: float, outputs: list[str]) -> str:
        names = ", ".join(f"rank {r} ({self.namespaces[r]})" for r in hung)
        return (f"{names} still running at the {timeout:g} s timeout; every rank was killed. "
                f"Last output of rank {hung[0]}:\n{_tail(outputs[hung[0]]) or '(none)'}")


def _sequence_letter() -> str:
    """A letter per cluster of this process (a-z, then again: 26 alive at once at most)."""
    return "abcdefghijklmnopqrstuvwxy"[next(_sequence) % 25]  # 'z' is available()'s probe


def _disable_ipv6(ifname: str) -> None:
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass  # no IPv6 on this kernel: nothing to silence


def _raise_for_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


def _read_log(log: IO[bytes]) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.close()
    return text


# ---- throughput probe --------------------------------------------------------------------------

# Rank `dst` receives, rank `src` sends `nbytes`; other ranks exit at once. The receiver times
# from its first chunk to the last byte, so connection set-up does not count.
_TCP_PROBE = r"""
import os, socket, sys, time
rank = int(os.environ["RANK"])
nbytes, src, dst, port, dst_addr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
if rank == dst:
    server = socket.create_server((dst_addr, port))
    conn, _ = server.accept()
    buf = bytearray(1 << 20)
    got, first, first_size = 0, 0.0, 0
    while got < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            break
        if not got:
            first, first_size = time.perf_counter(), n
        got += n
    seconds = time.perf_counter() - first
    conn.sendall(b"k")
    print(f"RECEIVED {got} {got - first_size} {seconds:.6f}", flush=True)
elif rank == src:
    deadline = time.monotonic() + 20
    while True:
        try:
            sock = socket.create_connection((dst_addr, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    chunk = memoryview(bytes(1 << 20))
    left = nbytes
    while left:
        k = min(left, len(chunk))
        sock.sendall(chunk[:k])
        left -= k
    sock.recv(1)
"""


@dataclass
class Throughput:
    payload_bytes_per_s: float
    seconds: float
    tx_bytes: int  # the sender's veth: frames, headers included


def measure_throughput(cluster: Cluster, nbytes: int = 8 << 20, src: int = 1, dst: int = 0,
                       timeout: float = 120.0) -> Throughput:
    """Send `nbytes` over TCP from rank `src` to rank `dst`; payload bytes/s at the receiver."""
    argv = [sys.executable, "-c", _TCP_PROBE, str(nbytes), str(src), str(dst), "45123",
            cluster.addresses[dst]]
    result = cluster.run(argv, timeout=timeout)
    match = re.search(r"RECEIVED (\d+) (\d+) ([0-9.]+)", result.ranks[dst].output)
    if match is None or int(match.group(1)) != nbytes:
        raise ClusterError(f"the throughput probe did not complete: {result.ranks[dst].output!r}")
    timed, seconds = int(match.group(2)), float(match.group(3))
    return Throughput(timed / seconds, seconds, result.ranks[src].tx_bytes)


# ---- self-test ---------------------------------------------------------------------------------

def selftest(rate: str, world: int, mbytes: float) -> int:
    ok, why = available()
    if not ok:
        print(f"netcluster: unavailable: {why}", file=sys.stderr)
        return 2
    nbytes = int(mbytes * (1 << 20))
    with Cluster(world=world, rate=rate) as cluster:
        nominal = cluster.rate_bits
        print(f"{world} namespaces on bridge {cluster.bridge}, links {cluster.rate} each way "
              f"(tbf burst {burst_bytes(nominal) if nominal else 0} B, latency "
              f"{cluster.latency_ms:g} ms)")
        for src, dst in ((1, 0), (0, 1)):
            measured = measure_throughput(cluster, nbytes, src=src, dst=dst)
            line = (f"rank {src} -> rank {dst}: {nbytes / 1e6:.1f} MB in {measured.seconds:.3f} s"
                    f" = {measured.payload_bytes_per_s / 1e6:.2f} MB/s payload, "
                    f"{measured.tx_bytes / nbytes:.3f} wire bytes per payload byte")
            if nominal:
                line += f" ({measured.payload_bytes_per_s * 8 / nominal:.0%} of the nominal rate)"
            print(line, flush=True)
    left = leftovers()
    print("cleaned up" if not left else f"LEFT BEHIND: {left}")
    return 0 if not left else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selftest", action="store_true",
                        help="build a cluster and measure a TCP transfer (the default action)")
    parser.add_argument("--rate", default="100mbit", help="link rate (default 100mbit)")
    parser.add_argument("--world", type=int, default=2, help="namespaces (default 2)")
    parser.add_argument("--mbytes", type=float, default=8.0, help="MiB to send (default 8)")
    parser.add_argument("--remove-stale", action="store_true",
                        help="only delete what harnesses that no longer run left behind")
    args = parser.parse_args(argv)
    if args.remove_stale:
        removed = remove_stale()
        print(f"removed {', '.join(removed)}" if removed else "nothing stale")
        return 0
    try:
        parse_rate(args.rate)
    except ValueError as err:
        parser.error(str(err))
    return selftest(args.rate, args.world, args.mbytes)


if __name__ == "__main__":
    sys.exit(main())
