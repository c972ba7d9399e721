"""bench/netcluster.py: the emulated bandwidth-limited cluster (network namespaces, tbf).

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, no netns).
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_netcluster() -> ModuleType:
    """bench/ holds scripts, not a package: load the module from its file."""
    if "netcluster" in sys.modules:
        return sys.modules["netcluster"]
    spec = importlib.util.spec_from_file_location("netcluster", BENCH / "netcluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netcluster"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


nc = _load_netcluster()
AVAILABLE, WHY = nc.available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=f"netcluster unavailable: {WHY}")


# ---- rates (no namespaces needed) --------------------------------------------------------------

@pytest.mark.parametrize("text, bits", [("100mbit", 10**8), ("1gbit", 10**9),
                                        ("2.5gbit", 25 * 10**8), ("10GBIT", 10**10),
                                        ("1e9", 10**9), (1e9, 10**9), (5000, 5000),
                                        ("unlimited", None), (None, None)])
def test_rate_forms(text: str | float | None, bits: int | None) -> None:
    assert nc.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100mbps", "fast", "1 gigabit", "", "-5mbit", "10"])
def test_bad_rate_is_named_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="rate") as err:
        nc.parse_rate(text)
    assert repr(text) in str(err.value)


def test_burst_covers_a_gso_packet_and_a_millisecond() -> None:
    assert nc.burst_bytes(10**8) == 128 * 1024
    assert nc.burst_bytes(10**10) == 1_250_000


# ---- the cluster -------------------------------------------------------------------------------

def _assert_clean(prefix: str) -> None:
    """Nothing named after `prefix` is left: `ip netns list`, `ip link`."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in namespaces and prefix not in links, (namespaces, links)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@needs_netns
def test_100mbit_link_carries_about_12_5_megabytes_per_second_and_unshaped_is_faster() -> None:
    with nc.Cluster(world=2, rate="100mbit") as cluster:
        shaped = nc.measure_throughput(cluster, 6 << 20)
    _assert_clean(cluster.prefix)
    assert shaped.payload_bytes_per_s == pytest.approx(12.5e6, rel=0.25)
    assert shaped.tx_bytes >= 6 << 20
    with nc.Cluster(world=2, rate=None) as cluster:
        unshaped = nc.measure_throughput(cluster, 64 << 20)
    assert unshaped.payload_bytes_per_s > 4 * shaped.payload_bytes_per_s


@needs_netns
def test_gloo_all_reduce_across_namespaces_and_its_bytes_on_the_wire() -> None:
    numel = 1 << 20  # 4 MiB of float32
    script = f"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.full(({numel},), float(rank + 1))
dist.all_reduce(x)
assert torch.all(x == 3.0), x[:4]
print("sum ok on", os.environ["GLOO_SOCKET_IFNAME"], flush=True)
dist.destroy_process_group()
"""
    with nc.Cluster(world=2, rate="1gbit") as cluster:
        result = cluster.run(_python(script), timeout=60, env={"OMP_NUM_THREADS": "1"})
    _assert_clean(cluster.prefix)
    for rank in result.ranks:
        assert rank.returncode == 0 and f"sum ok on {cluster.ifnames[rank.rank]}" in rank.output
        # A ring all-reduce of S bytes over 2 ranks sends S per rank (half reduced, half
        # gathered); rendezvous and headers add a little.
        assert 0.9 * 4 * numel <= rank.tx_bytes <= 2.5 * 4 * numel, rank.tx_bytes
        assert rank.rx_bytes >= 0.9 * 4 * numel


@needs_netns
def test_failed_rank_is_named_and_everything_is_deleted() -> None:
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    began = time.monotonic()
    with nc.Cluster(world=3, rate="1gbit") as cluster:
        with pytest.raises(nc.RankFailed, match="rank 1 .* exited with code 3") as err:
            cluster.run(_python(code), timeout=60, fail_grace=0.5)
    assert err.value.rank == 1 and err.value.returncode == 3
    assert time.monotonic() - began < 15  # the sleeping ranks were killed, not waited for
    _assert_clean(cluster.prefix)


@needs_netns
def test_exception_inside_the_block_still_deletes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with nc.Cluster(world=2, rate="100mbit") as cluster:
            assert len(nc.leftovers(cluster.prefix)) == 2 * 2 + 1  # 2 namespaces, 2 veths, bridge
            raise RuntimeError("boom")
    _assert_clean(cluster.prefix)


@needs_netns
def test_hung_rank_is_killed_at_the_timeout_and_named() -> None:
    code = "import os, time\nif os.environ['RANK'] == '1': time.sleep(120)"
    with nc.Cluster(world=2, rate="1gbit") as cluster:
        began = time.monotonic()
        with pytest.raises(nc.RunTimeout, match=r"rank 1 \(.*\) still running at the 2 s") as err:
            cluster.run(_python(code), timeout=2)
        assert time.monotonic() - began < 2 + nc.KILL_GRACE_S + 3
        assert err.value.ranks == [1]
        assert not nc._pids_in(cluster.namespaces[1])  # nothing left running in there
    _assert_clean(cluster.prefix)


# ---- a harness that is signalled or killed -----------------------------------------------------

HARNESS = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
import netcluster
with netcluster.Cluster(world=2, rate="1gbit") as cluster:
    cluster.run([sys.executable, "-c", "import time; time.sleep(120)"], timeout=120)
"""


def _start_harness() -> tuple[subprocess.Popen[str], str]:
    """A harness whose two ranks sleep; returns once both ranks run in their namespaces."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    prefix = f"{nc.PREFIX}{harness.pid}a"
    deadline = time.monotonic() + 20
    while not all(nc._pids_in(f"{prefix}s{r}") for r in range(2)):
        assert harness.poll() is None, harness.communicate()[0]
        assert time.monotonic() < deadline, "the harness's ranks did not start"
        time.sleep(0.05)
    return harness, prefix


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@needs_netns
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signalled_harness_kills_its_ranks_and_deletes_everything(signum: int) -> None:
    harness, prefix = _start_harness()
    ranks = [pid for r in range(2) for pid in nc._pids_in(f"{prefix}s{r}")]
    harness.send_signal(signum)
    output = harness.communicate(timeout=20)[0]
    assert harness.returncode != 0
    expected = "KeyboardInterrupt" if signum == signal.SIGINT else "Interrupted"
    assert expected in output
    assert all(_gone(pid) for pid in ranks)
    _assert_clean(prefix)


@needs_netns
def test_remove_stale_deletes_what_a_killed_harness_left() -> None:
    harness, prefix = _start_harness()
    ranks = [pid for r in range(2) for pid in nc._pids_in(f"{prefix}s{r}")]
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in ranks):  # they die with their parent (PDEATHSIG)
        assert time.monotonic() < deadline, "ranks outlived their killed harness"
        time.sleep(0.05)
    left = set(nc.leftovers(prefix))
    assert len(left) == 5  # 2 namespaces, 2 host-side veths, the bridge
    assert left <= set(nc.remove_stale())
    _assert_clean(prefix)
