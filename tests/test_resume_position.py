"""A run resumed in mid-epoch is the run it resumes (issue 22, item 6).

A checkpoint records where the loader stands: the epoch, the batches of it trained on (the
steps trained, not what the feed read ahead for microbatches in flight) and the seed that
with the epoch draws its order. `Pipeline.load` + `train(loader)` then reads on from the next
batch of that epoch, and the epochs after it as the uninterrupted run does. Before, the epoch
in progress was counted as done (a save after `train()` returned or after a break) or the
run's first epoch was recorded (a periodic save), so a shuffling loader's order was lost: a
README-style run saved at step 100 of a 208-step epoch ended 0.108 away from the
uninterrupted one.

2 processes, gloo, 1f1b on a shuffling `DataLoader` (5 batches an epoch, 8 steps): the
uninterrupted run, resumed in a fresh job from a periodic save in epoch 0 (step 3) and in
epoch 1 (step 6), from `pipe.save` after a break (step 4), and continued in the saving process
after that break (`epochs=1`: the rest of the epoch, then the next), all end with bit-equal
weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.training import EpochBatches

SAMPLES, BATCH, CHUNKS, TIMEOUT = 40, 8, 2, 8
PER_EPOCH = SAMPLES // BATCH  # 5
STEPS, EVERY, BREAK_AT = 8, 3, 4  # saves at steps 3 (epoch 0) and 6 (epoch 1); a break at 4


def model() -> nn.Sequential:
    torch.manual_seed(0)  # no dropout: the run is a function of the data's order
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=g),
                         torch.randint(0, 3, (SAMPLES,), generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)  # as the README's


class Counting:
    """A loader that counts the batches read from it (the feed reads ahead of the steps)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.read = inner, 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.inner:
            self.read += 1
            yield batch

    def __len__(self) -> int:
        return len(self.inner)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def pipeline(schedule: str = "1f1b", **kwargs: Any) -> Pipeline:
    return Pipeline(model(), nn.functional.cross_entropy, sgd, schedule=schedule,
                    chunks=CHUNKS if schedule == "1f1b" else 1, balance=[2, 3],
                    timeout=TIMEOUT, **kwargs)


def train_job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = pipeline()
    list(plain.train(loader(), steps=STEPS))
    out["uninterrupted"] = plain.state_dict()
    plain.close()

    every = pipeline(checkpoint_dir=Path(root) / "every", checkpoint_every=EVERY)
    list(every.train(loader(), steps=STEPS))  # saves every/step-3 and every/step-6
    out["checkpoint_every"] = every.state_dict()
    every.close()

    cut = pipeline()
    data = loader()
    for step, _ in enumerate(cut.train(data, steps=STEPS), 1):
        if step == BREAK_AT:
            break
    cut.save(Path(root) / "saved")
    # The same loader goes on in the epoch: epochs=1 is its rest, then the next epoch.
    out["rest_of_epoch"] = len(list(cut.train(data, epochs=1)))
    list(cut.train(data, steps=STEPS - PER_EPOCH))
    out["continued"] = cut.state_dict()
    cut.close()

    # An asynchronous schedule reads ahead of the steps: the checkpoint counts the steps.
    ahead = pipeline("pipedream")
    counting = Counting(loader())
    for step, _ in enumerate(ahead.train(counting, steps=STEPS), 1):
        if step == 2:
            break
    ahead.save(Path(root) / "ahead")
    out["read"] = counting.read
    ahead.close()
    return out


def resume_job(rank: int, world: int, root: str, folders: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for folder in folders:
        pipe = Pipeline.load(Path(root) / folder, model(), nn.functional.cross_entropy, sgd,
                             schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT)
        resumed_at = pipe._progress.step
        list(pipe.train(loader(), steps=STEPS - resumed_at))
        out[folder] = (resumed_at, pipe.state_dict())
        pipe.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("resume")
    return root, launch(train_job, 2, str(root), timeout=120)[0]


def manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / ckpt.MANIFEST).read_text())


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     what: str) -> None:
    assert set(got) == set(want), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=f"{what}: {key}")


def test_checkpoints_record_where_the_loader_stands(runs):
    root, out = runs
    for folder, (epoch, batches) in {"every/step-3": (0, 3), "every/step-6": (1, 1),
                                     "saved": (0, BREAK_AT)}.items():
        m = manifest(root / folder)
        assert (m["epoch"], m["epoch_batches"], m["seed"]) == (epoch, batches, 0), folder
    assert out["read"] > 2  # the feed read ahead of the two steps trained ...
    m = manifest(root / "ahead")
    assert (m["step"], m["epoch"], m["epoch_batches"]) == (2, 0, 2)  # ... which alone count


def test_a_run_resumed_in_mid_epoch_equals_the_uninterrupted_run(runs):
    root, out = runs
    want = out["uninterrupted"]
    assert_bit_equal(out["checkpoint_every"], want, "saving every 3 steps")
    assert out["rest_of_epoch"] == PER_EPOCH - BREAK_AT
    assert_bit_equal(out["continued"], want, "a break, a save, then train() on the same loader")
    folders = ["every/step-3", "every/step-6", "saved"]
    resumed = launch(resume_job, 2, str(root), folders, timeout=120)[0]
    for folder, step in zip(folders, (3, 6, BREAK_AT)):
        resumed_at, state = resumed[folder]
        assert resumed_at == step
        assert_bit_equal(state, want, f"resumed from {folder}")


# --- without processes ---------------------------------------------------------------------

def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch[1]]


def indexed_loader() -> DataLoader:
    data = TensorDataset(torch.zeros(SAMPLES, 1), torch.arange(SAMPLES))
    return DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)


def test_batches_resumed_at_a_position_are_those_the_uninterrupted_reading_gives():
    data = indexed_loader()
    whole = EpochBatches(data, 0, 0)
    order = [ids(next(whole)) for _ in range(3 * PER_EPOCH)]
    assert order[:PER_EPOCH] != order[PER_EPOCH:2 * PER_EPOCH]  # each epoch shuffled anew
    for consumed in range(2 * PER_EPOCH + 1):
        reading = EpochBatches(data, 0, 0)
        for _ in range(consumed + 2):  # two batches read ahead, past an epoch's end too
            next(reading)
        epoch, index = reading.position(consumed)
        assert (epoch, index) == divmod(consumed, PER_EPOCH)
        again = EpochBatches(data, 0, epoch, index)
        assert [ids(next(again)) for _ in range(PER_EPOCH)] == \
            order[consumed:consumed + PER_EPOCH], consumed


def test_a_manifest_with_a_bad_loader_position_is_refused(tmp_path):
    entry = {"file": "stage0.pt", "bytes": 1, "sha256": "0" * 64}
    for change, match in (({"epoch_batches": -1}, "'epoch_batches' must be"),
                          ({"epoch_batches": "3"}, "'epoch_batches' must be"),
                          ({"seed": "zero"}, "'seed' must be")):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        m = ckpt.manifest_for(3, 0, "1f1b", {}, [(0, entry)], "run", [], epoch_batches=3,
                              seed=0)
        m.update(change)
        (folder / ckpt.MANIFEST).write_text(json.dumps(m))
        with pytest.raises(ckpt.CheckpointError, match=match):
            ckpt.read_manifest(folder)
