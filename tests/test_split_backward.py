"""The split backward of zero-bubble schedules against a whole backward: the input part makes
the input gradient and no weight gradient, the weight part makes exactly the rest."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipedream_fast.runtime.stage import StageRuntime


class Twice(nn.Module):
    """Runs one Linear twice: a forward that cannot be split per call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class OffPath(nn.Module):
    """A parameter-owning call whose output does not depend on the stage input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bias_net = nn.Linear(1, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.bias_net(torch.ones(1, 1))


class AttributeReads(nn.Module):
    """Weights read as attributes, no parameter-owning submodule called: what a graph
    captured by torch.export looks like (HF GPT-2's stages). Its calls record nothing, so
    only a whole backward gives its weights their gradients (they once got none)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.inner.weight, self.inner.bias)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


MODULES = {"mlp": lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6)),
           "twice": Twice, "off-path": OffPath, "attribute-reads": AttributeReads}


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("is_first", [False, True])
def test_input_then_weight_part_equal_one_backward(name: str, is_first: bool) -> None:
    torch.manual_seed(0)
    module = MODULES[name]()
    whole = StageRuntime(1, copy.deepcopy(module), sgd, 1, is_first, False, None)
    split = StageRuntime(1, copy.deepcopy(module), sgd, 1, is_first, False, None,
                         split_backward=True)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    for stage in (whole, split):
        stage.forward(0, 0, (x.clone(),))
    whole.backward(0, [g])
    split.backward_input(0, [g])
    if not is_first:
        torch.testing.assert_close(split.take_input_grads(0), whole.take_input_grads(0))
    if name == "mlp" and not is_first:  # split for real: no weight gradient yet
        assert all(float(p.grad.abs().sum()) == 0 for p in split.params)
    split.backward_weight(0)
    for p, q in zip(split.params, whole.params):
        torch.testing.assert_close(p.grad, q.grad)
    assert not split.inflight and not whole.inflight


@pytest.mark.parametrize("name", list(MODULES))
def test_a_microbatch_frees_its_activations_without_the_garbage_collector(name: str) -> None:
    """Once its weight part has run, nothing of a microbatch is left: the hooks that keep
    each call's output gradient must not tie the output back to itself (a cycle that held
    every microbatch's activations and gradients until the cyclic collector ran: memory
    above the plan, and fresh pages faulted in at every step)."""
    import gc
    import weakref

    torch.manual_seed(0)
    split = StageRuntime(1, MODULES[name](), sgd, 1, False, False, None, split_backward=True)
    gc.collect()
    gc.disable()
    try:
        split.forward(0, 0, (torch.randn(4, 6),))
        held = [weakref.ref(t) for call in split.inflight[0].calls for t in call.outputs]
        held += [weakref.ref(t) for t in split.inflight[0].outputs]
        split.backward_input(0, [torch.randn(4, 6)])
        split.take_input_grads(0)
        split.backward_weight(0)
        assert held and all(ref() is None for ref in held), "a microbatch outlived its backward"
    finally:
        gc.enable()
