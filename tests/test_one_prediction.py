"""One story for every figure (issue 32, item 4): for the same plan and settings, `plan`,
`simulate` and `train --plan` report the same predicted samples/s, each as "predicted
(simulated from the profile): ...", and `train --plan --profile` neither profiles nor plans.
Was: `simulate` 153.6, `train --plan` "simulated: 98" (it re-profiled), `plan` no samples/s."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PREDICTED = re.compile(r"^predicted \(simulated from the profile\): ([\d,.]+) samples/s for "
                       r"(\S+)$", re.M)


def cli(*args: str, cwd: Path, code: int = 0) -> str:
    done = subprocess.run([sys.executable, "-m", "pipedream_fast.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_profile_of_another_microbatch_size_is_refused_in_one_line(tmp_path):
    cli("profile", "--model", "cnn", "--batch-size", "16", "--torch-threads", "1", "--out",
        "profile.json", cwd=tmp_path)
    said = cli("train", "--model", "cnn", "--profile", "profile.json", "--schedule",
               "pipedream", "--batch-size", "32", "--steps", "2", "--threads", "2",
               cwd=tmp_path, code=2)
    assert ("--profile profile.json was made at batch size 16, but this run's microbatches "
            "hold 32 samples; profile with --batch-size 32") in said, said


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_plan_simulate_and_train_predict_the_same_samples_per_s(tmp_path, schedule):
    cli("profile", "--model", "cnn", "--batch-size", "16", "--torch-threads", "1", "--out",
        "profile.json", cwd=tmp_path)
    said = {"plan": cli("plan", "--profile", "profile.json", "--topology", "2x1.25e9",
                        "--straight", "--schedule", schedule, "--out", "plan.json",
                        cwd=tmp_path),
            "simulate": cli("simulate", "--profile", "profile.json", "--plan", "plan.json",
                            cwd=tmp_path)}
    # 1f1b steps per 2 microbatches (one per worker): train's batch is 2 x 16
    batch = "16" if schedule == "pipedream" else "32"
    said["train"] = cli("train", "--model", "cnn", "--plan", "plan.json", "--profile",
                        "profile.json", "--schedule", schedule, "--batch-size", batch,
                        "--steps", "2", "--trace-steps", "0", "--threads", "2", "--out",
                        str(tmp_path / "run"), cwd=tmp_path)
    figures = {name: PREDICTED.findall(text) for name, text in said.items()}
    assert all(len(found) == 1 for found in figures.values()), said
    assert len({found[0] for found in figures.values()}) == 1, figures
    assert figures["plan"][0][1] == schedule
    lines = said["train"].splitlines()
    assert not any(line.startswith(("profiling ", "planning ")) for line in lines), lines
