"""The data feed: how a minibatch of any size becomes microbatches (unit tests), and
replicas of the first stage reading one shuffled loader alike (3 processes, gloo).

Ranks 0 and 1 replicate the first stage and each take half of every minibatch's microbatches;
rank 2 holds the second stage. The loader shuffles without a generator of its own and the model
has dropout, which draws from each rank's random state differently: without the per-epoch
seeding both replicas would read different permutations and train some samples twice and
others never. Both must read the same permutation, a new one each epoch; a loader whose order
comes from a random state of its own, different per rank, is refused on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from pipedream_fast.data_feed import (MicrobatchFeed, check_loader, microbatch_sizes, pad_batch,
                                      split_microbatches)
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.runtime.executor import sample_weight

SAMPLES, BATCH, CHUNKS, EPOCHS = 32, 8, 2, 2


# --- microbatches of any size (unit tests) -------------------------------------------------

def test_a_minibatch_splits_as_evenly_as_it_goes_the_first_ones_one_larger():
    x = torch.arange(10)
    parts = split_microbatches({"x": x, "pair": (x, None), "flag": True}, 4)
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert all(p["pair"][0] is not None and p["pair"][1] is None and p["flag"] for p in parts)
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(8, 4) == [2, 2, 2, 2] and microbatch_sizes(2, 4) == [1, 1, 0, 0]
    # A batch that chunks divide splits into the very views torch.chunk gives (same results).
    y = torch.randn(8, 3)
    assert all(torch.equal(a, b) and a.stride() == b.stride()
               for a, b in zip(split_microbatches(y, 4), y.chunk(4)))


def test_the_feed_sends_each_microbatchs_sample_counts_and_pads_a_tail_below_chunks():
    x, y = torch.arange(11.0).unsqueeze(1), torch.arange(11)
    feed = MicrobatchFeed(iter([(x[:6], y[:6]), (x[6:8], y[6:8])]), 4, lambda mb: 1,
                          counts=True)
    taken = [feed.take(mb) for mb in range(8)]
    # 6 in 4: 2, 2, 1, 1; 2 in 4: 1, 1 and two repeats of the last sample that count 0.
    assert [xs.squeeze(1).tolist() for xs, _ in taken] == [[0, 1], [2, 3], [4], [5], [6], [7],
                                                            [7], [7]]
    assert [target.tolist() for _, (target, _) in taken] == [[0, 1], [2, 3], [4], [5], [6], [7],
                                                             [7], [7]]
    counts = [c.tolist() for _, (_, c) in taken]
    assert counts == [[2, 6, 4], [2, 6, 4], [1, 6, 4], [1, 6, 4],
                      [1, 2, 4], [1, 2, 4], [0, 2, 4], [0, 2, 4]]
    weights = [sample_weight(c) for _, (_, c) in taken]
    assert weights == pytest.approx([4 / 3, 4 / 3, 2 / 3, 2 / 3, 2, 2, 0, 0])
    assert sum(weights[:4]) == pytest.approx(4) and sum(weights[4:]) == pytest.approx(4)
    # A microbatch holding its even share weighs exactly 1.0: multiplied by nothing.
    assert sample_weight(torch.tensor([2, 8, 4])) == 1.0
    assert sample_weight(torch.tensor([3, 12, 4])) == 1.0
    # Without counts (evaluation, which pads its batches itself): the targets as they are.
    plain = MicrobatchFeed(iter([(x[:8], y[:8])]), 4, lambda mb: 1)
    assert torch.equal(plain.take(0)[1], y[:2])


def test_evaluation_pads_to_its_size_with_a_mask_and_refuses_a_larger_batch():
    x, y = torch.arange(7.0), torch.arange(7)
    px, (py, real) = pad_batch((x, y), 12, most=10)
    assert px.tolist() == [*range(7), 6, 6, 6, 6, 6] and py.tolist()[-1] == 6
    assert real.tolist() == [True] * 7 + [False] * 5
    _, (_, real) = pad_batch((torch.arange(9.0), torch.arange(9)), 4, most=10)  # above 4:
    assert real.tolist() == [True] * 9  # nothing padded (a model's own loss, 4 chunks)
    with pytest.raises(ValueError, match="follows one of 10"):
        pad_batch((torch.arange(11.0), torch.arange(11)), 12, most=10)


def test_any_batch_size_and_a_short_last_batch_are_accepted_below_chunks_is_refused():
    data = TensorDataset(torch.randn(26, 2), torch.zeros(26))
    check_loader(DataLoader(data, batch_size=8), 4)  # a short last batch (2)
    check_loader(DataLoader(data, batch_size=10), 4)  # chunks do not divide it
    check_loader(DataLoader(data, batch_size=2), 4, training=False)  # evaluation pads
    with pytest.raises(ValueError, match="batch size 2 is smaller than chunks=4"):
        check_loader(DataLoader(data, batch_size=2), 4)
    with pytest.raises(ValueError, match="DistributedSampler"):
        check_loader(DataLoader(data, batch_size=8,
                                sampler=DistributedSampler(data, num_replicas=1, rank=0)), 4)


class Recording(Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        self.seen.append(int(index))
        return self.base[index]


def job(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # ranks' random states differ, as in any real job
    g = torch.Generator().manual_seed(0)
    data = Recording(TensorDataset(torch.randn(SAMPLES, 6, generator=g),
                                   torch.randint(0, 3, (SAMPLES,), generator=g)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    plan = Plan(model="m", batch_size=BATCH, workers=3, schedule="1f1b",
                stages=[StagePlan(0, 2, 2, (0, 1), 1.0), StagePlan(2, 3, 1, (2,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    pipe = Pipeline(model, nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.1), plan=plan, schedule="1f1b",
                    chunks=CHUNKS, timeout=60)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    losses = [None if x is None else float(x) for x in pipe.train(loader, epochs=EPOCHS)]
    # A loader shuffling with a generator of its own, seeded differently on each rank: the
    # replicas would read different batches, which must be refused, not trained.
    own = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True,
                     generator=torch.Generator().manual_seed(rank))
    try:
        list(pipe.train(own, steps=2))
        refused = ""
    except ValueError as err:
        refused = str(err)
    pipe.close()
    return {"seen": data.seen[:EPOCHS * SAMPLES], "losses": losses, "refused": refused}


def test_first_stage_replicas_read_the_same_shuffle():
    results = launch(job, 3, timeout=120)
    first, second, last = results
    assert first["seen"] == second["seen"]  # the same permutation on both replicas
    assert last["seen"] == []  # the last stage never reads the loader
    epochs = [first["seen"][i * SAMPLES:(i + 1) * SAMPLES] for i in range(EPOCHS)]
    assert len(first["seen"]) == EPOCHS * SAMPLES
    for epoch in epochs:
        assert sorted(epoch) == list(range(SAMPLES))  # every sample once per epoch
    assert epochs[0] != list(range(SAMPLES)) and epochs[0] != epochs[1]  # shuffled, anew
    steps = EPOCHS * SAMPLES // BATCH
    assert all(len(r["losses"]) == steps for r in results)
    assert all(x is not None for x in last["losses"])
    for r in results:  # every rank refuses, so none waits for the others
        assert "read different first batches" in r["refused"], r["refused"]
