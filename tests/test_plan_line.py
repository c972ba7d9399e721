"""Rank 0 prints the plan in one line each time the stages are set up (issue 32, item 3):
a run that planned otherwise than the last one says so at its start."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream_fast.pipeline import Pipeline


def pipeline(**options: object) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
                    nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                    schedule="1f1b", chunks=2, balance=[2, 1], ranks="threads", workers=2,
                    timeout=30, **options)


def test_rank_0_prints_the_plan_once(capsys: pytest.CaptureFixture[str]) -> None:
    pipe = pipeline()
    try:
        for _ in pipe.train([(torch.randn(8, 6), torch.randn(8, 3))] * 2, steps=2):
            pass
    finally:
        pipe.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "plan:" in line]
    assert lines == ["pipedream_fast: plan: 2 stages: 0..1 on rank 0 | 2 on rank 1; "
                     "schedule 1f1b"], lines


def test_announce_plan_false_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    pipe = pipeline(announce_plan=False)
    try:
        for _ in pipe.train([(torch.randn(8, 6), torch.randn(8, 3))] * 2, steps=2):
            pass
    finally:
        pipe.close()
    assert "plan:" not in capsys.readouterr().out
