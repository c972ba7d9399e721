"""`Pipeline(..., ranks="threads", workers=N)`: every rank a thread of this process, driven by
the caller's one loop, against one-process references.

The per-rank code is the processes' (tests/test_dropin.py runs its scenarios on both); these
tests hold what only the driving thread does: one loop for the caller, a `break` that reaches
every rank after the same step, errors and stuck ranks that end the call instead of hanging
it, SIGTERM with a checkpoint, and `load` continuing a run exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import Stopped
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
from pipedream_fast.rank_threads import WorkerStuck
from pipedream_fast.runtime.executor import RuntimeFailure

BATCH, CHUNKS, TIMEOUT = 8, 2, 10.0


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(16, 32), act1=nn.Tanh(),
                                     fc2=nn.Linear(32, 32), act2=nn.Tanh(),
                                     head=nn.Linear(32, 5)))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


loss_fn = nn.CrossEntropyLoss()


def threads(**kwargs: Any) -> Pipeline:
    options: dict[str, Any] = dict(schedule="1f1b", chunks=CHUNKS, balance=[3, 2],
                                   timeout=TIMEOUT, ranks="threads", workers=2)
    options.update(kwargs)
    return Pipeline(options.pop("model", None) or mlp(), options.pop("loss", loss_fn), sgd,
                    **options)


def one_process(data: list[Any], clip: float | None = None) -> tuple[list[float], nn.Module]:
    """Minibatch SGD over `data`, each minibatch's gradient the mean over its microbatches."""
    model = mlp()
    optimizer = sgd(model.parameters())
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        parts = [loss_fn(model(xs), ys) for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS))]
        total = torch.stack(parts).mean()
        total.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(float(total.detach()))
    return losses, model


def assert_state(got: dict[str, torch.Tensor], model: nn.Module) -> None:
    want = model.state_dict()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_threads_train_like_one_process_with_clipping_evaluate_and_predict():
    data = batches(5)
    want, model = one_process(data, clip=0.5)
    pipe = threads(clip_grad_norm=0.5)
    try:
        got = [float(x) for x in pipe.train(data)]
        assert got == pytest.approx(want, rel=1e-5)
        assert_state(pipe.state_dict(), model)
        model.eval()
        with torch.no_grad():
            x, y = data[0]
            torch.testing.assert_close(pipe.predict(x), model(x), atol=1e-6, rtol=1e-5)
            metrics = pipe.evaluate(data[:2])
            full = torch.cat([d[0] for d in data[:2]]), torch.cat([d[1] for d in data[:2]])
            assert metrics["loss"] == pytest.approx(float(loss_fn(model(full[0]), full[1])),
                                                    rel=1e-5)
        assert sorted(pipe.stage_modules) == [0, 1] and len(pipe.optimizers) == 2
        assert sorted(pipe.last_stats) == [0, 1]
    finally:
        pipe.close()


def test_a_break_stops_every_rank_after_that_step_and_the_next_run_goes_on_exactly():
    data = batches(6)
    want, model = one_process(data)
    pipe = threads()
    try:
        got = []
        for loss in pipe.train(data):
            got.append(float(loss))
            if len(got) == 2:
                break
        got += [float(x) for x in pipe.train(data, steps=4)]  # the same loader: reads on
        assert got == pytest.approx(want, rel=1e-5)
        assert_state(pipe.state_dict(), model)
    finally:
        pipe.close()


def test_save_and_load_with_threads_continue_the_run_exactly(tmp_path: Path):
    data = batches(6)
    want, model = one_process(data)
    pipe = threads()
    got = [float(x) for x in pipe.train(data, steps=3)]
    pipe.save(tmp_path / "ckpt")
    pipe.close()
    loaded = Pipeline.load(tmp_path / "ckpt", mlp(), loss_fn, sgd, schedule="1f1b",
                           chunks=CHUNKS, timeout=TIMEOUT, ranks="threads", workers=2)
    try:
        got += [float(x) for x in loaded.train(data, steps=3)]
        assert got == pytest.approx(want, rel=1e-5)
        assert_state(loaded.state_dict(), model)
    finally:
        loaded.close()


def test_a_nan_loss_stops_the_caller_at_its_step_and_skip_goes_on():
    data = batches(4)
    data[2][0][0, 0] = float("nan")
    pipe = threads()
    try:
        seen = []
        with pytest.raises(NonFiniteLoss, match="step 3"):
            for loss in pipe.train(data):
                seen.append(loss)
        assert len(seen) == 2
    finally:
        pipe.close()
    pipe = threads(on_nan="skip")
    try:
        losses = [float(x) for x in pipe.train(data)]
        assert len(losses) == 4 and not torch.isfinite(torch.tensor(losses[2]))
        assert all(torch.isfinite(p).all() for p in pipe.state_dict().values())
    finally:
        pipe.close()


class Failing(nn.Module):
    """A loss that raises (or hangs) at one call: a bug in the user's code on the last rank."""

    def __init__(self, at: int, hang_s: float = 0.0) -> None:
        super().__init__()
        self.calls, self.at, self.hang_s = 0, at, hang_s

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            if self.hang_s:
                time.sleep(self.hang_s)
            else:
                raise ValueError("injected fault in the loss")
        return loss_fn(out, y)


def test_an_error_on_one_rank_reaches_the_caller_at_once_and_the_pipeline_runs_again():
    pipe = threads(loss=Failing(at=3), timeout=30.0)
    began = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"rank 1, action \d+ .*injected fault"):
        list(pipe.train(batches(4)))
    assert time.monotonic() - began < 10, "the other rank waited for its timeout"
    assert not [t for t in threading.enumerate() if t.name.startswith("pipedream-rank")]
    assert len(list(pipe.train(batches(2), steps=2))) == 2  # every thread is back: it runs
    assert set(pipe.evaluate(batches(1))) == {"loss"}


def test_a_rank_stuck_in_user_code_is_reported_within_the_timeout_not_waited_for():
    pipe = threads(loss=Failing(at=3, hang_s=6.0), timeout=1.0)
    began = time.monotonic()
    with pytest.raises(WorkerStuck, match=r"rank 1 is in action \d+ \(1F.*left behind"):
        list(pipe.train(batches(4)))
    assert time.monotonic() - began < 5


def test_sigterm_stops_every_rank_after_the_same_step_and_saves(tmp_path: Path):
    root = tmp_path / "run"
    pipe = threads(checkpoint_dir=root, checkpoint_every=100)
    try:
        with pytest.raises(Stopped) as stopped:
            for step, _ in enumerate(pipe.train(batches(40))):
                if step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
        step = stopped.value.step
        assert 3 <= step < 40
        folder, _ = ckpt.resolve(root)
        assert folder.name == f"step-{step}"
        manifest = ckpt.read_manifest(folder)
        assert manifest["step"] == step and sorted(manifest["files"]) == ["0", "1"]
    finally:
        pipe.close()


def test_weights_tied_across_stages_and_bf16_work_with_threads():
    torch.manual_seed(0)
    vocab, dim = 11, 8

    class Head(nn.Module):
        def __init__(self, embed: nn.Embedding) -> None:
            super().__init__()
            self.weight = embed.weight

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(h, self.weight)

    def lm() -> nn.Module:
        torch.manual_seed(0)
        embed = nn.Embedding(vocab, dim)
        return nn.Sequential(OrderedDict(embed=embed, mix=nn.Linear(dim, dim), act=nn.Tanh(),
                                         head=Head(embed)))

    def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    g = torch.Generator().manual_seed(2)
    data = [(x, (x + 1) % vocab) for x in (torch.randint(0, vocab, (BATCH, 6), generator=g)
                                           for _ in range(4))]
    reference = lm()
    optimizer = sgd(reference.parameters())
    for x, y in data:
        optimizer.zero_grad()
        torch.stack([lm_loss(reference(a), b) for a, b in zip(x.chunk(CHUNKS),
                                                              y.chunk(CHUNKS))]).mean().backward()
        optimizer.step()
    pipe = threads(model=lm(), loss=lm_loss, balance=[2, 2])
    try:
        list(pipe.train(data))
        got = pipe.state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
    finally:
        pipe.close()
    pipe = threads(precision="bf16")
    try:
        losses = [float(x) for x in pipe.train(batches(3))]
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        pipe.close()


def test_bad_front_end_arguments_are_named():
    with pytest.raises(ValueError, match="ranks must be 'processes'"):
        Pipeline(mlp(), loss_fn, sgd, ranks="gpus")
    with pytest.raises(ValueError, match="needs workers=N"):
        Pipeline(mlp(), loss_fn, sgd, ranks="threads")
    with pytest.raises(ValueError, match="workers= is the number of rank threads"):
        Pipeline(mlp(), loss_fn, sgd, workers=2)
