"""Activation recomputation (`recompute=`, issue 28 item 3): a run with it equals the same run
without it, for synchronous schedules, for the split backward of zb-h1 and for PipeDream's
weight stashing; the checks fail when the replayed random state or the stashed version is
dropped; and a recomputed stage keeps fewer activations.

Dropout on rank threads draws from the one generator all threads share, in whatever order
the threads run: runs with dropout are compared on processes (each rank its own generator),
runs on threads with batch norm (whose running statistics the re-run must not count twice).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.options import OptionError
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.tracing import trace

BATCH, STEPS, TIMEOUT = 8, 4, 60.0
# A fixed cut: a plan made from measured times may cut two runs differently, and PipeDream's
# results depend on where the stages are cut.
BALANCE = [2, 3]


class Block(nn.Module):
    def __init__(self, width: int, norm: bool, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc(x)))
        return x + F.dropout(self.drop(h), self.p, self.training)


class Net(nn.Module):
    """Four residual blocks (dropout: module and functional; batch norm if `norm`), a head."""

    def __init__(self, norm: bool = False, p: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(16, norm, p) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(norm: bool = False, dropout: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return Net(norm=norm, p=0.3 if dropout else 0.0)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def run(schedule: str, recompute: str, *, ranks: str = "processes", norm: bool = False,
        dropout: bool = True) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    chunks = 1 if schedule == "pipedream" else 2
    extra: dict[str, Any] = {"ranks": "threads", "workers": 2} if ranks == "threads" else {}
    torch.manual_seed(123)  # the dropout masks: the same generator state for every run
    pipe = Pipeline(build(norm, dropout), F.cross_entropy,
                    lambda ps: torch.optim.Adam(ps, lr=1e-2), balance=BALANCE, schedule=schedule,
                    chunks=chunks, timeout=TIMEOUT, recompute=recompute, **extra)
    try:
        losses = [float(loss) for loss in pipe.train(batches(), steps=STEPS)]
        return losses, pipe.state_dict()
    finally:
        pipe.close()


def assert_same(got: tuple[list[float], Any], want: tuple[list[float], Any]) -> None:
    losses, state = got
    want_losses, want_state = want
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= 1e-6, \
        (losses, want_losses)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=key)


def differs(got: tuple[list[float], Any], want: tuple[list[float], Any]) -> bool:
    try:
        assert_same(got, want)
    except AssertionError:
        return True
    return False


# --- rank threads: no dropout (one shared generator), batch norm ------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "pipedream"])
def test_recomputing_every_block_equals_keeping_them_on_rank_threads(schedule: str):
    want = run(schedule, "none", ranks="threads", norm=True, dropout=False)
    assert_same(run(schedule, "all", ranks="threads", norm=True, dropout=False), want)


def test_recomputing_chosen_stages_or_blocks_equals_keeping_them():
    want = run("1f1b", "none", ranks="threads", norm=True, dropout=False)
    assert_same(run("1f1b", "stages:0", ranks="threads", norm=True, dropout=False), want)
    assert_same(run("1f1b", "blocks:layers.1,head", ranks="threads", norm=True,
                    dropout=False), want)


# --- processes: dropout on ---------------------------------------------------------------------

CASES = [("1f1b", "none"), ("1f1b", "all"), ("zb-h1", "none"), ("zb-h1", "all"),
         ("pipedream", "none"), ("pipedream", "all")]


def recompute_job(rank: int, world: int) -> dict[tuple[str, str], Any]:
    torch.set_num_threads(1)
    return {case: run(*case) for case in CASES}


@pytest.fixture(scope="module")
def on_processes() -> dict[tuple[str, str], Any]:
    return launch(recompute_job, 2, timeout=300, threads_per_rank=1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "pipedream"])
def test_recomputation_with_dropout_equals_keeping_the_activations_on_processes(
        on_processes: Any, schedule: str):
    assert_same(on_processes[(schedule, "all")], on_processes[(schedule, "none")])


# --- the checks can fail -----------------------------------------------------------------------

def test_a_rerun_without_the_replayed_random_state_is_caught(monkeypatch):
    """Dropout's mask must be the forward's: a re-run drawing a new one changes the
    gradients. One stage on one thread (no other thread draws), so only the replay differs."""
    import pipedream_fast.recompute as recompute_module
    want = one_stage("none")
    assert_same(one_stage("all"), want)
    original = recompute_module.checkpoint
    monkeypatch.setattr(recompute_module, "checkpoint", lambda *a, **k: original(
        *a, **{**k, "preserve_rng_state": False}))
    assert differs(one_stage("all"), want)


def test_a_rerun_on_the_live_weights_instead_of_the_stashed_version_is_caught(monkeypatch):
    """PipeDream reads a retained version in forwards whose backward comes after an update:
    a re-run on the live weights computes other activations."""
    import pipedream_fast.tracing.chain as chain_module
    from torch.utils.checkpoint import checkpoint
    want = run("pipedream", "none", ranks="threads", dropout=False)

    def on_live_weights(block: nn.Module, values: tuple[Any, ...]) -> Any:
        return checkpoint(lambda *v: block(*v), *values, use_reentrant=False)

    monkeypatch.setattr(chain_module, "recomputed", on_live_weights)
    assert differs(run("pipedream", "all", ranks="threads", dropout=False), want)


def one_stage(recompute: str) -> tuple[list[float], Any]:
    torch.manual_seed(123)
    pipe = Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                    stages=1, schedule="1f1b", chunks=2, timeout=TIMEOUT, recompute=recompute,
                    ranks="threads", workers=1)
    try:
        losses = [float(loss) for loss in pipe.train(batches(), steps=STEPS)]
        return losses, pipe.state_dict()
    finally:
        pipe.close()


# --- memory: what autograd keeps -----------------------------------------------------------------

def saved_activation_bytes(recompute: tuple[int, ...]) -> int:
    """The bytes of activations autograd keeps for the backward of the whole model as one
    stage, counted at the tensors it saves (parameters left out). Inside a recomputed block
    torch.utils.checkpoint's own hooks take the saved tensors: it keeps the block's inputs."""
    chain = trace(build(dropout=False))
    stage = chain.stage_module(0, len(chain), recompute=recompute).train()
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = stage(torch.randn(256, 16)).sum()
    loss.backward()
    return sum(seen.values())


def test_recomputed_blocks_keep_only_their_inputs():
    one = 256 * 16 * 4  # a float activation of the 256-sample batch
    assert saved_activation_bytes((0, 1, 2, 3)) == 5 * one  # 4 blocks' inputs, the head's
    # kept: each block's input (for its Linear) and its tanh's output, and the head's input
    assert saved_activation_bytes(()) == (4 * 2 + 1) * one


# --- bad input ------------------------------------------------------------------------------------

def test_bad_recompute_values_are_refused_naming_the_forms():
    with pytest.raises(OptionError, match=r"recompute must be auto, none, all, stages:I,J"):
        Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1),
                 recompute="some", ranks="threads", workers=2, stages=2)


@pytest.mark.parametrize("spec, message", [
    ("blocks:layers.9", r"recompute names blocks \['layers.9'\] the model does not have; its "
                        r"blocks are layers.0, layers.1"),
    ("stages:5", r"recompute names stages \[5\], but the plan has stages 0..1")])
def test_recompute_naming_what_is_not_there_is_refused(spec: str, message: str):
    with pytest.raises(ValueError, match=message):
        Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1),
                 recompute=spec, ranks="threads", workers=2, balance=BALANCE, timeout=TIMEOUT)
