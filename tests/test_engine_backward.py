"""The stage's backward calls the autograd engine without torch.autograd.backward's Python
layer (runtime/engine_backward.py): the same gradients, bit for bit, and the same refusals."""

import pytest
import torch
from torch import nn

from pipedream_fast.runtime.engine_backward import backward


def twin_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    b = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    b.load_state_dict(a.state_dict())
    return a, b


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_a_scalar_loss_without_a_gradient_matches_the_public_call():
    a, b = twin_models()
    x = torch.randn(3, 6)
    torch.autograd.backward([a(x).pow(2).mean() * 3.0])
    backward([b(x).pow(2).mean() * 3.0])
    assert all(torch.equal(p, q) for p, q in zip(grads_of(a), grads_of(b)))


def test_outputs_with_their_gradients_and_a_kept_graph_match_the_public_call():
    a, b = twin_models()
    x = torch.randn(3, 6, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    g = torch.randn(3, 4)
    out_a, out_b = a(x), b(y)
    torch.autograd.backward([out_a], [g], retain_graph=True)
    backward([out_b], [g], retain_graph=True)
    torch.autograd.backward([out_a], [g])  # the graph was kept: a second pass accumulates
    backward([out_b], [g])
    assert all(torch.equal(p, q) for p, q in zip(grads_of(a), grads_of(b)))
    assert torch.equal(x.grad, y.grad)


def test_inputs_limit_the_accumulation_as_the_public_call_does():
    a, b = twin_models()
    x = torch.randn(3, 6)
    first_a, first_b = a[0].weight, b[0].weight
    torch.autograd.backward([a(x).sum()], inputs=[first_a])
    backward([b(x).sum()], inputs=[first_b])
    assert torch.equal(first_a.grad, first_b.grad)
    assert a[2].weight.grad is None and b[2].weight.grad is None


@pytest.mark.parametrize("roots, grads, words", [
    (lambda m, x: [m(x)], None, "grad can be implicitly created only for scalar outputs"),
    (lambda m, x: [x.sum()], None, "does not require grad"),
    (lambda m, x: [m(x)], [torch.zeros(3, 2)], "got [3, 2] but expected shape compatible"),
])
def test_what_the_public_call_refuses_is_refused(roots, grads, words):
    model, _ = twin_models()
    with pytest.raises(RuntimeError) as info:
        backward(roots(model, torch.randn(3, 6)), grads)
    assert words in str(info.value)
