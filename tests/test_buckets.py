"""Gradient buckets: contiguous slices of the flat gradient buffers, started during backward."""

from __future__ import annotations

import torch
from torch import nn

from pipedream_fast import _C
from pipedream_fast.runtime.buckets import GradientBuckets


class _Recorder:
    def __init__(self) -> None:
        self.started: list[torch.Tensor] = []
        self.waited = 0

    def __call__(self, tensors: list[torch.Tensor]) -> _Recorder:
        self.started.extend(tensors)
        return self

    def wait(self) -> None:
        self.waited += 1


def _model() -> tuple[nn.Module, _C.WeightRing, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    ring = _C.WeightRing(list(model.parameters()), 2)
    return model, ring, ring.attach_grad_buffers()


def test_buckets_tile_the_flat_buffer_from_the_end():
    model, _, grads = _model()
    recorder = _Recorder()
    buckets = GradientBuckets(list(model.parameters()), grads, recorder, bucket_bytes=256)
    assert buckets.num_buckets > 2
    buckets.flush()
    total = sum(t.numel() for t in recorder.started)
    assert total == grads[0].numel()  # every element exactly once
    starts = sorted(t.data_ptr() for t in recorder.started)
    assert starts[0] == grads[0].data_ptr()


def test_armed_buckets_start_during_backward_last_layer_first():
    model, ring, grads = _model()
    recorder = _Recorder()
    params = list(model.parameters())
    buckets = GradientBuckets(params, grads, recorder, bucket_bytes=256)
    order: list[int] = []
    params[0].register_post_accumulate_grad_hook(lambda _: order.append(len(recorder.started)))
    buckets.arm()
    model(torch.randn(8, 16)).sum().backward()
    # By the time the first layer's gradient lands, later layers' buckets are already running.
    assert order and order[0] >= 1
    assert len(recorder.started) == buckets.num_buckets  # all filled during backward
    buckets.flush()  # nothing left to start
    assert len(recorder.started) == buckets.num_buckets
    buckets.wait()
    assert recorder.waited == buckets.num_buckets


def test_stashed_version_leaves_count_too():
    model, ring, grads = _model()
    recorder = _Recorder()
    params = list(model.parameters())
    buckets = GradientBuckets(params, grads, recorder, bucket_bytes=256)
    version = ring.snapshot()
    tensors = ring.tensors(version)
    buckets.watch(tensors)
    buckets.arm()
    names = [n for n, _ in model.named_parameters()]
    torch.func.functional_call(model, dict(zip(names, tensors)), (torch.randn(8, 16),)).sum().backward()
    assert len(recorder.started) == buckets.num_buckets
    assert grads[0].abs().sum() > 0
