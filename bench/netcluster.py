"""An emulated bandwidth-limited cluster on one machine (each rank in a network namespace on a
bridge, its veth shaped both ways by `tc tbf`; needs root and iproute2), and the launcher of
bench/vs_ddp.py and bench/time_to_accuracy.py. Leaving the `with` block, also by SIGINT or
SIGTERM, kills the ranks and deletes everything; what a killed harness left goes at the next
cluster, or with:

    python bench/netcluster.py --remove-stale
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

PREFIX = "pdn"
SUBNET = "10.231.0"  # rank i is SUBNET.(i + 1)/24; each bridge is its own L2 domain
MASTER_PORT = 29500  # every namespace has its own port space
MIN_BURST = 128 * 1024
LATENCY = "20ms"  # the tbf queue beyond the burst
FAIL_GRACE_S = 5.0  # after one rank fails, how long the others get to exit on their own
KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL of a rank's process group
OUTPUT_TAIL = 3000  # characters of a rank's output quoted in an error
WORLD = 2  # ranks of the benchmarks' clusters
BATCH = 32  # the benchmarks' global batch

_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_sequence = itertools.count()


class ClusterError(RuntimeError):
    """The cluster could not be built, or a run on it failed; `facts` become attributes."""

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.__dict__.update(facts)


class RankFailed(ClusterError):
    """The first rank to exit non-zero: `rank`, `returncode`, `output`; the rest were killed."""


class RunTimeout(ClusterError):
    """`ranks` were still running at the run's timeout; every rank was killed."""


class Interrupted(BaseException):
    """SIGTERM inside a `Cluster` block (a BaseException: `except Exception` lets it through)."""


def parse_rate(rate: str | float | None) -> int | None:
    """Bits per second from 1e9, "1e9", "100mbit", "2.5gbit"...; None/"none"/"unlimited": None."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("none", "unlimited")):
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        match = _RATE.match(rate) if isinstance(rate, str) else None
        if match is None or match.group(2).lower() not in _RATE_UNITS:
            raise ValueError(
                f"cannot read link rate {rate!r}: give bits per second as a number (1e9) or with "
                f"one of the units {', '.join(u for u in _RATE_UNITS if u)} (e.g. '100mbit'), "
                f"or 'unlimited'; byte units such as 'mbps' are refused as ambiguous")
        bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if not 1000 <= bits < float("inf"):
        raise ValueError(f"link rate must be at least 1000 bits/s and finite, got {rate!r}")
    return int(bits)


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
    """(True, "") when clusters can be built here (a throwaway one is), else (False, why)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False, "network namespaces need Linux and root (or CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    try:
        with Cluster(world=2, rate="1mbit"):
            return True, ""
    except (ClusterError, OSError, subprocess.SubprocessError) as err:
        return False, f"cannot build an emulated cluster here: {err}"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the rank's process group, SIGKILL it KILL_GRACE_S later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(KILL_GRACE_S)


def _pids_in(namespace: str) -> list[int]:
    done = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _names(prefix: str = PREFIX) -> tuple[list[str], ...]:
    """(namespaces, links) in the root namespace whose names start with `prefix`."""
    namespaces = [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines()]
    links = [line.split(":", 2)[1].strip().split("@")[0]
             for line in _sh("ip", "-o", "link", "show").stdout.splitlines()]
    return tuple([n for n in names if n.startswith(prefix)] for names in (namespaces, links))


def leftovers(prefix: str = PREFIX) -> list[str]:
    return [name for names in _names(prefix) for name in names]


def _delete(namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Kill what runs in the namespaces (a namespace with processes outlives `ip netns del`),
    delete them (their veths go with them), then the links left in the root namespace."""
    for pid in [pid for namespace in namespaces for pid in _pids_in(namespace)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for namespace in namespaces:
        _sh("ip", "netns", "del", namespace, check=False)
    for link in set(links) & set(_names()[1]):
        _sh("ip", "link", "del", link, check=False)


def remove_stale() -> list[str]:
    """Delete (and return) the namespaces and links named after PIDs that no longer run."""
    dead = [[n for n in names if (m := _NAME.match(n)) and not os.path.exists(f"/proc/{m[1]}")]
            for names in _names()]
    _delete(*dead)
    return dead[0] + dead[1]


@dataclass
class RankResult:  # returncode < 0: killed by that signal; output: stdout and stderr; veth bytes
    rank: int
    returncode: int
    output: str
    tx_bytes: int
    rx_bytes: int


@dataclass
class RunResult:
    ranks: list[RankResult]


class Cluster:
    """`world` namespaces on a bridge, every link shaped to `rate` (bits/s, "100mbit"...; None:
    unshaped) each way. Use as `with Cluster(...) as cluster:`."""

    def __init__(self, world: int = 2, rate: str | float | None = "1gbit") -> None:
        if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= 254:
            raise ValueError(f"world must be an integer from 2 to 254 ranks, got {world!r}")
        self.world, self.rate_bits = world, parse_rate(rate)
        self.prefix = f"{PREFIX}{os.getpid()}{'abcdefghijklmnopqrstuvwxyz'[next(_sequence) % 26]}"
        self.bridge = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}s{i}" for i in range(world)]
        self.ifnames = [f"{self.prefix}n{i}" for i in range(world)]  # inside the namespaces
        self.host_ifnames = [f"{self.prefix}h{i}" for i in range(world)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(world)]
        self._built = False
        self._previous_handlers: dict[int, Any] = {}
        self._deferred: list[int] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            # SIGINT raises KeyboardInterrupt, SIGTERM `Interrupted`: the block is left.
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[signum] = signal.signal(signum, _raise_for_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        remove_stale()
        self._built = True  # from here on close() has something to delete
        _sh("ip", "link", "add", "name", self.bridge, "type", "bridge")
        # Bridged frames must not go through iptables' FORWARD chain (DROP on a Docker host).
        _sh("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
            check=False)
        _sh("sysctl", "-qw", f"net.ipv6.conf.{self.bridge}.disable_ipv6=1", check=False)
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
            _sh("sysctl", "-qw", f"net.ipv6.conf.{host}.disable_ipv6=1", check=False)
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[rank]}/24", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "link", "set", host, "master", self.bridge)
            _sh("ip", "link", "set", host, "up")
            if self.rate_bits is not None:
                shape = ["root", "tbf", "rate", f"{self.rate_bits}bit",
                         "burst", str(burst_bytes(self.rate_bits)), "latency", LATENCY]
                _sh("tc", "-n", ns, "qdisc", "add", "dev", inner, *shape)  # rank -> bridge
                _sh("tc", "qdisc", "add", "dev", host, *shape)               # bridge -> rank

    def close(self) -> None:
        """Kill every rank still running and delete everything this cluster made. Idempotent;
        SIGINT/SIGTERM meanwhile are held, then delivered to the handlers from before."""
        if threading.current_thread() is threading.main_thread():
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
                if leftovers(self.prefix):
                    print(f"netcluster: could not delete {', '.join(leftovers(self.prefix))}; "
                          f"run `python bench/netcluster.py --remove-stale`", file=sys.stderr)
        finally:
            for number, handler in self._previous_handlers.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            self._previous_handlers = {}
            deferred, self._deferred = self._deferred, []
            if deferred:
                signal.raise_signal(deferred[0])  # now the caller's own handler decides

    def _counters(self) -> list[tuple[int, ...]]:
        """(tx_bytes, rx_bytes) of every rank's veth, as its namespace sees it."""
        return [tuple(int(_sh("ip", "netns", "exec", self.namespaces[r], "cat",
                              f"/sys/class/net/{self.ifnames[r]}/statistics/{name}").stdout)
                      for name in ("tx_bytes", "rx_bytes")) for r in range(self.world)]

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            fail_grace: float = FAIL_GRACE_S) -> RunResult:
        """Run `argv` once per rank in its namespace with this environment, torchrun's (MASTER_ADDR:
        rank 0), GLOO_SOCKET_IFNAME = the rank's veth and `env`; wait for all. One failing gives the
        rest `fail_grace` s, then kills them (`RankFailed`); `timeout` kills all (`RunTimeout`)."""
        if not self._built:
            raise ClusterError("the cluster is not built: use `with Cluster(...) as cluster:`")
        before, self._processes = self._counters(), []
        logs = [tempfile.TemporaryFile() for _ in range(self.world)]
        try:
            for rank in range(self.world):  # one by one: a failed spawn still kills the rest
                self._processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", self.namespaces[rank], *argv],
                    env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(self.world),
                         "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                         "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(MASTER_PORT),
                         "GLOO_SOCKET_IFNAME": self.ifnames[rank], **(env or {})},
                    stdin=subprocess.DEVNULL, stdout=logs[rank], stderr=subprocess.STDOUT,
                    start_new_session=True,  # and PR_SET_PDEATHSIG: it dies with the harness
                    preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)))
            hung, failed_first = self._wait(time.monotonic() + timeout, fail_grace)
        finally:
            for process in self._processes:
                _kill_group(process)
        after = self._counters()
        for log in logs:
            log.seek(0)
        results = [RankResult(rank, p.returncode, logs[rank].read().decode(errors="replace"),
                              after[rank][0] - before[rank][0], after[rank][1] - before[rank][1])
                   for rank, p in enumerate(self._processes)]
        self._processes = []
        if hung:
            names = ", ".join(f"rank {r} ({self.namespaces[r]})" for r in hung)
            raise RunTimeout(f"{names} still running at the {timeout:g} s timeout; every rank "
                             f"was killed. Last output of rank {hung[0]}:\n"
                             f"{results[hung[0]].output[-OUTPUT_TAIL:] or '(none)'}", ranks=hung)
        if failed_first is not None:
            bad = results[failed_first]
            how = (f"exited with code {bad.returncode}" if bad.returncode >= 0
                   else f"was killed by signal {-bad.returncode}")
            raise RankFailed(f"rank {bad.rank} (namespace {self.namespaces[bad.rank]}) {how}; "
                             f"the other ranks were stopped. Its output:\n"
                             f"{bad.output[-OUTPUT_TAIL:]}", rank=bad.rank,
                             returncode=bad.returncode, output=bad.output)
        return RunResult(results)

    def _wait(self, deadline: float, fail_grace: float) -> tuple[list[int], int | None]:
        """Poll until all exit, one fails (then `fail_grace` more), or the deadline: (the ranks
        still running at the deadline, the first rank that failed)."""
        failed: int | None = None
        while True:
            codes = [p.poll() for p in self._processes]
            if failed is None and any(code not in (None, 0) for code in codes):
                failed = next(r for r, code in enumerate(codes) if code not in (None, 0))
                deadline = min(deadline, time.monotonic() + fail_grace)
            running = [r for r, code in enumerate(codes) if code is None]
            if not running or time.monotonic() >= deadline:
                return ([] if failed is not None else running), failed  # a failure is no hang
            time.sleep(0.02)


def _raise_for_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


# Rank 1 sends `nbytes` to rank 0, which times from its first chunk to the last byte (so
# connection set-up does not count); other ranks exit at once.
_TCP_PROBE = r"""
import contextlib, os, socket, sys, time
nbytes, addr = int(sys.argv[1]), (sys.argv[2], 45123)
if os.environ["RANK"] == "0":
    conn = socket.create_server(addr).accept()[0]
    got, buf = 0, bytearray(1 << 20)
    while got < nbytes and (n := conn.recv_into(buf)):
        if not got:
            first, first_size = time.perf_counter(), n
        got += n
    print(f"RECEIVED {got} {got - first_size} {time.perf_counter() - first:.6f}", flush=True)
    conn.sendall(b"k")
elif os.environ["RANK"] == "1":
    while True:  # until rank 0 listens (the run's timeout bounds it)
        with contextlib.suppress(ConnectionRefusedError):
            sock = socket.create_connection(addr, timeout=30)
            break
        time.sleep(0.02)
    sock.sendall(bytes(nbytes))
    sock.recv(1)
"""


@dataclass
class Throughput:
    payload_bytes_per_s: float
    tx_bytes: int  # the sender's veth: frames, headers included


def measure_throughput(cluster: Cluster, nbytes: int = 8 << 20) -> Throughput:
    """Send `nbytes` over TCP from rank 1 to rank 0; payload bytes/s at the receiver."""
    ranks = cluster.run([sys.executable, "-c", _TCP_PROBE, str(nbytes), cluster.addresses[0]],
                        timeout=120.0).ranks
    match = re.search(r"RECEIVED (\d+) (\d+) ([0-9.]+)", ranks[0].output)
    if match is None or int(match[1]) != nbytes:
        raise ClusterError(f"the throughput probe did not complete: {ranks[0].output!r}")
    return Throughput(int(match[2]) / float(match[3]), ranks[1].tx_bytes)


# ---- the benchmarks (bench/ is on their sys.path, not on the tests') -------------------------
def snapshot() -> dict[str, float]:
    """In a rank: its clock, its veth's tx_bytes (0 outside a cluster), the machine's busy CPU
    seconds and this process's; `since(snapshot())` gives a window's deltas."""
    import harness

    tx, veth = 0, os.environ.get("GLOO_SOCKET_IFNAME")
    if veth:
        with open(f"/sys/class/net/{veth}/statistics/tx_bytes") as f:
            tx = int(f.read())
    return {"seconds": time.perf_counter(), "tx_bytes": tx, "busy_s": harness.machine_busy_s(),
            "cpu_s": time.process_time()}


def since(start: Mapping[str, float]) -> dict[str, float]:
    now = snapshot()
    return {key: now[key] - start[key] for key in now}


def trainer(model: Any, ddp: bool,
            optimizer: Callable[[Any], Any]) -> Callable[[Iterable[Any]], None]:
    """In a rank: `train(batches)`, cross-entropy steps on (x, y) batches of BATCH; with `ddp`,
    DDP over gloo on this rank's share of each batch, and a barrier at the end."""
    import torch.distributed as dist
    from torch.nn.functional import cross_entropy
    from torch.nn.parallel import DistributedDataParallel

    net, mine = model, slice(None)
    if ddp:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        net, rank = DistributedDataParallel(model), dist.get_rank()
        mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    opt = optimizer(net.parameters())

    def train(batches: Iterable[Any]) -> None:
        for x, y in batches:
            opt.zero_grad()
            cross_entropy(net(x[mine]), y[mine]).backward()
            opt.step()
        if ddp:
            dist.barrier()

    return train


def two_stage_plan(model_name: str, split: int, blocks: int, schedule: str) -> Any:
    """2 stages of one rank each, stage 1 from block `split`, at a batch of BATCH."""
    from pipedream_fast.formats import Plan, StagePlan

    return Plan(model_name, BATCH, WORLD, schedule,
                [StagePlan(0, split, 1, (0,), 0.0), StagePlan(split, blocks, 1, (1,), 0.0)],
                1.0, 1.0)


def sweep(rates: Sequence[str], each: Callable[[Cluster, str], None]) -> dict[str, float]:
    """For each rate: a cluster of WORLD ranks, its link check (payload MB/s of one TCP stream,
    rank 1 -> 0), then `each(cluster, rate)`. Returns the link checks."""
    links = {}
    for rate in rates:
        with Cluster(world=WORLD, rate=rate) as cluster:
            nbytes = 8 << 20 if (cluster.rate_bits or 0) <= 10**8 else 64 << 20
            links[rate] = measure_throughput(cluster, nbytes).payload_bytes_per_s / 1e6
            print(f"[{rate}] link check: one TCP stream carries {links[rate]:.1f} MB/s", flush=True)
            each(cluster, rate)
    return links


def run_workers(cluster: Cluster, script: str, args: Sequence[Any],
                timeout: float) -> list[dict[str, Any]]:
    """Each rank's result of `script`'s worker(*args) (see `launch`), one thread each."""
    import harness

    argv = [sys.executable, os.path.abspath(script), "--worker", json.dumps(list(args))]
    return harness.cluster_results(cluster, argv, timeout)


def header(title: str, links: Mapping[str, float], total_s: float) -> list[str]:
    """The results' title, command, machine and cluster (with the link checks) lines."""
    import harness

    return [f"# {title}", "", f"Command: `{harness.command()}`", "",
            harness.machine_line(harness.machine_info(), total_s), "",
            "- Cluster: 2 ranks, each in a network namespace, joined through a bridge by veth "
            "links shaped with `tc tbf` both ways (bench/netcluster.py); one torch thread per "
            "rank, gloo. Link check, one TCP stream's payload rate: "
            + ", ".join(f"{rate} {mbs:.1f} MB/s" for rate, mbs in links.items()) + "."]


def _rates(text: str) -> list[str]:
    """argparse type: comma-separated finite link rates."""
    rates = [r.strip() for r in text.split(",") if r.strip()]
    try:
        if not rates or None in map(parse_rate, rates):
            raise ValueError("give finite link rates (the planner needs a bandwidth)")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return rates


def launch(doc: str, worker: Callable[..., Any], rates: str,
           measure: Callable[[argparse.Namespace], tuple[str, Any]],
           options: Mapping[str, Mapping[str, Any]]) -> int:
    """A benchmark's main. As a rank (`--worker JSON`, from `run_workers`): prints `worker(*JSON)`'s
    result. Else: reads --rates (default `rates`), `options` (flag: keyword arguments) and --out;
    rc 2 where no cluster can be built; else emits `measure(args)`'s markdown and data."""
    import harness

    if sys.argv[1:2] == ["--worker"]:
        harness.print_result(worker(*json.loads(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rates", type=_rates, default=rates,
                        help=f"comma-separated link rates (default {rates})")
    for flag, kwargs in options.items():
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--out", help="write the markdown here, its data (.json) beside it")
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        print(f"{os.path.basename(sys.argv[0])}: cannot run here: {why}", file=sys.stderr)
        return 2
    harness.emit(args.out, *measure(args))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--remove-stale"]:
        sys.exit("usage: python bench/netcluster.py --remove-stale (deletes what dead harnesses "
                 "left)")
    print("removed", ", ".join(remove_stale()) or "nothing")
