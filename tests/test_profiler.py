"""Profiler figures are the real ones: sizes of real tensors, real parameters, real state."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pipedream_fast import models
from pipedream_fast.formats import Profile
from pipedream_fast.profiler import profile_model
from pipedream_fast.tracing import trace


def run(model: nn.Module, x: torch.Tensor, **kwargs) -> Profile:
    kwargs.setdefault("warmup", 1)
    kwargs.setdefault("repeat", 3)
    return profile_model(model, x, x.shape[0], progress=False, **kwargs)


def test_activation_and_parameter_bytes_are_the_real_sizes() -> None:
    model, x = models.mlp(4)
    profile = run(model, x)
    assert [b.name for b in profile.blocks] == ["fc1", "fc2", "fc3", "fc4"]
    assert [b.activation_bytes for b in profile.blocks] == [4 * 128 * 4] * 3 + [4 * 10 * 4]
    for block, (_, child) in zip(profile.blocks, model.named_children()):
        assert block.parameter_bytes == sum(p.numel() * 4 for p in child.parameters())
    assert profile.extra["input_bytes"] == x.numel() * 4
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in profile.blocks)


def test_skip_tensors_count_in_every_cut_they_cross() -> None:
    model, x = models.skipnet(2)
    profile = run(model, x)
    chain = trace(model, x)
    for k, block in enumerate(profile.blocks):
        real = sum(torch.Size(m.shape).numel() * 4 for m in chain.cut_meta[k])
        assert block.activation_bytes == real
    res2 = [b.name for b in profile.blocks].index("res2")
    assert profile.blocks[res2].activation_bytes == 2 * 2 * 64 * 16 * 16 * 4  # output + skip


@pytest.mark.parametrize("optimizer, per_param_factor", [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_optimizer_state_is_measured(optimizer: str, per_param_factor: int) -> None:
    model, x = models.mlp(4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    profile = run(model, x, optimizer=optimizer)
    for block in profile.blocks:
        expected = per_param_factor * block.parameter_bytes
        # Adam also keeps a scalar step counter per parameter tensor (a few bytes).
        assert expected <= block.optimizer_state_bytes <= expected + 16 * per_param_factor
    # Measuring must not train the model or leave gradients behind.
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
        assert p.grad is None


def test_custom_optimizer_factory() -> None:
    model, x = models.mlp(2)
    profile = run(model, x, optimizer=lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.5))
    assert all(b.optimizer_state_bytes == b.parameter_bytes for b in profile.blocks)


@pytest.fixture
def one_thread():
    # On a busy machine, multi-threaded ops wait for their slowest thread at every barrier and
    # their times turn random; one thread keeps the comparison about the layers themselves.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_times_follow_the_layers_costs(one_thread: None) -> None:
    # Each block does 8x the multiply-adds of the one before, and even the smallest takes long
    # enough (~0.5 ms) that scheduler noise on a busy machine does not reorder the medians.
    model = nn.Sequential(OrderedDict(
        small=nn.Linear(512, 512), medium=nn.Linear(512, 4096), large=nn.Linear(4096, 4096)))
    x = torch.randn(64, 512)
    profile = run(model, x, warmup=2, repeat=7)
    forward = [b.forward_ms for b in profile.blocks]
    backward = [b.backward_ms for b in profile.blocks]
    assert forward == sorted(forward) and backward == sorted(backward)
    assert all(t > 0 for t in forward + backward)


def test_saved_bytes_exclude_weights() -> None:
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1000, 10)))
    x = torch.randn(8, 1000)
    profile = run(model, x)
    # A linear layer keeps its input for the weight gradient, never a copy of the weight.
    assert profile.blocks[0].extra["saved_bytes"] == 8 * 1000 * 4


def test_profile_round_trips_through_json(tmp_path) -> None:
    model, x = models.mlp(2)
    profile = run(model, x, model_name="mlp")
    path = tmp_path / "profile.json"
    profile.save(path)
    again = Profile.load(path)
    assert again.blocks == profile.blocks and again.model == "mlp" and again.batch_size == 2


def test_progress_bar_does_not_disturb_results(capsys) -> None:
    model, x = models.mlp(2)
    profile = profile_model(model, x, 2, warmup=0, repeat=1, progress=True)
    assert len(profile.blocks) == 4
    assert capsys.readouterr().out == ""  # progress goes to stderr


def test_bad_arguments() -> None:
    model, x = models.mlp(2)
    with pytest.raises(ValueError, match="unknown optimizer"):
        profile_model(model, x, 2, optimizer="lion", progress=False)
    with pytest.raises(ValueError, match="repeat"):
        profile_model(model, x, 2, repeat=0, progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_cuda_events_time_blocks_on_gpu() -> None:
    model, x = models.skipnet(16)
    profile = run(model, x, device="cuda")
    assert profile.device.startswith("cuda")
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in profile.blocks)
    assert next(model.parameters()).is_cuda



def test_update_costs_are_measured_and_leave_the_weights_as_they_were(one_thread: None) -> None:
    """Each block's optimizer step and weight copy (a SNAPSHOT) are timed, larger for a block
    with 256x the parameters; a factory with a real learning rate (which the profiler steps)
    still leaves every weight as it was."""
    model = nn.Sequential(OrderedDict(small=nn.Linear(64, 64), act=nn.ReLU(),
                                      large=nn.Linear(64, 64 * 256)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = run(model, torch.randn(8, 64), warmup=2, repeat=5,
                  optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9))
    small, act, large = profile.blocks
    keys = ("optimizer_ms", "grad_scale_ms", "grad_zero_ms", "snapshot_ms")
    for key in keys:
        assert act.extra[key] == 0.0, key  # no parameters
        assert 0 < small.extra[key] < large.extra[key], key
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class _TopLevelInplaceReLU(nn.Module):
    """torchvision's ResNet stem: `self.relu = nn.ReLU(inplace=True)` called at the top
    level, so once traced it is a block of its own that writes into its input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.relu = nn.ReLU(inplace=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.relu(self.bn(self.fc(x))))


@pytest.mark.parametrize("traced", [False, True])
def test_a_block_that_starts_in_place_is_profiled(traced: bool) -> None:
    """A block is fed copies of its inputs: in place on the autograd leaf itself it fails
    ("a leaf Variable that requires grad is being used in an in-place operation")."""
    if traced:
        model: nn.Module = _TopLevelInplaceReLU()
    else:
        model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 16), act=nn.ReLU(inplace=True),
                                          out=nn.Linear(16, 4)))
    names = ["fc", "bn", "relu", "out"] if traced else ["fc", "act", "out"]
    profile = run(model, torch.randn(4, 8))
    assert [b.name for b in profile.blocks] == names
    relu = profile.blocks[names.index("relu" if traced else "act")]
    assert relu.activation_bytes == 4 * 16 * 4 and relu.parameter_bytes == 0
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in profile.blocks)
    assert all(p.grad is None for p in model.parameters())


def test_an_in_place_block_does_not_rewrite_the_input_recorded_for_it() -> None:
    """The reference forward feeds each block copies, so every timed run of an in-place block
    starts from the values it really receives, not from the ones it overwrote."""
    seen: list[torch.Tensor] = []

    class InPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.detach().clone())
            return x.relu_()

    model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 16), act=InPlace()))
    x = torch.randn(4, 8)
    run(model, x, warmup=0, repeat=2)
    want = model.fc(x).detach()
    assert (want < 0).any()  # teeth: the ReLU changes it
    assert len(seen) > 2 and all(torch.allclose(s, want) for s in seen)


def test_an_error_names_the_block() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("no luck")

    model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 8), broken=Broken()))
    with pytest.raises(RuntimeError, match=r"profiling block 1 \('broken'\) failed: "
                                           r"ValueError: no luck"):
        run(model, torch.randn(2, 8))


def test_profiling_leaves_batch_norm_statistics_as_they_were() -> None:
    """Measuring runs forwards in training mode; a Pipeline that plans on rank 0 must not
    start from running statistics the user's model never had (issue 18: ResNet-18's
    bn1.running_var ended 47% off the one-process loop after a planned 2-stage run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_model(model, torch.randn(4, 3, 8, 8), batch_size=4, warmup=1, repeat=2,
                  progress=False)
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
