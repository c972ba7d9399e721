"""examples/first_script.py, the README's own-script example, runs as the README says (on 2
processes under `pipedream-fast run`, and on 2 threads with --threads 2) and trains exactly as
a plain one-process PyTorch loop: the same losses, the same weights.

1f1b and gpipe are synchronous: every stage updates once per step with the gradients averaged
over the step's microbatches, which is minibatch SGD. The plain loop below reads the same
batches (the Pipeline shuffles under a random state seeded by (seed, epoch, batch);
`EpochBatches` reads a loader that way) and differs only in rounding.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.data_feed import EpochBatches
from pipedream_fast.datasets import digits

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "first_script.py"
STEPS, BATCH, LR, CHUNKS = 6, 32, 0.05, 4
ARGS = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR),
        "--chunks", str(CHUNKS), "--log-every", "1"]
# One intra-op thread per process: the ranks share the machine's cores.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
RTOL = 1e-6


def example() -> ModuleType:
    """The example as a module (its main() runs only as a script), for its build_model()."""
    spec = importlib.util.spec_from_file_location("first_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_loop(lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop on one process: the losses of STEPS steps and the weights after them."""
    torch.manual_seed(0)  # as the script: the seed, then the data, then the model
    train_set, _ = digits()
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True)
    model = example().build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for inputs, targets in itertools.islice(EpochBatches(loader, seed=0, first_epoch=0), STEPS):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    return plain_loop(LR)


def run(command: list[str], tmp_path: Path, schedule: str) -> tuple[str, dict[str, torch.Tensor]]:
    saved = tmp_path / "model.pt"
    result = subprocess.run([*command, *ARGS, "--schedule", schedule, "--save", str(saved)],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout, torch.load(saved, weights_only=True)


def check(out: str, weights: dict[str, torch.Tensor],
          plain: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    want_losses, want_weights = plain
    # Rank 0 alone prints: each step once, the two stages, one test line.
    steps = re.findall(r"^step (\d+) loss (\S+)$", out, re.M)
    assert [int(s) for s, _ in steps] == list(range(1, STEPS + 1)), out
    for (_, printed), loss in zip(steps, want_losses):  # printed with 6 decimals
        assert abs(float(printed) - loss) <= RTOL * abs(loss) + 5e-7, (printed, loss)
    assert re.findall(r"^stage (\d): blocks .* on rank (\d)$", out, re.M) == [("0", "0"),
                                                                            ("1", "1")], out
    assert len(re.findall(r"^test loss \S+ accuracy \S+$", out, re.M)) == 1, out
    assert weights.keys() == want_weights.keys()
    for name, weight in want_weights.items():
        error = (weights[name] - weight).norm() / weight.norm()
        assert error <= RTOL, f"{name}: relative difference {error.item():.2e}"


@pytest.mark.slow
def test_on_two_processes_it_trains_as_the_plain_loop(tmp_path, plain):
    command = [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2", str(SCRIPT)]
    check(*run(command, tmp_path, "1f1b"), plain)


def test_on_two_threads_it_trains_as_the_plain_loop(tmp_path, plain):
    out, weights = run([sys.executable, str(SCRIPT), "--threads", "2"], tmp_path, "gpipe")
    check(out, weights, plain)
    # The comparison can fail: a plain loop at a learning rate 1% off is told apart.
    with pytest.raises(AssertionError):
        check(out, weights, plain_loop(LR * 1.01))

