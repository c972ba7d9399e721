"""Plans that fit a memory cap (issue 28, item 4): with `memory_per_worker` the planner
chooses which stages recompute their activations, the run stays under the cap as measured
at the tensors the ranks hold (`measure_memory`), and a cap no plan fits is refused before
training with the smallest memory that would do.

The model keeps far more activations than weights (Linear 32 -> 512 -> 32 blocks), so the
cap binds on activations. The caps are read from the planner's own refusals (bytes, which
no timing noise changes): between the smallest requirement with recomputation and without
it, every plan must recompute somewhere.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipedream_fast.pipeline import Pipeline

BATCH, CHUNKS, STEPS = 64, 4, 3


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 32))
                           for _ in range(6)], nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]


def pipeline(**options: Any) -> Pipeline:
    return Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=1e-2),
                    schedule="1f1b", chunks=CHUNKS, ranks="threads", workers=2, timeout=60,
                    **options)


def train(**options: Any) -> tuple[list[float], Any, dict[int, Any]]:
    pipe = pipeline(measure_memory=True, **options)
    try:
        losses = [float(loss) for loss in pipe.train(batches(), steps=STEPS)]
        return losses, pipe.plan, pipe.memory
    finally:
        pipe.close()


def refusal(**options: Any) -> str:
    pipe = pipeline(**options)
    try:
        with pytest.raises(Exception) as err:
            list(pipe.train(batches(), steps=1))
    finally:
        pipe.close()
    return str(err.value)


def smallest(message: str) -> int:
    found = re.search(r"smallest requirement of any plan is [^(]*\((\d+) bytes\)", message)
    assert found, message
    return int(found.group(1))


@pytest.fixture(scope="module")
def requirements() -> tuple[int, int, str]:
    """(smallest memory recomputing where needed, without recomputing, the latter's message)."""
    keeping = refusal(memory_per_worker=1, recompute="none")
    return smallest(refusal(memory_per_worker=1)), smallest(keeping), keeping


def test_a_cap_no_plan_fits_is_refused_naming_the_memory_that_would_do(requirements):
    recomputing, keeping, message = requirements
    assert recomputing < keeping  # recomputation is what lowers it
    assert "the fullest worker holds stage" in message and "activations" in message
    assert "--recompute auto" in message  # the way out this run had switched off


def test_under_the_cap_the_plan_recomputes_and_every_rank_stays_under_it(requirements):
    recomputing, keeping, _ = requirements
    cap = (recomputing + keeping) // 2
    losses, plan, memory = train(memory_per_worker=cap)
    assert any(s.extra["recompute"] for s in plan.stages)  # no plan keeps everything here
    for rank, measured in memory.items():
        assert measured["rank"]["total_peak"] <= cap, (rank, measured, cap)
    for stage in plan.stages:
        assert stage.extra["memory_bytes"] <= cap
    # The recomputation changes nothing but memory and time: 1F1B is minibatch SGD.
    plain, _, _ = train()
    assert losses == pytest.approx(plain, rel=1e-6)


def test_without_a_cap_nothing_recomputes_and_all_recomputes_everything():
    _, plan, _ = train()
    assert not any(s.extra["recompute"] for s in plan.stages)
    _, plan, memory_all = train(recompute="all")
    assert all(s.extra["recompute"] for s in plan.stages)


def test_a_cap_with_a_cut_by_hand_is_refused():
    from pipedream_fast.options import OptionError
    with pytest.raises(OptionError, match="memory_per_worker is a limit the planner plans "
                                          "within, but balance= cuts the model by hand"):
        pipeline(memory_per_worker=10**6, balance=[3, 4])
    with pytest.raises(OptionError, match="memory_per_worker must be a positive number"):
        pipeline(memory_per_worker=0)
    with pytest.raises(OptionError, match="would move blocks without keeping memory_per_worker"):
        pipeline(memory_per_worker=10**6, adapt=True)
