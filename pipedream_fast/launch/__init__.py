"""Start a pipeline job: `launch(fn, nprocs)` in Python, `pipedream-fast run --nproc N script.py`.

Each rank is a fresh process (spawned, so CUDA and threads start clean) with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun sets them. `launch` also joins the
default process group (gloo on CPU, NCCL when every rank has a GPU) before calling `fn(rank,
world_size, *args)` and returns every rank's return value. If one rank fails, the others are
stopped and the failure is raised with that rank's traceback: nothing is left hanging.

Stopping is one path for both launchers. SIGINT, SIGTERM or SIGHUP sent to the launcher is
forwarded to every rank; a rank still running `grace` seconds later (a stuck or SIGSTOPped one)
is killed with SIGKILL. When a rank fails, the others get SIGTERM and the same grace period. No
wait on a child is unbounded: everything is polled against a deadline. On Linux the ranks also
die with SIGKILL when the launcher itself dies without a chance to stop them (SIGKILL, out of
memory).

Clusters signal a job as a whole: `kill -- -PGID` and `timeout` signal the launcher's process
group, SLURM (scancel, the time limit) every process of the job. Each rank therefore runs in a
session of its own (as torchrun's do), so a signal to the launcher's group reaches the ranks once,
forwarded; and a SIGTERM or SIGHUP within `STOP_WINDOW_S` of the first one a process got is the
same request, not a second one (`stop_request`), in the launcher and in the ranks alike. Only
a later repeat, or SIGINT, acts at once.

One module per concept, every name re-exported here:

    signals     the stop request and its signals: `Stopped`, `stop_request` and
                `STOP_WINDOW_S`, a rank's handlers (`on_stop_signal`, `raising_stop_signals`),
                a launcher's record of its signals and its stop of the ranks (forwarded
                signal, grace period, SIGKILL); signal names and exit statuses
    ranks       what both launchers share about a rank process: its environment and port,
                its own session, death with the launcher, a failure read as a peer's symptom
    processes   `launch`: spawned ranks running `fn`, their reports, `LaunchError` and the
                blame of the rank that failed first
    script      `pipedream-fast run` (`run_script`): a script's ranks, their bootstrap
                (`_RANK_BOOT`) and end (`rank_ended`, `rank_failed`, `exit_now`)
    stderr_line `write_line`: a line to the stderr the launcher and its ranks share, in one
                write, so that it never joins another process's line

A handler installed by these modules has a `__module__` under `pipedream_fast.launch`, which
is how `stopping.DeferredStop` recognises the launchers' handlers. Patch a module-level name
(`STOP_WINDOW_S`, say) in the module that defines it: the names here are copies.
"""

from __future__ import annotations

from pipedream_fast.launch import processes, ranks, script, signals, stderr_line
from pipedream_fast.launch.processes import EXIT_S, LaunchError, launch
from pipedream_fast.launch.processes import _blame as _blame
from pipedream_fast.launch.processes import _Rank as _Rank
from pipedream_fast.launch.ranks import SETTLE_S, free_port, rank_environment
from pipedream_fast.launch.script import exit_now, rank_ended, rank_failed, run_script
from pipedream_fast.launch.script import _RANK_BOOT as _RANK_BOOT
from pipedream_fast.launch.signals import (GRACE_S, STOP_SIGNALS, STOP_WINDOW_S, TERM_SIGNALS,
                                           Stopped, describe_exit, on_stop_signal,
                                           raising_stop_signals, shell_status, signal_name,
                                           stop_request)
from pipedream_fast.launch.stderr_line import write_line

__all__ = [
    "processes", "ranks", "script", "signals", "stderr_line",
    "EXIT_S", "GRACE_S", "SETTLE_S", "STOP_SIGNALS", "STOP_WINDOW_S", "TERM_SIGNALS",
    "LaunchError", "Stopped", "describe_exit", "exit_now", "free_port", "launch",
    "on_stop_signal", "raising_stop_signals", "rank_environment", "rank_ended", "rank_failed",
    "run_script", "shell_status", "signal_name", "stop_request", "write_line",
]
