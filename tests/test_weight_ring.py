"""Tests of `pipedream_fast._C.WeightRing`, the weight-stashing store of a pipeline stage.

PipeDream's asynchronous schedule runs a microbatch's backward on the weights its forward
used, although the optimizer has updated the live weights in between. The ring must make
that exact: a forward through `torch.func.functional_call` on a stashed version, then an
in-place optimizer step on the live parameters, then the backward, must give the same
gradients as a copy of the model that never changed (and must not trip autograd's in-place
check). The other tests pin what makes the ring safe to build a runtime on: the parameters
stay the same Python objects (so the optimizer keeps working), snapshots are real copies,
and misuse raises a clear error.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipedream_fast import _C

skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _C.cuda_enabled,
                                       reason="needs a GPU and a CUDA build of pipedream_fast")

IN_PLACE_ERROR = "modified by an inplace operation"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3),
                         nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def batch(model_name: str, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (5, 6) if model_name == "mlp" else (5, 2, 6, 6)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=g)
    return x.to(device), y.to(device)


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}


class Stage:
    """A model wrapped by a ring, as a pipeline stage's runtime would hold it."""

    def __init__(self, model_name: str, slots: int, device: str = "cpu",
                 offload: bool = False) -> None:
        torch.manual_seed(0)
        self.model = MODELS[model_name]().double().to(device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.ring = _C.WeightRing(list(self.model.parameters()), slots, offload)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5, momentum=0.9)

    def forward(self, version: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weights = dict(zip(self.names, self.ring.tensors(version)))
        return nn.functional.cross_entropy(functional_call(self.model, weights, (x,)), y)

    def update_live(self, seed: int) -> None:
        """An optimizer step with made-up, nonzero gradients: changes every live weight."""
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
        self.opt.step()


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    loss = nn.functional.cross_entropy(model(x), y)
    return list(torch.autograd.grad(loss, list(model.parameters())))


def stash_grads(stage: Stage, version: int) -> list[torch.Tensor]:
    grads = [t.grad for t in stage.ring.tensors(version)]
    assert all(g is not None for g in grads)
    return grads  # type: ignore[return-value]


# ---- construction ----------------------------------------------------------------------------

def test_parameters_keep_identity_and_values_and_become_views_of_one_buffer() -> None:
    torch.manual_seed(1)
    model = mlp()
    before = list(model.parameters())
    values = [p.detach().clone() for p in before]
    ring = _C.WeightRing(before, 3)
    after = list(model.parameters())
    assert all(a is b for a, b in zip(after, before))
    assert all(isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad for p in after)
    for p, v in zip(after, values):
        torch.testing.assert_close(p.detach(), v, rtol=0, atol=0)
    (live,) = ring.live_buffers()
    element = live.element_size()
    offset = 0
    for p in after:  # packed back to back, in parameter order
        assert p.data_ptr() == live.data_ptr() + offset * element
        offset += p.numel()
    assert offset == live.numel()
    assert all(t is p for t, p in zip(ring.live_tensors(), after))
    assert (ring.capacity, ring.free_slots, ring.num_params, ring.offloaded) == (3, 3, 6, False)
    assert ring.held_versions() == []


def test_optimizer_still_updates_the_live_buffer() -> None:
    torch.manual_seed(2)
    model = mlp()
    ring = _C.WeightRing(list(model.parameters()), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (live,) = ring.live_buffers()
    before = live.clone()
    nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    opt.step()
    assert not torch.equal(live, before)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(live, flat)


def test_mixed_dtypes_make_one_group_each() -> None:
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5, dtype=torch.float64)),
              nn.Parameter(torch.randn(7).to(torch.bfloat16)), nn.Parameter(torch.randn(2))]
    values = [p.detach().clone() for p in params]
    ring = _C.WeightRing(params, 2)
    buffers = ring.live_buffers()
    assert [b.dtype for b in buffers] == [torch.float32, torch.float64, torch.bfloat16]
    assert [b.numel() for b in buffers] == [14, 5, 7]
    assert ring.bytes_per_version == sum(p.numel() * p.element_size() for p in params) == 110
    v = ring.snapshot()
    for stashed, p, value in zip(ring.tensors(v), params, values):
        assert stashed.dtype == p.dtype and stashed.shape == p.shape
        assert torch.equal(stashed.detach(), value) and torch.equal(p.detach(), value)


# ---- snapshots -------------------------------------------------------------------------------

def test_snapshot_is_a_copy_that_later_updates_leave_alone() -> None:
    torch.manual_seed(3)
    model = mlp()
    ring = _C.WeightRing(list(model.parameters()), 2)
    v = ring.snapshot()
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    live_ptrs = {p.data_ptr() for p in model.parameters()}
    for stashed, old, p in zip(ring.tensors(v), saved, model.parameters()):
        assert torch.equal(stashed.detach(), old)
        assert torch.equal(p.detach(), old + 1.0)
        assert stashed.data_ptr() not in live_ptrs
    w = ring.snapshot()
    for stashed, p in zip(ring.tensors(w), model.parameters()):
        assert torch.equal(stashed.detach(), p.detach())
    assert ring.held_versions() == [v, w] == [0, 1]
    assert ring.free_slots == 0 and ring.holds(0) and ring.holds(1) and not ring.holds(2)


def test_version_tensors_are_leaves_with_the_parameters_requires_grad() -> None:
    torch.manual_seed(4)
    model = mlp()
    model[0].bias.requires_grad_(False)  # a frozen parameter stays frozen in every version
    params = list(model.parameters())
    ring = _C.WeightRing(params, 1)
    v = ring.snapshot()
    tensors = ring.tensors(v)
    assert len(tensors) == len(params)
    for t, p in zip(tensors, params):
        assert t.is_leaf and t.grad_fn is None
        assert t.requires_grad == p.requires_grad
        assert (t.shape, t.dtype, t.device) == (p.shape, p.dtype, p.device)
    assert all(a is b for a, b in zip(ring.tensors(v), tensors))  # stable objects


def test_explicit_version_ids_and_the_counter_after_them() -> None:
    model = mlp()
    ring = _C.WeightRing(list(model.parameters()), 4)
    assert ring.snapshot(version=7) == 7
    assert ring.snapshot() == 8  # the counter continues after the largest id
    assert ring.snapshot(version=3) == 3
    assert ring.snapshot() == 9  # a smaller explicit id does not move the counter back
    assert ring.held_versions() == [3, 7, 8, 9]
    ring.release(8)
    assert ring.snapshot() == 10
    ring.release(10)
    assert ring.snapshot(version=8) == 8  # a released id may be used again


# ---- gradients through a stashed version (the point of the ring) -----------------------------

@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_backward_on_a_stashed_version_after_a_live_update_matches_a_reference(
        model_name: str) -> None:
    stage = Stage(model_name, slots=2)
    reference = copy.deepcopy(stage.model)  # the weights the forward will see
    x, y = batch(model_name, seed=10)

    v = stage.ring.snapshot()
    loss = stage.forward(v, x, y)
    stage.update_live(seed=11)  # in place, between the forward and its backward
    for p, old in zip(stage.model.parameters(), reference.parameters()):
        assert not torch.equal(p.detach(), old.detach())
    loss.backward()

    torch.testing.assert_close(loss.detach(), nn.functional.cross_entropy(reference(x), y))
    for got, want in zip(stash_grads(stage, v), reference_grads(reference, x, y)):
        torch.testing.assert_close(got, want)


def test_control_without_the_ring_the_same_sequence_is_an_autograd_error() -> None:
    """What the ring prevents: backward after an in-place update of the weights it used."""
    stage = Stage("mlp", slots=1)
    x, y = batch("mlp", seed=12)
    loss = nn.functional.cross_entropy(stage.model(x), y)  # on the live parameters
    stage.update_live(seed=13)
    with pytest.raises(RuntimeError, match=IN_PLACE_ERROR):
        loss.backward()


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_two_versions_in_flight_each_match_their_own_reference(model_name: str) -> None:
    """PipeDream order on one stage: F(v0), update, F(v1), update, B(v0), B(v1)."""
    stage = Stage(model_name, slots=2)
    x0, y0 = batch(model_name, seed=20)
    x1, y1 = batch(model_name, seed=21)

    ref0 = copy.deepcopy(stage.model)
    v0 = stage.ring.snapshot()
    loss0 = stage.forward(v0, x0, y0)
    stage.update_live(seed=22)

    ref1 = copy.deepcopy(stage.model)
    v1 = stage.ring.snapshot()
    loss1 = stage.forward(v1, x1, y1)
    stage.update_live(seed=23)

    loss0.backward()
    loss1.backward()
    for got, want in zip(stash_grads(stage, v0), reference_grads(ref0, x0, y0)):
        torch.testing.assert_close(got, want)
    for got, want in zip(stash_grads(stage, v1), reference_grads(ref1, x1, y1)):
        torch.testing.assert_close(got, want)
    for old, new in zip(ref0.parameters(), ref1.parameters()):
        assert not torch.equal(old, new)  # the two versions really are different weights

    stage.ring.release(v0)  # its slot is free again and the next snapshot may reuse it
    v2 = stage.ring.snapshot()
    assert stage.ring.held_versions() == [v1, v2] == [1, 2]


def test_reusing_a_slot_that_a_graph_still_needs_is_caught_by_autograd() -> None:
    """Releasing too early is a runtime bug; autograd's version check must report it."""
    stage = Stage("mlp", slots=1)
    x, y = batch("mlp", seed=30)
    v0 = stage.ring.snapshot()
    loss = stage.forward(v0, x, y)
    stage.ring.release(v0)
    stage.update_live(seed=31)
    stage.ring.snapshot()  # overwrites the only slot, which loss's graph still needs
    with pytest.raises(RuntimeError, match=IN_PLACE_ERROR):
        loss.backward()


def test_a_snapshot_into_another_slot_does_not_disturb_a_pending_graph() -> None:
    stage = Stage("mlp", slots=3)
    reference = copy.deepcopy(stage.model)
    x, y = batch("mlp", seed=40)
    v0 = stage.ring.snapshot()
    loss = stage.forward(v0, x, y)
    for seed in (41, 42):
        stage.update_live(seed)
        stage.ring.snapshot()
    loss.backward()
    for got, want in zip(stash_grads(stage, v0), reference_grads(reference, x, y)):
        torch.testing.assert_close(got, want)


def test_a_reused_slot_starts_without_the_previous_versions_gradients() -> None:
    stage = Stage("mlp", slots=1)
    x, y = batch("mlp", seed=50)
    v0 = stage.ring.snapshot()
    stage.forward(v0, x, y).backward()
    stage.ring.release(v0)
    v1 = stage.ring.snapshot()
    assert all(t.grad is None for t in stage.ring.tensors(v1))


# ---- errors ----------------------------------------------------------------------------------

def test_full_ring_is_an_error_naming_the_fix() -> None:
    ring = _C.WeightRing(list(mlp().parameters()), 2)
    ring.snapshot()
    ring.snapshot()
    with pytest.raises(_C.VersionError, match="all 2 slots hold versions; release one first"):
        ring.snapshot()
    assert ring.held_versions() == [0, 1] and ring.free_slots == 0


def test_release_twice_and_unknown_versions_are_errors() -> None:
    ring = _C.WeightRing(list(mlp().parameters()), 2)
    v = ring.snapshot()
    w = ring.snapshot()
    ring.release(v)
    with pytest.raises(_C.VersionError, match=rf"release\({v}\).*not held \(held: {w}\)"):
        ring.release(v)
    with pytest.raises(_C.VersionError,
                       match=r"tensors\(0\).*never snapshotted or has been released"):
        ring.tensors(v)
    with pytest.raises(_C.VersionError, match=r"tensors\(42\)"):
        ring.tensors(42)
    with pytest.raises(_C.VersionError):
        ring.tensors(-1)
    assert isinstance(_C.VersionError("x"), LookupError)
    assert not ring.holds(v) and not ring.holds(-1) and ring.holds(w)


def test_snapshot_of_an_already_held_id_is_an_error() -> None:
    ring = _C.WeightRing(list(mlp().parameters()), 3)
    ring.snapshot(version=5)
    with pytest.raises(_C.VersionError, match=r"version 5 is already held; release it first"):
        ring.snapshot(version=5)
    with pytest.raises(ValueError, match="version must be >= 0"):
        ring.snapshot(version=-2)
    assert ring.held_versions() == [5] and ring.free_slots == 2


@pytest.mark.parametrize("slots", [0, -1])
def test_slots_below_one_is_an_error(slots: int) -> None:
    with pytest.raises(ValueError, match=rf"slots must be >= 1, got {slots}"):
        _C.WeightRing(list(mlp().parameters()), slots)


def test_empty_parameter_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        _C.WeightRing([], 2)


def test_offload_of_cpu_parameters_is_an_error() -> None:
    """CPU build: offload needs CUDA; CUDA build: offload needs CUDA parameters."""
    with pytest.raises(ValueError, match="offload=True needs"):
        _C.WeightRing(list(mlp().parameters()), 2, offload=True)


def test_a_parameter_listed_twice_is_rejected() -> None:
    p = nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="twice|duplicate"):
        _C.WeightRing([p, p], 2)


def test_ring_outlives_python_handles() -> None:
    """Version tensors stay valid after the Python list that held them is gone."""
    model = mlp()
    ring = _C.WeightRing(list(model.parameters()), 2)
    v = ring.snapshot()
    first = [t.detach().clone() for t in ring.tensors(v)]
    gc.collect()
    assert all(torch.equal(t.detach(), f) for t, f in zip(ring.tensors(v), first))


# ---- CUDA ------------------------------------------------------------------------------------

@pytest.mark.cuda
@skip_without_cuda
def test_cuda_ring_stashes_on_the_device() -> None:
    stage = Stage("cnn", slots=2, device="cuda")
    reference = copy.deepcopy(stage.model)
    x, y = batch("cnn", seed=60, device="cuda")
    v = stage.ring.snapshot()
    assert all(t.is_cuda for t in stage.ring.tensors(v))
    loss = stage.forward(v, x, y)
    stage.update_live(seed=61)
    loss.backward()
    for got, want in zip(stash_grads(stage, v), reference_grads(reference, x, y)):
        torch.testing.assert_close(got, want)


@pytest.mark.cuda
@skip_without_cuda
def test_offloaded_versions_round_trip_through_pinned_memory() -> None:
    stage = Stage("mlp", slots=2, device="cuda", offload=True)
    assert stage.ring.offloaded
    reference = copy.deepcopy(stage.model)
    x, y = batch("mlp", seed=70, device="cuda")
    v0 = stage.ring.snapshot()
    stage.update_live(seed=71)  # right after the asynchronous device->host copy
    ref1 = copy.deepcopy(stage.model)
    v1 = stage.ring.snapshot()
    stage.update_live(seed=72)
    loss0 = stage.forward(v0, x, y)  # fetches v0 back to the device
    stage.update_live(seed=73)
    loss0.backward()
    for got, want in zip(stash_grads(stage, v0), reference_grads(reference, x, y)):
        torch.testing.assert_close(got, want)
    for stashed, want in zip(stage.ring.tensors(v1), ref1.parameters()):
        assert stashed.is_cuda
        torch.testing.assert_close(stashed.detach(), want.detach())
    stage.ring.release(v0)
    stage.ring.release(v1)
    assert stage.ring.free_slots == 2
