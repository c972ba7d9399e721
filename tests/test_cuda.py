"""GPU paths: stream-ordered queue hand-off, offloaded weight versions, an NCCL pipeline.

Marked `cuda` and skipped without a GPU and a CUDA build of pipedream_fast (FORCE_CUDA=1 or a
machine where torch sees a GPU at build time).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedream_fast import _C

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _C.cuda_enabled),
                                reason="needs a CUDA GPU and a CUDA build of pipedream_fast")
pytestmark = [pytest.mark.cuda, needs_cuda]


def test_pop_orders_the_consumer_stream_after_the_producer():
    queue = _C.ActivationQueue(2, "gpu")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    big = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # keep the producer busy so a missing wait would show
        out = big @ big
        queue.push([out], microbatch=0)
    with torch.cuda.stream(consumer):
        got = queue.pop(timeout=5).tensors[0]
        checksum = got.sum()
    torch.cuda.synchronize()
    torch.testing.assert_close(checksum, (big @ big).sum())


def test_offloaded_versions_live_in_pinned_memory_and_come_back():
    model = nn.Linear(64, 64).cuda()
    ring = _C.WeightRing(list(model.parameters()), 2, offload=True)
    expected = [p.detach().clone() for p in model.parameters()]
    version = ring.snapshot()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    tensors = ring.tensors(version)
    assert all(t.is_cuda for t in tensors)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e)
    ring.release(version)


def _nccl_job(rank: int, world: int) -> float:
    from pipedream_fast.formats import Plan, StagePlan
    from pipedream_fast.pipeline import Pipeline
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    plan = Plan("mlp", 16, 2, "1f1b", [StagePlan(0, 2, 1, (0,), 1.0), StagePlan(2, 5, 1, (1,), 1.0)],
                1.0, 1.0)
    pipe = Pipeline(model, nn.functional.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1),
                    plan=plan, schedule="pipedream", chunks=4, timeout=60)
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    losses = [x for x in pipe.train(data, 4) if x is not None]
    pipe.close()
    return float(losses[-1]) if losses else float("nan")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_pipeline_trains():
    from pipedream_fast.launch import launch
    losses = launch(_nccl_job, 2, timeout=120)
    assert torch.isfinite(torch.tensor(losses[1]))
