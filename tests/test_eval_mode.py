"""Evaluation runs the model as `model.eval()` would, whatever reads `self.training` and
whichever capture cut it (issue 30), and the failures around capturing say what is wrong.

A model written with the common functional pattern `F.dropout(x, p, self.training)` is the
case torch.fx freezes: traced in training mode, its graph draws dropout masks forever. Each
check compares the pipeline's `predict` and `evaluate` with the same weights loaded into the
model itself in eval mode, on rank threads and on 2 processes. Public models with their real
drop rates are checked the same way in tests/test_zoo.py.
"""

from __future__ import annotations

import time
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.tracing import TracingError, trace
from pipedream_fast.tracing.blocks import _SizeExpression

BATCH, CHUNKS, TIMEOUT = 8, 2, 30.0


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(torch.tanh(self.fc(x)), 0.5, self.training)


class DropoutNet(nn.Module):
    """Four residual blocks with functional dropout, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Residual(16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TrainOnlySkip(nn.Module):
    """A skip path that exists only in training: in eval mode one tensor fewer crosses the
    cut after `a`, so the eval graph cannot be cut like the training one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        skip = x * 0.5 if self.training else None
        y = self.b(h)
        if skip is not None:
            y = y + skip
        return self.head(y)


def build(kind: str = "dropout") -> nn.Module:
    torch.manual_seed(0)
    return DropoutNet() if kind == "dropout" else TrainOnlySkip()


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def pipeline(model: nn.Module, lr: float = 0.1, **kwargs: Any) -> Pipeline:
    options: dict[str, Any] = dict(stages=2, schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT)
    options.update(kwargs)
    return Pipeline(model, F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=lr), **options)


def train_and_evaluate(pipe: Pipeline) -> dict[str, Any]:
    """Four steps, then what the tests compare: two predictions of one input, the evaluated
    loss, the weights."""
    losses = [float(loss) for loss in pipe.train(batches(4), steps=4)]
    x = batches(1, seed=7)[0][0]
    return {"losses": losses, "first": pipe.predict(x, everywhere=True),
            "second": pipe.predict(x, everywhere=True),
            "evaluate": pipe.evaluate(batches(2, seed=7))["loss"], "state": pipe.state_dict()}


def check_like_eval_mode(got: dict[str, Any], state: dict[str, torch.Tensor] | None = None
                         ) -> None:
    model = build()
    model.load_state_dict(state or got["state"], strict=True)
    model.eval()
    x = batches(1, seed=7)[0][0]
    with torch.no_grad():
        want = model(x)
        want_loss = sum(float(F.cross_entropy(model(x), y)) for x, y in batches(2, seed=7)) / 2
    assert torch.equal(got["first"], got["second"]), "two predictions of one input differ"
    torch.testing.assert_close(got["first"], want, rtol=1e-5, atol=1e-6)
    assert abs(got["evaluate"] - want_loss) <= 1e-5 * abs(want_loss), (got["evaluate"], want_loss)


def test_functional_dropout_is_off_in_evaluate_and_predict_on_rank_threads():
    pipe = pipeline(build(), ranks="threads", workers=2)
    try:
        got = train_and_evaluate(pipe)
    finally:
        pipe.close()
    check_like_eval_mode(got)


def eval_job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipe = pipeline(build())
    try:
        return train_and_evaluate(pipe)
    finally:
        pipe.close()


@pytest.mark.slow
def test_functional_dropout_is_off_in_evaluate_and_predict_on_processes():
    results = launch(eval_job, 2, timeout=120, threads_per_rank=1)
    for got in results:  # every rank gets the prediction and the loss (rank 0 the weights)
        check_like_eval_mode(got, results[0]["state"])
    assert results[0]["losses"] == results[1]["losses"]


def test_training_still_draws_dropout_masks():
    """At a learning rate of 0 the weights never change: the losses of one batch differ only
    through the masks drawn, and evaluation of it does not."""
    pipe = pipeline(build(), lr=0.0, ranks="threads", workers=2)
    try:
        batch = batches(1)[0]
        losses = [float(loss) for loss in pipe.train([batch] * 3, steps=3)]
        evaluated = [pipe.evaluate([batch])["loss"] for _ in range(2)]
    finally:
        pipe.close()
    assert len(set(losses)) == 3, losses
    assert evaluated[0] == evaluated[1]


def test_a_chain_in_eval_mode_equals_the_model_in_eval_mode():
    model = build()
    chain = trace(model)
    x = batches(1)[0][0]
    model.eval()
    for block in chain.blocks:
        block.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(chain(x), model(x), rtol=0, atol=0)


def test_a_model_without_mode_dependent_code_keeps_one_graph_per_block():
    """nn.Dropout acts on its module's mode: one graph serves both modes."""

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.drop(self.a(x)))

    chain = trace(Root())
    assert all(isinstance(b.module, torch.fx.GraphModule) for b in chain.blocks)


def test_an_eval_graph_cut_otherwise_is_refused_at_evaluation_not_run_silently():
    model = build("skip")
    chain = trace(model)
    x = batches(1)[0][0]
    torch.testing.assert_close(chain(x), model(x))  # training works as before
    for block in chain.blocks:
        block.module.eval()
    with pytest.raises(TracingError, match=r"TrainOnlySkip computes something else in eval "
                                           r"mode.*cross cut 0.*pipe.state_dict\(\)"):
        chain(x)


# --- symbolic sizes ---------------------------------------------------------------------------

def test_size_expressions_use_torchs_own_sympy_functions():
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ToFloat
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    assert _SizeExpression(FloorDiv(s0 * s1, 3), [s0, s1], int)(4, 5) == 6
    half = _SizeExpression(ToFloat(s0) / 2, [s0], float)
    assert half(5) == 2.5 and isinstance(half(5), float)  # a float size is not truncated
    assert _SizeExpression(sympy.Eq(s0, s1), [s0, s1], bool)(3, 3) is True
    with pytest.raises(TracingError, match="not a whole number"):
        _SizeExpression(ToFloat(s0) / 2, [s0], int)(5)


# --- Hugging Face mixture of experts ---------------------------------------------------------

VOCAB, SEQ = 64, 16


def moe(kind: str, experts: str | None = None) -> nn.Module:
    pytest.importorskip("transformers")
    from zoo import import_torchvision
    import_torchvision()  # before transformers imports it
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=2 * SEQ, output_router_logits=True,
                  router_aux_loss_coef=0.02)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            **common))
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def token_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x}
            for x in (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps))]


def moe_pipeline(model: nn.Module) -> Pipeline:
    return Pipeline(model, None, lambda ps: torch.optim.SGD(ps, lr=0.01), stages=2,
                    schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT, ranks="threads", workers=2)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_with_router_losses_trains_like_the_plain_loop(kind: str):
    from pipedream_fast.training import model_loss, split_microbatches
    pipe = moe_pipeline(moe(kind))
    try:
        losses = [float(loss) for loss in pipe.train(token_batches(3), steps=3)]
        state = pipe.state_dict()
    finally:
        pipe.close()
    model = moe(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    want = []
    for item in token_batches(3):
        optimizer.zero_grad()
        total = 0.0
        for part in split_microbatches(item, CHUNKS):
            out = model(**part)
            assert out.aux_loss is not None  # the router's loss is part of the loss
            loss = model_loss(out)
            (loss / CHUNKS).backward()
            total += float(loss.detach()) / CHUNKS
        optimizer.step()
        want.append(total)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) <= 1e-6, (losses, want)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)


def test_moe_experts_run_eagerly_fail_at_once_with_the_remedy_and_leave_no_thread():
    pipe = moe_pipeline(moe("mixtral", experts="eager"))
    began = time.monotonic()
    try:
        with pytest.raises(TracingError) as caught:
            list(pipe.train(token_batches(1), steps=1))
    finally:
        pipe.close()
    message = str(caught.value)
    assert "set_experts_implementation('grouped_mm')" in message, message
    assert "leaf_modules" not in message, message  # a leaf would not help here
    assert time.monotonic() - began < TIMEOUT
    assert not [t for t in threading.enumerate() if t.name.startswith("pipedream-rank")]


def test_the_launchers_one_line_keeps_the_remedy_of_a_capture_failure():
    from pipedream_fast.user_errors import describe

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent: neither capture follows it
                return torch.relu(self.fc(x))
            return self.fc(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.gate, self.b = nn.Linear(4, 4), Gate(), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.gate(self.a(x)))

    with pytest.raises(TracingError) as caught:
        trace(Net(), torch.randn(2, 4))
    line = describe(caught.value, rank=0)
    assert line is not None and line.startswith("rank 0: TracingError: cannot split Net")
    assert "leaf_modules=['gate']" in line, line
    chain = trace(Net(), torch.randn(2, 4), leaf_modules=["gate"])  # and the remedy works
    assert len(chain) == 3


class EvalOnlyBranch(nn.Module):
    """Code that only eval mode runs, and that torch.fx cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.training and h.sum() > 0:  # data-dependent, eval mode only
            h = h * 2
        return self.b(h)


def test_a_model_untraceable_only_in_eval_mode_trains_and_refuses_evaluation():
    torch.manual_seed(0)
    model = EvalOnlyBranch()
    chain = trace(model)
    x = batches(1)[0][0]
    torch.testing.assert_close(chain(x), model(x))
    for block in chain.blocks:
        block.module.eval()
    with pytest.raises(TracingError, match="EvalOnlyBranch cannot be traced in eval mode"):
        chain(x)
