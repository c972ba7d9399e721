"""Planner speed: 100 blocks, 64 workers, 3 topology levels in under 1 s (issue 3).

The original PipeDream optimizer took up to 8 s on problems of this size. Run with

    PYTHONPATH=. python -m pytest bench/bench_planner.py --benchmark-only

and record the figures in bench/results/planner.md.
"""

from __future__ import annotations

import random

import pytest

from pipedream_fast.formats import BlockProfile, Profile
from pipedream_fast.planner import make_plan
from pipedream_fast.topology import Topology

GOAL_S = 1.0


def synthetic_profile(num_blocks: int = 100, seed: int = 0) -> Profile:
    """A deep model with uneven blocks: times 3-30 ms, 0.1-10 MB activations, up to 100 MB params."""
    rng = random.Random(seed)
    blocks = [BlockProfile(name=f"block{k}", forward_ms=rng.uniform(1, 10),
                           backward_ms=rng.uniform(2, 20),
                           activation_bytes=rng.randint(10**5, 10**7),
                           parameter_bytes=rng.randint(10**4, 10**8), optimizer_state_bytes=0,
                           extra={"saved_bytes": rng.randint(10**5, 10**7)})
              for k in range(num_blocks)]
    return Profile(model="synthetic-100", batch_size=32, device="cpu", blocks=blocks)


@pytest.mark.parametrize("topology", ["4x1e11,4x2.5e10,4x1.25e9", "2x1e11,4x2e10,8x1e9"])
def test_plan_100_blocks_64_workers_3_levels(benchmark, topology: str) -> None:
    profile, topo = synthetic_profile(), Topology.parse(topology)
    plan = benchmark(make_plan, profile, topo)
    assert plan.workers <= 64 and plan.stages[-1].stop == 100
    assert benchmark.stats.stats.median < GOAL_S


def test_plan_100_blocks_64_workers_flat(benchmark) -> None:
    plan = benchmark(make_plan, synthetic_profile(), Topology.parse("64x1e10"))
    assert benchmark.stats.stats.median < GOAL_S
    assert plan.workers <= 64


def test_plan_with_memory_limit_3_levels(benchmark) -> None:
    """Informational: a memory limit makes tables depend on the position in the pipeline."""
    topo = Topology.parse("4x1e11,4x2.5e10,4x1.25e9", memory_per_worker=2 * 10**9)
    plan = benchmark.pedantic(make_plan, args=(synthetic_profile(), topo), rounds=3, iterations=1)
    assert all(s.extra["memory_bytes"] <= 2 * 10**9 for s in plan.stages)
