"""Issue 29, "shapes that vary": every batch trains, and a step equals the plain loop's step.

A minibatch of N samples splits into `chunks` microbatches as evenly as it goes (the first
N % chunks get one more), a short last batch trains, and each microbatch's loss weighs by its
share of the step's samples (chunks * n / N), so that the step's gradient and loss are the
plain loop's on the whole batch. A batch of fewer samples than chunks (a short tail) fills its
empty microbatches with a repeated sample that counts 0; a DataLoader whose batch_size is
below chunks is refused. Everything runs on rank threads (float64, so the comparison with the
plain loop is tight), plus one run on two processes that waits for the transport to carry
varying shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.training import GLOBAL_STATE

CHUNKS, TIMEOUT, RTOL = 4, 20.0, 1e-6


def mlp() -> nn.Sequential:
    """5 blocks, float64, ~500 parameters."""
    with GLOBAL_STATE:  # seeded construction: rank threads take turns
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 3)).double()


def dataset(samples: int) -> TensorDataset:
    """Labels a fixed function of the inputs (learnable), float64 inputs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x @ w).argmax(1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


loss_fn = nn.functional.cross_entropy


def threads(schedule: str = "1f1b", **kwargs: Any) -> Pipeline:
    options: dict[str, Any] = dict(schedule=schedule, chunks=CHUNKS, balance=[3, 2],
                                   timeout=TIMEOUT, ranks="threads", workers=2)
    options.update(kwargs)
    return Pipeline(options.pop("model", None) or mlp(), options.pop("loss", loss_fn), sgd,
                    **options)


def plain_loop(batches: Any, epochs: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process loop on whole batches: each step's loss and the final weights."""
    model = mlp()
    optimizer = sgd(model.parameters())
    losses = []
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses, model.state_dict()


def assert_equal_to_plain(got_losses: list[float], got_state: dict[str, torch.Tensor] | None,
                          want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    want_losses, want_state = want
    assert got_state is not None
    assert got_losses == pytest.approx(want_losses, rel=RTOL)
    assert set(got_state) == set(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(got_state[key], value, rtol=RTOL, atol=1e-12, msg=key)


def trained(pipe: Pipeline, loader: Any, epochs: int = 1
            ) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """Each step's loss and the whole model's weights (None on a process rank but 0)."""
    try:
        return [float(x) for x in pipe.train(loader, epochs=epochs)], pipe.state_dict()
    finally:
        pipe.close()


# --- (a) a short last batch -----------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("samples", [26, 30])  # last batch 2 (< chunks: padded) and 6 (2,2,1,1)
def test_a_short_last_batch_trains_like_the_plain_loop(schedule: str, samples: int):
    loader = DataLoader(dataset(samples), batch_size=8, shuffle=False, drop_last=False)
    got = trained(threads(schedule), loader, epochs=2)
    assert len(got[0]) == 2 * 4  # every batch trained, the short one too
    assert_equal_to_plain(*got, plain_loop(loader, epochs=2))


def test_a_replicated_last_stage_weighs_its_share_of_each_step():
    """The loss is computed on two ranks, each taking two microbatches of every step: the
    counts travel with each microbatch, and the step's loss is agreed between them."""
    plan = Plan(model="m", batch_size=8, workers=3, schedule="1f1b",
                stages=[StagePlan(0, 3, 1, (0,), 1.0), StagePlan(3, 5, 2, (1, 2), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    loader = DataLoader(dataset(30), batch_size=8, shuffle=False, drop_last=False)
    got = trained(threads(plan=plan, balance=None, workers=3), loader)
    assert_equal_to_plain(*got, plain_loop(loader))


# --- (b) a batch size that chunks do not divide ---------------------------------------------

def test_a_batch_size_chunks_do_not_divide_trains_evaluates_and_predicts_like_one_process():
    loader = DataLoader(dataset(40), batch_size=10, shuffle=False)  # 3, 3, 2, 2
    want = plain_loop(loader)
    pipe = threads()
    try:
        losses = [float(x) for x in pipe.train(loader)]
        state = pipe.state_dict()
        assert state is not None
        assert_equal_to_plain(losses, state, want)
        model = mlp()
        model.load_state_dict(want[1])
        model.eval()
        x, y = dataset(40).tensors
        with torch.no_grad():
            torch.testing.assert_close(pipe.predict(x[:10]), model(x[:10]), rtol=RTOL,
                                       atol=1e-12)
            # 40 = 10 + 10 + 10 + 10 in batches of 10, and 22 = 10 + 10 + 2 (padded)
            for n in (40, 22):
                metrics = pipe.evaluate(DataLoader(TensorDataset(x[:n], y[:n]), batch_size=10))
                assert metrics["loss"] == pytest.approx(float(loss_fn(model(x[:n]), y[:n])),
                                                        rel=RTOL)
    finally:
        pipe.close()


class OwnLoss(nn.Module):
    """A model that computes its own loss (a mean over its batch): loss_fn=None."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.net(x), y)


def test_a_model_computing_its_own_loss_weighs_uneven_microbatches_alike():
    data = dataset(26)
    loader = DataLoader(data, batch_size=10, shuffle=False)  # 10 (3,3,2,2), 10, 6 (2,2,1,1)
    with GLOBAL_STATE:
        model = OwnLoss()
    pipe = threads(model=model, loss=None, balance=None, stages=2)
    try:
        losses = [float(x) for x in pipe.train(loader)]
        state = pipe.state_dict()
        assert state is not None
        want_losses, want_state = plain_loop(loader)
        assert losses == pytest.approx(want_losses, rel=RTOL)
        for key, value in want_state.items():
            torch.testing.assert_close(state[f"net.{key}"], value, rtol=RTOL, atol=1e-12)
        x, y = data.tensors  # evaluation too: the model's own loss over all 26 samples
        plain = OwnLoss()
        plain.net.load_state_dict(want_state)
        with torch.no_grad():
            want = float(plain(x, y))
        assert pipe.evaluate(loader)["loss"] == pytest.approx(want, rel=RTOL)
    finally:
        pipe.close()


# --- (c) pipedream: asynchronous, weight stashing ---------------------------------------------

def test_pipedream_trains_on_short_and_uneven_batches_and_its_loss_falls():
    """An update per microbatch on stale weights (momentum would make it unstable whatever
    the batches: plain SGD). Batches of 8 and a tail of 2 (two microbatches of padding)."""
    loader = DataLoader(dataset(26), batch_size=8, shuffle=True, drop_last=False)
    pipe = Pipeline(mlp(), loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="pipedream",
                    chunks=CHUNKS, balance=[3, 2], timeout=TIMEOUT, ranks="threads", workers=2)
    try:
        losses = [float(x) for x in pipe.train(loader, epochs=6)]
    finally:
        pipe.close()
    assert len(losses) == 6 * 4 and all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:4]) / 4, sum(losses[-8:]) / 8  # the first epoch, the last two
    assert last < 0.8 * first, losses


# --- (d) fewer samples than chunks ------------------------------------------------------------

def test_a_batch_of_fewer_samples_than_chunks_pads_with_samples_that_count_zero():
    """A short tail of 1 to 3 samples in 4 microbatches: the empty ones repeat a sample whose
    loss weighs 0, so the step is still the plain loop's (a DataLoader's tail and a one-shot
    `step` alike)."""
    x, y = dataset(11).tensors
    batches = [(x[:8], y[:8]), (x[8:11], y[8:11]), (x[10:11], y[10:11])]  # 8, 3, 1
    want = plain_loop(batches)
    pipe = threads("gpipe")
    try:
        losses = [float(pipe.step(*batch)) for batch in batches]
        state = pipe.state_dict()
        assert state is not None
        assert_equal_to_plain(losses, state, want)
    finally:
        pipe.close()


def test_a_loader_whose_batch_size_is_below_chunks_is_refused_naming_the_fix():
    """Every step would run microbatches of padding alone: a setting's mistake, not data."""
    loader = DataLoader(dataset(16), batch_size=2)
    pipe = threads()
    try:
        with pytest.raises(Exception, match=r"batch size 2 is smaller than chunks=4.*"
                                            r"use chunks=2 or less"):
            list(pipe.train(loader))
    finally:
        pipe.close()


# --- process ranks --------------------------------------------------------------------------

def process_job(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    loader = DataLoader(dataset(30), batch_size=8, shuffle=False, drop_last=False)
    pipe = Pipeline(mlp(), loss_fn, sgd, schedule="1f1b", chunks=CHUNKS, balance=[3, 2],
                    timeout=TIMEOUT)
    return trained(pipe, loader, epochs=1)


def test_a_short_last_batch_trains_like_the_plain_loop_on_two_processes():
    results = launch(process_job, 2, timeout=60)
    want = plain_loop(DataLoader(dataset(30), batch_size=8), epochs=1)
    assert results[1][0] == pytest.approx(want[0], rel=RTOL)  # the loss on every rank
    assert_equal_to_plain(*results[0], want)

