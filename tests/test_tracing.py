"""Tracing: a LayerChain run block by block is the model, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream_fast import models
from pipedream_fast.tracing import (LayerChain, TracingError, check_no_shared_parameters,
                                    shared_parameters, trace)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_chain_matches(model: nn.Module, chain: LayerChain, *inputs: torch.Tensor) -> None:
    """Outputs and every parameter gradient agree between model and chain."""
    torch.manual_seed(0)
    expected = model(*inputs)
    expected.float().square().sum().backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    got = chain(*inputs)
    got.float().square().sum().backward()
    torch.testing.assert_close(got, expected)
    have = grads_of(model)
    assert have.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(have[name], want[name], msg=name)


# ---- models with structure worth testing -----------------------------------------------------

class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x)) * x


class TwoInputs(nn.Module):
    """Two inputs, the second used only at the end; a root parameter; a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 8), nn.Tanh())  # a container: looked through
        self.gate = Gate()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.gate(self.enc(x))
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h * self.scale + bias, h


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return self.fc(x)
        return -self.fc(x)


class WithBadChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.bad = DataDependent()
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.bad(self.pre(x)))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


# ---- tests -----------------------------------------------------------------------------------

def test_sequential_maps_one_block_per_child() -> None:
    model, x = models.cnn(2)
    chain = trace(model)
    assert [b.name for b in chain.blocks] == [n for n, _ in model.named_children()]
    assert len(chain) == 9 and all(chain.cut_tensors(k) == [chain.blocks[k].name] for k in range(9))
    with torch.no_grad():
        torch.testing.assert_close(chain(x), model(x))
    mlp, y = models.mlp(3)
    check_chain_matches(mlp, trace(mlp), y)


def test_skip_connection_crosses_every_cut_it_spans() -> None:
    model, x = models.skipnet(2)
    chain = trace(model, x)
    names = [b.name for b in chain.blocks]
    assert names == ["stem", "res1", "down", "res2", "res3", "head"]
    skip = chain.cut_tensors(names.index("down"))
    assert len(skip) == 1
    # down's output is needed again after res3, so it also crosses the cut after res2.
    assert skip[0] in chain.cut_tensors(names.index("res2"))
    assert len(chain.cut_tensors(names.index("res2"))) == 2
    assert skip[0] not in chain.cut_tensors(names.index("res3"))
    assert [m.shape for m in chain.cut_meta[names.index("res2")]] == [(2, 64, 16, 16)] * 2
    check_chain_matches(model, chain, x)


def test_stage_modules_compose_to_the_model_at_every_split() -> None:
    model, x = models.skipnet(2)
    model.eval()
    chain = trace(model)
    with torch.no_grad():
        expected = model(x)
        for k in range(1, len(chain)):
            middle = chain.stage_module(0, k)(x)
            assert isinstance(middle, tuple) and len(middle) == len(chain.cut_tensors(k - 1))
            torch.testing.assert_close(chain.stage_module(k, len(chain))(*middle), expected)


def test_blocks_take_input_cut_and_return_output_cut() -> None:
    model = TwoInputs()
    x, bias = torch.randn(3, 8), torch.randn(3, 8)
    chain = trace(model, (x, bias))
    assert chain.input_names == ["x", "bias"]
    values: tuple = (x, bias)
    for k, block in enumerate(chain.blocks):
        values = block.module(*values)
        assert isinstance(values, tuple) and len(values) == len(chain.cut_tensors(k))
    # `bias` is only used at the very end: it crosses every cut up to the output.
    assert all("bias" in chain.cut_tensors(k) for k in range(len(chain) - 1))
    expected = model(x, bias)
    got = chain(x, bias)
    assert isinstance(got, tuple) and len(got) == 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_containers_are_looked_through_and_root_code_joins_the_previous_block() -> None:
    chain = trace(TwoInputs())
    assert [b.name for b in chain.blocks] == ["enc.0", "enc.1", "gate", "layers.0", "layers.1"]
    # The root parameter `scale` is read by the last block, which owns it.
    assert "scale" in dict(chain.blocks[-1].module.named_parameters())


def test_gradients_match_for_a_model_with_root_parameters() -> None:
    model = TwoInputs()
    x, bias = torch.randn(3, 8), torch.randn(3, 8)
    torch.manual_seed(1)
    out, _ = model(x, bias)
    out.sum().backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    out, _ = trace(model)(x, bias)
    out.sum().backward()
    have = grads_of(model)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name])


def test_untraceable_module_error_names_module_operation_and_fix() -> None:
    with pytest.raises(TracingError) as err:
        trace(WithBadChild())
    message = str(err.value)
    assert "'bad'" in message and "DataDependent" in message
    assert "if x.sum() > 0" in message  # the operation that failed
    assert "leaf_modules=['bad']" in message


@pytest.mark.parametrize("leaf", ["bad", DataDependent])
def test_marking_the_module_as_leaf_makes_it_traceable(leaf: object) -> None:
    model = WithBadChild()
    chain = trace(model, leaf_modules=[leaf])
    assert [b.name for b in chain.blocks] == ["pre", "bad", "post"]
    x = torch.randn(5, 4)
    check_chain_matches(model, chain, x)


def test_untraceable_root_says_leaves_cannot_help() -> None:
    with pytest.raises(TracingError, match="model's own forward.*DataDependent.*submodule"):
        trace(DataDependent())


def test_unknown_leaf_name_is_an_error() -> None:
    with pytest.raises(TracingError, match="not submodules"):
        trace(WithBadChild(), leaf_modules=["nope"])


def test_shared_parameters_across_blocks_are_listed_and_refused_where_unsupported() -> None:
    chain = trace(Tied())
    shared = shared_parameters(chain)
    # a's weight and bias, each used by both of a's calls
    assert [[chain.blocks[b].name for b in blocks] for blocks in shared.values()] == \
        [["a", "a#2"]] * 2
    with pytest.raises(TracingError, match="used by blocks 'a' and 'a#2'"):
        check_no_shared_parameters(chain)


def test_building_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model, x = models.skipnet(4)
        seq, y = models.cnn(4)
    for m, inp in ((model, x), (seq, y)):
        chain = trace(m, inp)
        assert all(p.is_meta for b in chain.blocks for p in b.module.parameters())
        out = chain.stage_module(0, len(chain))(inp)
        assert out.is_meta and out.shape == (4, 10)
        assert chain.cut_meta is not None and chain.cut_meta[-1][0].shape == (4, 10)


def test_wrong_number_of_example_inputs() -> None:
    with pytest.raises(TracingError, match="takes 2 inputs"):
        trace(TwoInputs(), torch.randn(2, 8))


def test_stage_module_range_checks() -> None:
    chain = trace(models.build_mlp())
    with pytest.raises(IndexError):
        chain.stage_module(2, 2)
    with pytest.raises(IndexError):
        chain.cut_tensors(len(chain))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.b(self.a(x)) * scale


def test_model_inputs_keep_their_defaults() -> None:
    model, x = Scaled(), torch.randn(2, 3)
    chain = trace(model)
    assert chain.input_names == ["x", "scale"] and "scale" in chain.cut_tensors(0)
    torch.testing.assert_close(chain(x), model(x))
    torch.testing.assert_close(chain(x, 3.0), model(x, 3.0))
