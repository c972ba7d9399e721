"""The executor and stage runtimes in one process, over the in-memory fake transport: every
schedule against its single-process reference, in seconds, with no C++ engine and no
process start-up. Ranks are threads; several stages may share a rank (interleaved)."""

from __future__ import annotations

import copy
import threading
from typing import Any
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from fake_transport import FakeHub, FakeTransport
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.executor import _PREFETCH, Executor
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.schedules import looped_ranks, make_schedule
from pipedream_fast.schedules.registry import splits_backward
from pipedream_fast.training import (MicrobatchFeed, StepTracker, check_backend, data_source,
                                     feed_uses, target_spec)
from runtime_reference import interpret_schedule, train_reference

CHUNKS, BATCH = 4, 8


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                         nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))


def batches(steps: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def split(bounds: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


def run_fake(schedule: Schedule, ranges: list[tuple[int, int]], steps: int,
             chunks: int = CHUNKS, batch: int = BATCH, peaks: dict[str, int] | None = None,
             send_ahead: bool = False
             ) -> tuple[dict[str, torch.Tensor], dict[int, list[float]]]:
    """Trains deep_mlp with `schedule` over the fake transport; returns the whole model's
    weights (checked equal across replicas) and each step's losses. `peaks`, if given, gets
    the largest size seen of each piece of per-microbatch bookkeeping during the run.
    `send_ahead`: at each step a rank finishes, `Executor.send_ahead` as the run loop calls
    it, checked to leave no send of the finished steps at the head of the program."""
    children = list(deep_mlp().children())
    hub = FakeHub(schedule.num_ranks)
    ranks = range(schedule.num_ranks)
    feed = MicrobatchFeed(iter(batches(steps, batch)), chunks, feed_uses(schedule, ranks))
    last = schedule.num_stages - 1
    runtimes: dict[int, dict[int, StageRuntime]] = {}
    for rank in ranks:
        runtimes[rank] = {
            s: StageRuntime(s, copy.deepcopy(nn.Sequential(*children[a:b])), sgd,
                            slots=schedule.max_versions[rank], is_first=s == 0,
                            is_last=s == last, loss_fn=loss_fn,
                            split_backward=splits_backward(schedule.name))
            for s in schedule.stages_of(rank) for a, b in [ranges[s]]}
    losses: dict[int, dict[int, float]] = {}  # step -> mb -> loss (every rank learns it)
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        inputs = data_source(feed, schedule, rank, lambda x: (x,))
        executor = Executor(schedule, rank, runtimes[rank], FakeTransport(hub, rank),
                            inputs, target_spec=target_spec(torch.zeros(1)))
        tracker = StepTracker(schedule, rank, chunks)
        try:
            for _, action, loss in executor.run():
                done = tracker.done(action, steps) if send_ahead else []
                if done:
                    limit = (done[-1] + 1) * chunks
                    executor.send_ahead(limit)
                    for b in executor._program.ahead():  # up to the next other action
                        if not b.kind.is_p2p:
                            break
                        assert not (b.kind.spec.sends and b.needs("microbatch") < limit), b
                if loss is not None:
                    mb = action.microbatch
                    seen = losses.setdefault(mb // chunks, {})
                    assert seen.get(mb, float(loss)) == float(loss), "ranks disagree on a loss"
                    seen[mb] = float(loss)
                if peaks is not None:
                    sizes = {"outputs": len(executor._outputs), "posted": len(executor._posted),
                             "look-ahead": len(executor._program._buffer) - executor._program._head,
                             "feed": len(feed._cache),
                             "stash": sum(len(s.inflight) for s in runtimes[rank].values())}
                    for key, size in sizes.items():
                        peaks[key] = max(peaks.get(key, 0), size)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)
            hub.close()

    threads = [threading.Thread(target=work, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    state: dict[str, torch.Tensor] = {}
    for s, ranks_of_s in enumerate(schedule.stage_ranks):
        start = ranges[s][0]
        replicas = [runtimes[r][s].module.state_dict() for r in ranks_of_s]
        for key, value in replicas[0].items():
            for other in replicas[1:]:
                torch.testing.assert_close(other[key], value, msg=f"replicas of stage {s}")
            index, rest = key.split(".", 1)
            state[f"{start + int(index)}.{rest}"] = value.clone()
    return state, losses


def reference(schedule: Schedule, ranges: list[tuple[int, int]], steps: int,
              synchronous: bool) -> dict[str, torch.Tensor]:
    if synchronous:
        return train_reference(deep_mlp(), batches(steps), CHUNKS, loss_fn, sgd)
    children = list(deep_mlp().children())
    mbs = [(x, y) for bx, by in batches(steps) for x, y in zip(bx.chunk(CHUNKS), by.chunk(CHUNKS))]
    finals = interpret_schedule(schedule, [nn.Sequential(*children[a:b]) for a, b in ranges],
                                mbs, loss_fn, sgd)
    return {f"{ranges[s][0] + int(k.split('.', 1)[0])}.{k.split('.', 1)[1]}": v
            for s, weights in enumerate(finals) for k, v in weights.items()}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=2e-5, rtol=1e-4, msg=key)


LAYOUTS = {"2-stage": ([0, 4, 8], [[0], [1]]), "2+1": ([0, 4, 8], [[0, 1], [2]]),
           "3-stage": ([0, 2, 5, 8], [[0], [1], [2]])}
FLUSH = ("gpipe", "1f1b", "zb-h1")
ASYNC = ("pipedream", "pipedream-vsync", "2bw")


def check_against_reference(name: str, layout: str, send_ahead: bool = False) -> None:
    """Three steps of schedule `name` on `layout` equal its reference, every step's losses
    learned."""
    bounds, stage_ranks = LAYOUTS[layout]
    steps = 3
    kw = {"chunks": CHUNKS} if name in FLUSH + ("2bw",) else {}
    schedule = make_schedule(name, len(stage_ranks), steps * CHUNKS, stage_ranks=stage_ranks,
                             **kw)
    got, losses = run_fake(schedule, split(bounds), steps, send_ahead=send_ahead)
    assert_same(got, reference(schedule, split(bounds), steps, synchronous=name in FLUSH))
    assert sorted(losses) == list(range(steps)) and all(len(v) == CHUNKS for v in losses.values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", FLUSH + ASYNC)
def test_every_schedule_equals_its_reference(name: str, layout: str) -> None:
    check_against_reference(name, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", FLUSH + ASYNC)
def test_sends_ahead_of_the_step_bookkeeping_change_nothing(name: str, layout: str) -> None:
    """`Executor.send_ahead` (the run loop's, at each step a rank finishes) performs the next
    transfers early: every schedule still equals its reference, and no send of a finished
    step is left for after the caller's code."""
    check_against_reference(name, layout, send_ahead=True)


@pytest.mark.parametrize("ranks, v, bounds", [
    (2, 2, [0, 2, 4, 6, 8]),            # the 2-rank, 4-stage pipeline: stages 0, 2 on rank 0
    (3, 2, [0, 1, 2, 4, 5, 6, 8]),      # 3 ranks, 6 stages
    (1, 3, [0, 2, 5, 8]),               # one rank holding every stage: all hand-offs local
    (2, 3, [0, 1, 2, 3, 4, 6, 8])])
def test_interleaved_1f1b_equals_gradient_accumulation(ranks: int, v: int,
                                                       bounds: list[int]) -> None:
    steps, m = 3, 2 * ranks
    schedule = make_schedule("interleaved-1f1b", ranks * v, steps * m,
                             stage_ranks=looped_ranks(ranks * v, v), chunks=m)
    assert all(len(schedule.stages_of(r)) == v for r in range(ranks))
    got, losses = run_fake(schedule, split(bounds), steps, chunks=m, batch=4 * m)
    assert_same(got, train_reference(deep_mlp(), batches(steps, 4 * m), m, loss_fn, sgd))
    assert sorted(losses) == list(range(steps)) and all(len(v) == m for v in losses.values())


def test_a_long_stream_holds_no_state_per_step() -> None:
    """500 steps of pipedream: the executor's, the stream's, the feed's and the stages'
    bookkeeping stay as small as a few microbatches in flight, never growing with the run."""
    steps = 500
    schedule = make_schedule("pipedream", 2, steps * CHUNKS, stage_ranks=[[0], [1]])
    peaks: dict[str, int] = {}
    got, losses = run_fake(schedule, split([0, 4, 8]), steps, peaks=peaks)
    assert len(losses) == steps and all(torch.isfinite(v).all() for v in got.values())
    assert set(peaks) == {"outputs", "posted", "look-ahead", "feed", "stash"}
    # 2000 microbatches ran; the look-ahead holds the actions made while waiting as well
    ahead = peaks.pop("look-ahead")
    assert max(peaks.values()) <= 2 * CHUNKS and ahead <= 2 * CHUNKS + _PREFETCH, (peaks, ahead)


def test_nccl_refuses_two_links_in_one_direction() -> None:
    looped = make_schedule("interleaved-1f1b", 4, 8, stages_per_rank=2)
    check_backend(looped, "gloo")
    with pytest.raises(ValueError, match="rank 0 would send rank 1 activations to stage 1 and "
                                         "activations to stage 3"):
        check_backend(looped, "nccl")
    check_backend(make_schedule("1f1b", 3, 8, replicas=[2, 1, 1]), "nccl")  # one link each way
