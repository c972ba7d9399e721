"""A stop whose agreed step and checkpoint take longer than the launcher's grace period.

Two 1 GiB stages, 1f1b under `pipedream-fast run --nproc 2` with a `checkpoint_dir`; SIGTERM to
the launcher (5 s grace) after step `--after`: seconds to the agreed step's end, the save and
the exit, and whether the checkpoint is complete. Needs about 6 GiB of memory and 2 GiB of disk.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipedream_fast import checkpoint as ckpt

from harness import write_results  # noqa: E402 - a sibling

JOB = """\
import itertools, sys, time, torch
from torch import nn
from pipedream_fast import Pipeline
from pipedream_fast.launch import Stopped
N = int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(N, N, bias=False), nn.Linear(N, N, bias=False))
pipe = Pipeline(model, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=1e-6),
                schedule="1f1b", chunks=2, balance=[1, 1], timeout=300,
                checkpoint_dir=sys.argv[1], checkpoint_every=10**6)
data = ((torch.randn(4, N), torch.randn(4, N)) for _ in itertools.count())
try:
    for step, _ in enumerate(pipe.train(data, steps=10**6)):
        print(f"step {step} {time.monotonic():.3f}", flush=True)
except Stopped:
    print(f"saved {time.monotonic():.3f}", flush=True)
    raise
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=int, default=2, help="SIGTERM after this step")
    parser.add_argument("--size", type=int, default=16384, help="each stage's Linear(N, N)")
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        job, folder = Path(tmp) / "job.py", Path(tmp) / "ck"
        job.write_text(JOB)
        launcher = subprocess.Popen([sys.executable, "-m", "pipedream_fast.cli", "run",
                                     "--nproc", "2", str(job), str(folder), str(args.size)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert launcher.stdout is not None
        steps = []
        for line in launcher.stdout:
            if line.startswith("step"):
                steps.append(float(line.split()[2]))
            if len(steps) > args.after:
                break
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        rest, stderr = launcher.communicate(timeout=900)
        ended = time.monotonic() - sent
        lines = rest.splitlines()
        last_step = max([float(x.split()[2]) for x in lines if x.startswith("step")],
                        default=steps[-1])
        saved = [float(x.split()[1]) for x in lines if x.startswith("saved")]
        try:
            where, _ = ckpt.resolve(folder)
            ckpt.export(where)  # reads every file against its checksum
            complete = f"yes ({where.name}, {ckpt.read_manifest(where)['step']} steps)"
        except ckpt.CheckpointError as err:
            complete = f"no: {err}"
    said = [x.removeprefix("pipedream-fast run: ") for x in stderr.splitlines()
            if x.startswith("pipedream-fast run:")]
    rows = [("seconds a step takes", f"{(steps[-1] - steps[0]) / max(1, len(steps) - 1):.1f}"),
            ("SIGTERM to the agreed step's end", f"{last_step - sent:.1f}"),
            ("SIGTERM to the checkpoint saved", f"{max(saved) - sent:.1f}" if saved else "-"),
            ("SIGTERM to the launcher's exit", f"{ended:.1f}"),
            ("launcher's exit status", str(launcher.returncode)), ("checkpoint complete", complete)]
    print("\n".join([*(f"{name:34s} {value}" for name, value in rows),
                     *(f"launcher: {line}" for line in said)]))
    if args.out:
        write_results(args.out, "A stop that outlasts the grace period (1 GiB stages)",
                      [f"Two Linear({args.size}, {args.size}) stages (1 GiB each), 1f1b, "
                       f"`pipedream-fast run --nproc 2` with its default 5 s grace; SIGTERM "
                       f"after step {args.after}."],
                      ["", "measured"], rows, ["What the launcher said:", "",
                                               *[f"    {x}" for x in said]])
    return 0 if launcher.returncode == 143 and complete.startswith("yes") else 1


if __name__ == "__main__":
    sys.exit(main())
