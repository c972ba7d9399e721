"""Start a pipeline job: `launch(fn, nprocs)` in Python, `pipedream-fast run --nproc N script.py`.

Each rank is a fresh process (spawned, so CUDA and threads start clean) with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun sets them. `launch` also joins the
default process group (gloo on CPU, NCCL when every rank has a GPU) before calling `fn(rank,
world_size, *args)` and returns every rank's return value. If one rank fails, the others are
stopped and the failure is raised with that rank's traceback: nothing is left hanging.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A rank of a launched job failed; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int,
               args: Sequence[Any], timeout_s: float, results: Any, threads: int | None) -> None:
    os.environ.update(rank_environment(rank, world_size, port))
    if threads:
        torch.set_num_threads(threads)
    try:
        backend = "nccl" if torch.cuda.is_available() and \
            torch.cuda.device_count() >= world_size else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message; torch's shared-memory handles would
        # die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt, then die
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None  # the traceback is in the report
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0,
           threads_per_rank: int | None = None) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` in `nprocs` processes; returns the values by rank.

    `fn` and `args` must be picklable (a module-level function). `timeout` bounds every
    collective and transfer, so a stuck rank fails the job instead of hanging it.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=False,
                         args=(rank, fn, nprocs, port, args, timeout, results, threads_per_rank))
             for rank in range(nprocs)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    while len(values) < nprocs and failure is None:
        if not results.empty():
            rank, status, value = results.get()
            if status == "ok":
                values[rank] = pickle.loads(value)
            else:
                failure = (rank, value)
            continue
        dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in values]
        if dead:
            time.sleep(0.5)  # a rank's report can trail its exit: let it arrive first
            if results.empty():
                failure = (dead[0], f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                    f"without a report (killed, or crashed in native code)")
            continue
        time.sleep(0.01)
    if failure is not None:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join()
    if failure is not None:
        rank, text = failure
        raise LaunchError(f"rank {rank} of {nprocs} failed:\n{text}")
    return [values[r] for r in range(nprocs)]


def run_script(script: str, script_args: Sequence[str], nprocs: int) -> int:
    """`pipedream-fast run`: starts `nprocs` copies of a script with torchrun's environment.
    Returns the first non-zero exit code (and stops the other ranks), else 0."""
    port = free_port()
    running = {r: subprocess.Popen([sys.executable, script, *script_args],
                                   env={**os.environ, **rank_environment(r, nprocs, port)})
               for r in range(nprocs)}
    code = 0
    while running and code == 0:
        for rank, proc in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[rank]
            if rc != 0:
                code = rc
                print(f"pipedream-fast run: rank {rank} exited with code {rc}; stopping the "
                      f"other ranks", file=sys.stderr)
        time.sleep(0.05)
    for proc in running.values():
        proc.terminate()
    for proc in running.values():
        proc.wait()
    return code
