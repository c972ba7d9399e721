"""`pipedream-fast run --nproc N script.py [args...]`: start a training script on N ranks.

Like `torchrun --standalone --nproc-per-node N`: every rank is `python script.py args...` with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, so `pipedream_fast.Pipeline`
joins the job by itself. When a rank fails, the others are stopped and its exit code returned
(128 + the signal number for a rank killed by a signal, as shells report it). SIGINT, SIGTERM
and SIGHUP are forwarded to every rank; a rank still running --grace seconds later is killed
(SIGKILL), and the command exits with 128 + the signal's number (130, 143, 129).
--max-restarts N starts a failed job again, up to N times, as torchrun does; a script built
with Pipeline(checkpoint_dir=..., resume=True) then continues from its last checkpoint. Each rank runs
in a session of its own, so a signal to this command's process group (kill -- -PGID, timeout)
reaches it once; a repeat of SIGTERM or SIGHUP within 5 s is the same request, SIGINT cuts the
grace period short.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipedream_fast.cli import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="start a training script on N local ranks",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                        help="after SIGINT/SIGTERM/SIGHUP or a failed rank, how long the ranks "
                             "have to stop before SIGKILL (default 5)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="start the job again when it fails, up to N times (a job stopped "
                             "by a signal is not restarted); a script with "
                             "Pipeline(resume=True) goes on from its last checkpoint "
                             "(default 0)")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipedream_fast.launch import GRACE_S, run_script

    if args.nproc < 1:
        raise UsageError(f"--nproc must be a positive integer, got {args.nproc}")
    if not os.path.isfile(args.script):
        raise UsageError(f"no such script: {args.script}")
    grace = GRACE_S if args.grace is None else args.grace
    if not 0 <= grace < float("inf"):
        raise UsageError(f"--grace must be a number of seconds >= 0, got {args.grace}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be an integer >= 0, got {args.max_restarts}")
    return run_script(args.script, args.script_args, args.nproc, grace=grace,
                      max_restarts=args.max_restarts)
