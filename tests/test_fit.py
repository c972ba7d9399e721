"""`fit`: the epochs of a run around a Pipeline, the same loop the CLI's ranks run."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipedream_fast import Pipeline
from pipedream_fast.fit import fit


def classifier() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 32), act=nn.ReLU(), out=nn.Linear(32, 4)))


def data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(1))


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).float().mean()


def pipeline() -> Pipeline:
    return Pipeline(classifier(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.Adam(ps, lr=0.02), schedule="1f1b", chunks=2,
                    balance=[2, 1], timeout=20, ranks="threads", workers=2)


def test_fit_trains_epochs_evaluates_each_and_reports_events():
    loader = DataLoader(data(), batch_size=16, shuffle=True, drop_last=True)
    pipe = pipeline()
    events: list[dict[str, Any]] = []
    try:
        result = fit(pipe, loader, epochs=3, on_event=events.append,
                     evaluate=lambda: pipe.evaluate(DataLoader(data(), batch_size=16),
                                                    metrics={"accuracy": accuracy}))
    finally:
        pipe.close()
    assert result.steps == 3 * len(loader) and result.samples == result.steps * 16
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds.count("eval") == 3 and kinds.count("step") == 24
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[-1]["loss"] < evals[0]["loss"] and result.results == pytest.approx(
        {"loss": evals[-1]["loss"], "accuracy": evals[-1]["accuracy"]})


def test_fit_stops_at_the_target_accuracy_and_at_steps():
    loader = DataLoader(data(), batch_size=16, shuffle=True, drop_last=True)
    pipe = pipeline()
    try:
        reached = fit(pipe, loader, epochs=20, target_accuracy=0.5,
                      evaluate=lambda: pipe.evaluate(DataLoader(data(), batch_size=16),
                                                     metrics={"accuracy": accuracy}))
        assert reached.reached_at is not None and reached.results["accuracy"] >= 0.5
        assert reached.steps < 20 * len(loader)
        assert fit(pipe, loader, steps=5).steps == 5
    finally:
        pipe.close()
