"""The CPU block cache (`csrc/cpu_cache.h`, `Tuning.cpu_cache_mb`): a Pipeline on the CPU
holds it while open, training through it gives the very results of malloc's, and a block
freed at one step serves the next instead of being faulted in afresh."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from pipedream_fast import Pipeline, _C
from pipedream_fast.runtime.cpu_cache import CpuCacheHold, cpu_cache_stats
from pipedream_fast.tuning import Tuning

MIB = 1024 * 1024


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def wide_steps(steps: int) -> int:
    """The page faults of `steps` steps of a layer whose weight gradient (64 MiB) is above
    malloc's largest mmap threshold (32 MiB): mapped fresh at every backward without the
    cache."""
    torch.manual_seed(0)
    layer = nn.Linear(4096, 4096)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    x = torch.randn(8, 4096)
    for _ in range(2):  # the first step's allocations are not what is measured
        layer(x).sum().backward()
    opt.step()
    opt.zero_grad()
    before = page_faults()
    for _ in range(steps):
        for _ in range(2):  # two microbatches: the second's gradient is a fresh tensor
            layer(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return page_faults() - before


def test_a_freed_block_serves_the_next_step_instead_of_fresh_pages() -> None:
    without = wide_steps(3)
    hold = CpuCacheHold(torch.device("cpu"), 1024 * MIB)
    try:
        assert hold.held and cpu_cache_stats()["installed"]
        hits = cpu_cache_stats()["hits"]
        with_cache = wide_steps(3)
        assert cpu_cache_stats()["hits"] > hits
    finally:
        hold.release()
    assert not cpu_cache_stats()["installed"]
    if without < 40_000:  # the system maps large blocks in huge pages (THP "always")
        pytest.skip(f"malloc's fresh blocks faulted in only {without} pages: nothing to save")
    # the second backward's gradient of each step, 64 MiB: 16k pages of 4 KiB a step
    assert with_cache < without / 10, (without, with_cache)


def test_holds_are_counted_and_no_hold_where_it_is_off_or_not_the_cpu() -> None:
    assert not CpuCacheHold(torch.device("cpu"), 0).held
    assert not CpuCacheHold(torch.device("meta"), 64 * MIB).held
    first = CpuCacheHold(torch.device("cpu"), 64 * MIB)
    second = CpuCacheHold(torch.device("cpu"), 128 * MIB)
    assert cpu_cache_stats()["users"] == 2 and cpu_cache_stats()["limit_bytes"] == 128 * MIB
    first.release()
    first.release()  # a second release of one hold changes nothing
    assert cpu_cache_stats()["users"] == 1 and cpu_cache_stats()["installed"]
    second.release()
    assert cpu_cache_stats()["users"] == 0 and not cpu_cache_stats()["installed"]
    assert cpu_cache_stats()["cached_bytes"] == 0


def run(tuning: Tuning) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 8))
    pipe = Pipeline(model, nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), stages=2,
                    ranks="threads", workers=2, chunks=4, schedule="1f1b", tuning=tuning)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 256, generator=g), torch.randint(0, 8, (64,), generator=g))
            for _ in range(5)]
    installed = bool(_C.cpu_cache_stats()["installed"])
    losses = [float(loss) for loss in pipe.train(data, 5)]
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return losses, state, installed


def test_a_pipeline_holds_the_cache_while_open_and_trains_exactly_as_without() -> None:
    cached = run(Tuning())
    assert not cpu_cache_stats()["installed"]  # closed: the previous allocator is back
    plain = run(Tuning(cpu_cache_mb=0))
    assert cached[2] and not plain[2]
    assert cached[0] == plain[0]
    assert cached[1].keys() == plain[1].keys()
    assert all(torch.equal(cached[1][k], plain[1][k]) for k in plain[1])


class Seen(nn.Module):
    """A layer that notes whether the cache is installed each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.installed: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.installed.append(bool(_C.cpu_cache_stats()["installed"]))
        return self.lin(x)


def test_the_profiler_measures_under_the_memory_behaviour_the_run_will_have() -> None:
    from pipedream_fast.profiler import profile_model

    for mb, want in ((None, True), (0.0, False)):
        model = nn.Sequential(Seen(), nn.ReLU(), Seen())
        profile_model(model, torch.randn(4, 8), 4, warmup=0, repeat=1, progress=False,
                      cpu_cache_mb=mb)
        # the timed runs (the trace's and the reference forward before them are not timed)
        assert model[0].installed[-1] is want and model[2].installed[-1] is want, mb
        assert want or not any(model[0].installed + model[2].installed)
        assert not cpu_cache_stats()["installed"]  # released with the profile
