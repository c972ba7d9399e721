"""Leaving `Pipeline.train()` early, and a non-finite loss (2 processes, gloo).

Every rank breaks out of its loop at the same step, as an SPMD script does: the pipeline must
finish what the yielded steps owe their peers, start nothing more, and be ready for the next
`train()`. Under 1f1b the result equals uninterrupted training on the steps that were
trained. A NaN loss stops every rank at the end of its step, naming the step, without
applying that step's update; with on_nan="skip" the update is skipped and training goes on.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
from runtime_reference import train_reference

CHUNKS, BATCH, TIMEOUT = 2, 8, 20


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def batches(steps: int, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
           for _ in range(steps)]
    if nan_at is not None:
        out[nan_at][0][0, 0] = float("nan")  # one sample of one microbatch
    return out


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def pipeline(schedule: str, **kwargs: Any) -> Pipeline:
    return Pipeline(model(), nn.functional.cross_entropy, sgd, schedule=schedule,
                    chunks=CHUNKS if schedule == "1f1b" else 1, balance=[2, 3],
                    timeout=TIMEOUT, **kwargs)


def break_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule in ("1f1b", "pipedream"):
        pipe = pipeline(schedule)
        data = batches(30)
        began = time.perf_counter()
        for step, _ in enumerate(pipe.train(data, steps=30)):
            if step == 2:
                break  # three steps trained
        out[f"{schedule} break_s"] = time.perf_counter() - began
        out[f"{schedule} trained"] = pipe._progress.step
        losses = [float(x) for x in pipe.train(data[3:8], steps=5)]
        out[f"{schedule} losses"] = losses
        out[f"{schedule} state"] = pipe.state_dict()
        pipe.close()
    return out


def nan_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pipe = pipeline("1f1b")
    began = time.perf_counter()
    try:
        for _ in pipe.train(batches(8, nan_at=4), steps=8):
            pass
    except NonFiniteLoss as err:
        out["stop"] = str(err)
    out["stop_s"] = time.perf_counter() - began
    out["stop_step"] = pipe._progress.step
    out["stop_state"] = pipe.state_dict()
    pipe.close()
    pipe = pipeline("1f1b", on_nan="skip")
    out["skip_losses"] = [float(x) for x in pipe.train(batches(8, nan_at=4), steps=8)]
    out["skip_state"] = pipe.state_dict()
    pipe.close()
    return out


@pytest.fixture(scope="module")
def broken() -> list[dict[str, Any]]:
    return launch(break_job, 2, timeout=180)


def reference(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return train_reference(model(), steps, CHUNKS, nn.functional.cross_entropy, sgd)


def test_breaking_out_of_1f1b_then_training_on_equals_uninterrupted_training(broken):
    for r in broken:
        assert r["1f1b trained"] == 3
        assert r["1f1b break_s"] < TIMEOUT / 2  # nobody waited for a peer's timeout
        assert len(r["1f1b losses"]) == 5
    got, want = broken[0]["1f1b state"], reference(batches(30)[:8])
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_breaking_out_of_pipedream_leaves_the_pipeline_ready(broken):
    for r in broken:
        assert r["pipedream trained"] == 3
        assert r["pipedream break_s"] < TIMEOUT / 2
        assert len(r["pipedream losses"]) == 5 and all(x == x for x in r["pipedream losses"])
    # the losses of the second run agree across the ranks: the same microbatches trained
    assert broken[0]["pipedream losses"] == broken[1]["pipedream losses"]


@pytest.fixture(scope="module")
def nan_run() -> list[dict[str, Any]]:
    return launch(nan_job, 2, timeout=180)


def test_a_nan_loss_stops_every_rank_at_its_step_without_applying_it(nan_run):
    for r in nan_run:
        assert "step 4" in r["stop"] and "nan" in r["stop"], r["stop"]
        assert r["stop_step"] == 4 and r["stop_s"] < TIMEOUT / 2
    got, want = nan_run[0]["stop_state"], reference(batches(8)[:4])
    for key in want:  # steps 0-3 applied, step 4 not
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_on_nan_skip_skips_that_update_and_trains_on(nan_run):
    losses = nan_run[0]["skip_losses"]
    assert len(losses) == 8 and losses[4] != losses[4]  # NaN yielded for step 4
    data = batches(8)
    want = reference(data[:4] + data[5:])  # step 4's update skipped
    got = nan_run[0]["skip_state"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)
