"""A checkpoint loads on any cut (issue 35, item 2): saved by a 4-rank 1f1b run at step 3
and continued on 2 ranks, and on 3 ranks with a replicated first stage, the run ends within
1e-6 (relative) of the uninterrupted 4-rank run's weights; a pipedream run continued on
another cut goes on learning. Each stage file records its parameters' keys, so the new
stages take weights, optimizer state, scheduler and staleness state by the model's keys
(`rank/keyed_state.py`, shared with `Pipeline.move`). Rank threads; a process job in the
end, on another world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline

BATCH, CHUNKS, STEPS, SAVED_AT = 16, 4, 6, 3


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def plan_of(*stages: tuple[int, int, tuple[int, ...]], schedule: str = "1f1b") -> Plan:
    workers = len({r for _, _, ranks in stages for r in ranks})
    return Plan("mlp", BATCH // CHUNKS, workers, schedule,
                [StagePlan(a, b, len(ranks), ranks, 1.0) for a, b, ranks in stages], 1.0, 1.0)


FOUR = plan_of((0, 2, (0,)), (2, 4, (1,)), (4, 6, (2,)), (6, 8, (3,)))
TWO = plan_of((0, 5, (0,)), (5, 8, (1,)))
THREE_REPLICATED = plan_of((0, 4, (0, 1)), (4, 8, (2,)))


def pipeline(plan: Plan, schedule: str = "1f1b", **kwargs: Any) -> Pipeline:
    return Pipeline(model(), nn.functional.cross_entropy, adam, plan=plan, schedule=schedule,
                    chunks=CHUNKS, scheduler=scheduler, ranks="threads", timeout=60, **kwargs)


def saved_run(folder: Path, schedule: str = "1f1b") -> tuple[list[float], dict[str, Any]]:
    """The whole run on 4 ranks, saving at step SAVED_AT into `folder`."""
    pipe = pipeline(FOUR, schedule, checkpoint_dir=str(folder), checkpoint_every=SAVED_AT)
    losses = [float(x) for x in pipe.train(batches(), STEPS)]
    state = pipe.state_dict()
    pipe.close()
    return losses, state


def continued(folder: Path, plan: Plan, schedule: str = "1f1b"
              ) -> tuple[int, list[float], dict[str, Any]]:
    pipe = Pipeline.load(folder / f"step-{SAVED_AT}", model(), nn.functional.cross_entropy,
                         adam, scheduler=scheduler, plan=plan, schedule=schedule,
                         chunks=CHUNKS, ranks="threads", workers=plan.workers, timeout=60)
    began = pipe.steps_done
    losses = [float(x) for x in pipe.train(batches(), STEPS - began)]
    state = pipe.state_dict()
    pipe.close()
    return began, losses, state


def assert_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("plan", [TWO, THREE_REPLICATED], ids=["2 ranks", "3 ranks, replicated"])
def test_a_1f1b_checkpoint_of_4_ranks_continues_on_another_cut(tmp_path, plan):
    losses, want = saved_run(tmp_path / "ck")
    began, rest, got = continued(tmp_path / "ck", plan)
    assert began == SAVED_AT
    assert rest == pytest.approx(losses[SAVED_AT:], rel=1e-5)
    assert_close(got, want)


def test_pipedream_continues_on_another_cut_and_learns(tmp_path):
    losses, _ = saved_run(tmp_path / "ck", "pipedream")
    _, rest, _ = continued(tmp_path / "ck", TWO, "pipedream")
    assert all(torch.isfinite(torch.tensor(rest)))
    assert sum(rest) / len(rest) < sum(losses[:SAVED_AT]) / SAVED_AT  # it goes on learning


def test_a_checkpoint_without_keys_is_refused_on_another_cut(tmp_path):
    saved_run(tmp_path / "ck")
    folder = tmp_path / "ck" / f"step-{SAVED_AT}"
    for index in range(4):  # as a checkpoint from before keys were recorded
        path = folder / ckpt.stage_file(index)
        payload = torch.load(path, weights_only=True)
        payload.pop("keys")
        torch.save(payload, path)
    manifest = ckpt.read_manifest(folder)
    for index in range(4):
        entry = manifest["files"][str(index)]
        entry["bytes"] = (folder / entry["file"]).stat().st_size
        entry["sha256"] = ckpt.sha256(folder / entry["file"])
    ckpt.write_manifest(folder, manifest)
    with pytest.raises(Exception, match="was written before checkpoints recorded their "
                                        "parameters' keys: it loads only on the plan that "
                                        "wrote it"):
        continued(tmp_path / "ck", TWO)


def process_job(rank: int, world: int, folder: str) -> dict[str, Any]:
    pipe = Pipeline.load(Path(folder) / f"step-{SAVED_AT}", model(),
                         nn.functional.cross_entropy, adam, scheduler=scheduler,
                         balance=[5, 3], schedule="1f1b", chunks=CHUNKS, timeout=60)
    losses = [float(x) for x in pipe.train(batches(), STEPS - pipe.steps_done)]
    state = pipe.state_dict()
    pipe.close()
    return {"losses": losses, "state": state}


def test_a_4_rank_checkpoint_continues_on_2_processes(tmp_path):
    losses, want = saved_run(tmp_path / "ck")
    got = launch(process_job, 2, str(tmp_path / "ck"), timeout=120)[0]
    assert got["losses"] == pytest.approx(losses[SAVED_AT:], rel=1e-5)
    assert_close(got["state"], want)
