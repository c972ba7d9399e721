"""Every rank starts from rank 0's initial weights (issue 32, item 2).

Ranks of a script each build the model; one that seeds differently (or not at all) built
other initial weights. Before, each rank kept its own stages' weights as it built them: a
model no single process ever held, silently. Now, as DistributedDataParallel does, the
Pipeline compares cheap fingerprints of every tensor and broadcasts rank 0's values where a
rank differs, and rank 0 says so once, naming the first tensor."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline

STEPS, CHUNKS = 3, 2


def built(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3), nn.BatchNorm1d(3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))
            for _ in range(STEPS)]


def job(rank: int, world: int, seed_by_rank: bool) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = Pipeline(built(rank if seed_by_rank else 0), nn.functional.mse_loss,
                        lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="1f1b",
                        chunks=CHUNKS, balance=[2, 2], timeout=60)
    try:
        losses = [float(x) for x in pipe.train(batches(), steps=STEPS)]
        return {"losses": losses, "state": pipe.state_dict(),
                "warnings": [str(w.message) for w in caught]}
    finally:
        pipe.close()


def plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = built(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            loss = nn.functional.mse_loss(model(xs), ys) / CHUNKS
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def test_ranks_seeded_apart_start_from_rank_0s_weights_and_train_as_the_plain_loop():
    reports = launch(job, 2, True, timeout=120)
    losses, state = plain()
    for report in reports:
        assert report["losses"] == pytest.approx(losses, rel=1e-6)
    for key, value in state.items():  # the whole state, gathered on rank 0
        assert torch.allclose(reports[0]["state"][key].float(), value.float(), rtol=1e-6,
                              atol=1e-7), key
    said = reports[0]["warnings"]
    assert any("rank 1 built the model with other initial values than rank 0 in " in w
               and "(the first: '0.weight')" in w for w in said), said
    assert not any("initial values" in w for w in reports[1]["warnings"])


def test_ranks_seeded_alike_hear_nothing():
    reports = launch(job, 2, False, timeout=120)
    assert not any("initial values" in w for r in reports for w in r["warnings"])
    assert reports[0]["losses"] == reports[1]["losses"]
