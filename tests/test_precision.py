"""fp16 with loss scaling on 2 processes against one process with torch.amp.GradScaler, and
what the Pipeline refuses: agreement across stages under an asynchronous schedule.

The reference runs the same model under `torch.autocast("cpu", float16)`, scales each
microbatch's loss with a GradScaler whose growth interval is short, so the scale grows during
the run, and starts high enough that updates overflow and are skipped: the runtime must skip
the same updates on both stages and follow the same scale.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline

STEPS, CHUNKS, BATCH = 6, 2, 8
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 20, 2  # overflows at once, then backs off and grows


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    net = copy.deepcopy(model())
    optimizer = sgd(list(net.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE,
                                  growth_interval=GROWTH_INTERVAL)
    scales = []
    for x, y in batches():
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(xs), ys)
            scaler.scale(loss / CHUNKS).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, scales


def fp16_job(rank: int, world: int) -> dict[str, Any]:
    pipe = Pipeline(model(), nn.functional.cross_entropy, sgd, schedule="1f1b", chunks=CHUNKS,
                    balance=[2, 3], precision="fp16", timeout=60)
    assert pipe._stages.scaler is not None
    pipe._stages.scaler.scale, pipe._stages.scaler.interval = INIT_SCALE, GROWTH_INTERVAL
    scales = []
    for _ in pipe.train(batches(), steps=STEPS):  # a step is yielded before its update
        scales.append(pipe._stages.scaler.scale)
    scales = scales[1:] + [pipe._stages.scaler.scale]  # the scale after each update
    out = {"state": pipe.state_dict(), "scales": scales}
    try:
        Pipeline(model(), nn.functional.cross_entropy, sgd, schedule="pipedream",
                 balance=[2, 3], clip_grad_norm=1.0, timeout=60)
        out["async"] = "accepted"
    except ValueError as err:
        out["async"] = str(err)
    pipe.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(fp16_job, 2, timeout=120)


def test_fp16_loss_scaling_equals_one_process_grad_scaler(results):
    want, want_scales = reference()
    # the run has skipped updates (backoff) and clean ones (growth): both paths are exercised
    steps = list(zip([INIT_SCALE, *want_scales], want_scales))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), want_scales
    got = results[0]["state"]
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4, msg=key)
    # the scale after each step follows GradScaler's on both stages
    assert results[0]["scales"] == want_scales == results[1]["scales"]
    untrained = model().state_dict()
    assert max((got[k] - untrained[k]).abs().max().item() for k in got) > 1e-2


def test_agreement_across_stages_is_refused_for_asynchronous_schedules(results):
    for r in results:
        assert "clip_grad_norm" in r["async"] and "synchronous" in r["async"], r["async"]
