"""A job on one machine opens nothing to the network (issue 35, item 9): the launchers serve
the rendezvous store themselves, bound to 127.0.0.1, and every rank joins it as a client, so
no process of the job listens on any interface but loopback. Read from /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from pipedream_fast.launch import launch

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")


def listening(pids: list[int]) -> list[str]:
    """The addresses the processes `pids` listen on (TCP, IPv4 and IPv6), as 'addr:port'."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # each 32-bit word host-order
    packed = b"".join(words)
    if len(packed) == 4:
        return ".".join(str(b) for b in packed)
    if packed[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in packed[12:])
    return "[" + packed.hex() + "]"


def job(rank: int, world: int) -> list[str]:
    dist.barrier()  # every rank has joined: its sockets are open
    found = listening([os.getppid(), os.getpid()]) if rank == 0 else []
    dist.barrier()
    return found


def test_launch_listens_on_loopback_only():
    found = launch(job, 2, timeout=60)[0]
    assert found, "expected at least the store's socket"
    assert all(a.startswith("127.0.0.1:") for a in found), found


SCRIPT = """
import os, sys, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_loopback_store import listening
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("LISTENING", *listening([os.getppid(), os.getpid()]))
dist.barrier()
"""


def test_run_listens_on_loopback_only(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    result = subprocess.run([sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2",
                             str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("LISTENING"))
    found = line.split()[1:]
    assert found and all(a.startswith("127.0.0.1:") for a in found), found


def test_each_rank_gets_its_share_of_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    """`run` (as torchrun) keeps ranks from starting a thread per core each: 2 ranks on 2
    cores ran the first script 2.5-3.5x slower. A user's own setting wins."""
    from pipedream_fast.launch import rank_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert rank_environment(0, 2, 1234)["OMP_NUM_THREADS"] == "4"
    assert rank_environment(0, 16, 1234)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in rank_environment(0, 1, 1234)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in rank_environment(0, 2, 1234)  # the inherited 3 stays


def test_launch_starts_fn_only_once_every_rank_is_through_its_init(monkeypatch):
    # gloo returns from the init on each rank once its own side of the mesh is up. A fn that
    # destroyed the group at once (to make its own) cut rank 0 still connecting: "Gloo
    # connectFullMesh failed ... Connection closed by peer" in its init. Rank 0 here returns
    # a second late; rank 1's fn must not start before that.
    import slow_rank_init

    monkeypatch.setenv("SLOW_RANK_INIT", "1")
    (init_0, _), (_, began_1) = launch(slow_rank_init.job, 2, timeout=60)
    assert began_1 >= init_0, f"rank 1 began {init_0 - began_1:.2f} s before rank 0's init ended"
