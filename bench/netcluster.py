"""An emulated bandwidth-limited cluster on one Linux machine: K network namespaces on a bridge.

Each rank gets a namespace joined to a bridge in the root namespace by a veth pair; both ends
of every veth are shaped by `tc tbf`, so each direction of each link is limited to the rate. A
rank's process runs in its namespace with torchrun's environment (MASTER_ADDR = rank 0) and
GLOO_SOCKET_IFNAME = its veth, so gloo's traffic crosses the shaped links and nothing else.

    with Cluster(world=2, rate="1gbit") as cluster:
        result = cluster.run([sys.executable, "train.py"], timeout=600)

Needs root, iproute2 (`ip`, `tc`), network namespaces, veth, bridge and tbf; `available()` says
why not. The tbf burst is max(1 ms at the rate, 128 KiB): enough for a 64 KiB GSO packet. Names
are `pdn<pid><letter>...`; leaving the `with` block (also by SIGINT/SIGTERM) kills the ranks and
deletes everything; after a SIGKILL, `remove_stale()` (run before every new cluster) deletes
what is named after a dead PID.

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
MASTER_PORT = 29500  # every namespace has its own port space
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
    """SIGTERM inside a `Cluster` block, raised so the block is left and cleaned up (not an
    `Exception`: `except Exception` does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def parse_rate(rate: str | float | None) -> int | None:
    """Bits per second from 1e9, "1e9", "100mbit", "2.5gbit"...; None/"none"/"unlimited": None."""
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
    """tbf burst for a rate: max(1 ms at the rate, 128 KiB)."""
    return max(rate_bits // 8 // 1000, MIN_BURST)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an iproute2 command; a failure names the command and quotes its error."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") when clusters can be built here, else (False, why): probes a veth, a bridge
    and a tbf qdisc in a throwaway namespace."""
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
    """In a rank, before exec: SIGKILL it when the harness dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _kill_group(process: subprocess.Popen[bytes], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the rank's process group, SIGKILL it `grace` seconds later if still there."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, signum)
            process.wait(wait)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever the rank started in its group
    except (ProcessLookupError, PermissionError):
        pass


def _pids_in(namespace: str) -> list[int]:
    done = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _our_names() -> tuple[list[str], list[str]]:
    """(namespaces, links) in the root namespace whose names start with PREFIX."""
    namespaces = [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines()
                  if line.startswith(PREFIX)]
    links = [line.split(":", 2)[1].strip().split("@")[0]
             for line in _sh("ip", "-o", "link", "show").stdout.splitlines()]
    return namespaces, [n for n in links if n.startswith(PREFIX)]


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
    """Kill what runs in the namespaces (a namespace with processes outlives `ip netns del`),
    delete them (their veths go with them), then the links left in the root namespace."""
    for namespace in namespaces:
        for pid in _pids_in(namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for namespace in namespaces:
        _sh("ip", "netns", "del", namespace, check=False)
    present = set(_our_names()[1])
    for link in links:
        if link in present:
            _sh("ip", "link", "del", link, check=False)


def remove_stale() -> list[str]:
    """Delete (and return) the namespaces and links named after PIDs that no longer run."""
    namespaces, links = _our_names()

    def stale(name: str) -> bool:
        match = _NAME.match(name)
        return match is not None and not _pid_alive(int(match.group(1)))

    dead = [n for n in namespaces if stale(n)], [n for n in links if stale(n)]
    _delete(*dead)
    return dead[0] + dead[1]


@dataclass
class RankResult:
    """One rank of a run: exit code (negative: killed by that signal), stdout and stderr
    together, and the bytes its veth sent and received during the run."""

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
        """Bytes all ranks put on the wire (frames at the veth, headers included)."""
        return sum(r.tx_bytes for r in self.ranks)

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)


def _tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Cluster:
    """`world` namespaces on a bridge, every link shaped to `rate` (bits/s, "100mbit"...; None:
    unshaped) each way; `latency_ms`: the tbf queue beyond the burst. Use as `with Cluster(...)`
    (or `start()` / `close()`)."""

    def __init__(self, world: int = 2, rate: str | float | None = "1gbit",
                 latency_ms: float = DEFAULT_LATENCY_MS, master_port: int = MASTER_PORT) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= 254:
            raise ValueError(f"world must be an integer from 2 to 254 ranks, got {world!r}")
        if not latency_ms > 0:
            raise ValueError(f"latency_ms must be positive, got {latency_ms!r}")
        self.world, self.rate_bits = world, parse_rate(rate)
        self.latency_ms, self.master_port = float(latency_ms), master_port
        # a letter per cluster of this process ('z' is available()'s probe)
        self.prefix = f"{PREFIX}{os.getpid()}{'abcdefghijklmnopqrstuvwxy'[next(_sequence) % 25]}"
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

    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            # SIGINT raises KeyboardInterrupt, SIGTERM `Interrupted`: the block is left.
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[signum] = signal.signal(signum, _raise_for_signal)
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
        # Bridged frames must not go through iptables' FORWARD chain (DROP on a Docker host).
        _sh("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
            check=False)
        _disable_ipv6(self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for rank in range(self.world):
            ns, inner, host = self.namespaces[rank], self.ifnames[rank], self.host_ifnames[rank]
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # No IPv6: its solicitations and DAD would add stray bytes to the counters.
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1", check=False)
            _sh("ip", "link", "add", "name", host, "type", "veth", "peer", "name", inner,
                "netns", ns)
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
        SIGINT/SIGTERM meanwhile are held, then delivered to the handlers from before."""
        main = threading.current_thread() is threading.main_thread()
        if main:
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(signum, lambda s, f: self._deferred.append(s))
                self._previous_handlers.setdefault(signum, previous)
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
            for number, handler in self._previous_handlers.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            self._previous_handlers = {}
            deferred, self._deferred = self._deferred, []
            if deferred:
                signal.raise_signal(deferred[0])  # now the caller's own handler decides

    def counter(self, rank: int, name: str = "tx_bytes") -> int:
        """A statistic of the rank's veth as the namespace sees it (tx_bytes, rx_bytes, ...)."""
        path = f"/sys/class/net/{self.ifnames[rank]}/statistics/{name}"
        return int(_sh("ip", "netns", "exec", self.namespaces[rank], "cat", path).stdout)

    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of every rank's veth."""
        return [(self.counter(r, "tx_bytes"), self.counter(r, "rx_bytes"))
                for r in range(self.world)]

    def rank_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables for `rank`, and GLOO_SOCKET_IFNAME = the rank's veth."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(self.master_port),
                "GLOO_SOCKET_IFNAME": self.ifnames[rank]}

    def run(self, argv: Sequence[str] | Callable[[int], Sequence[str]], timeout: float,
            env: Mapping[str, str] | None = None, check: bool = True,
            fail_grace: float = FAIL_GRACE_S) -> RunResult:
        """Run one process per rank (`argv`, or `argv(rank)`) in its namespace, with this
        environment, `rank_env(rank)` and `env`, and wait for all. When one fails the others
        get `fail_grace` s, then are killed; at `timeout` all are killed (`RunTimeout`). With
        `check`, a failed run raises `RankFailed` naming the first rank that failed."""
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
                self._processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", self.namespaces[rank], *commands[rank]],
                    env={**os.environ, **self.rank_env(rank), **(env or {})},
                    stdin=subprocess.DEVNULL, stdout=logs[rank], stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent))
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
            names = ", ".join(f"rank {r} ({self.namespaces[r]})" for r in hung)
            raise RunTimeout(f"{names} still running at the {timeout:g} s timeout; every rank "
                             f"was killed. Last output of rank {hung[0]}:\n"
                             f"{_tail(outputs[hung[0]]) or '(none)'}", hung, timeout)
        if check and failed_first is not None:
            bad = results[failed_first]
            raise RankFailed(f"rank {bad.rank} (namespace {self.namespaces[bad.rank]}) "
                             f"{_describe_exit(bad.returncode)}; the other ranks were stopped. "
                             f"Its output:\n{_tail(bad.output)}",
                             bad.rank, bad.returncode, bad.output)
        return RunResult(results, elapsed, commands[0])

    def _wait(self, deadline: float, fail_grace: float) -> tuple[list[int], int | None]:
        """Poll until all exit, one fails (then `fail_grace` more), or the deadline. Returns
        (ranks still running at the deadline, first rank that failed)."""
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
            if time.monotonic() >= give_up:  # a failure is blamed on its rank, not a hang
                return ([] if failed_first is not None else running), failed_first
            time.sleep(0.02)


def _disable_ipv6(ifname: str) -> None:
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass  # no IPv6 on this kernel


def _raise_for_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


def _read_log(log: IO[bytes]) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.close()
    return text


# Rank `dst` receives, rank `src` sends `nbytes`; other ranks exit at once. The receiver times
# from its first chunk to the last byte, so connection set-up does not count.
_TCP_PROBE = r"""
import os, socket, sys, time
rank = int(os.environ["RANK"])
nbytes, src, dst, port, dst_addr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
if rank == dst:
    conn, _ = socket.create_server((dst_addr, port)).accept()
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
