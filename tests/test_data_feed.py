"""Replicas of the first stage read one shuffled loader alike (3 processes, gloo).

Ranks 0 and 1 replicate the first stage and each take half of every minibatch's microbatches;
rank 2 holds the second stage. The loader shuffles without a generator of its own and the model
has dropout, which draws from each rank's random state differently: without the per-epoch
seeding both replicas would read different permutations and train some samples twice and
others never. Both must read the same permutation, a new one each epoch; a loader whose order
comes from a random state of its own, different per rank, is refused on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline

SAMPLES, BATCH, CHUNKS, EPOCHS = 32, 8, 2, 2


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
