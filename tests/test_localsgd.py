"""LocalSGD trained by the runtime against a single-process reference (gloo, 2 and 3
processes, and LocalPipeline threads).

The reference is LocalSGD written out by hand: R independent copies of the model, each with
its own SGD-with-momentum optimizer; minibatch m trains copy m mod R; every R*H minibatches
the copies' parameters are set to their mean (the momentum buffers are not: optimizer state
is per copy); a trailing partial round is not averaged. Rounds count from the start of each
`train` call. The pipeline must give the same loss for every minibatch and the same weights
of every copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.local_pipeline import LocalPipeline
from pipedream_fast.pipeline import Pipeline

BATCH = 4
# Stage block ranges of the 5-block MLP, one rank per stage.
LAYOUTS = {2: [(0, 3), (3, 5)], 3: [(0, 2), (2, 4), (4, 5)]}
# (stages, model_replicas R, local_steps H, steps): full rounds and a trailing partial one.
# R None: the default, one replica per stage.
CASES = {2: [(2, 2, 2, 15), (2, 3, 1, 14), (2, None, 1, 5)],
         3: [(3, None, 2, 16), (3, 2, 3, 14)]}
# A save after 5 steps (one round of 2x2 and one step more), a load, 4 steps more.
RESUME = (2, 2, 2, (5, 4))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plan_for(stages: int) -> Plan:
    return Plan(model="mlp", batch_size=BATCH, workers=stages, schedule="pipedream",
                stages=[StagePlan(a, b, 1, (i,), 1.0) for i, (a, b) in enumerate(LAYOUTS[stages])],
                bottleneck_ms=1.0, data_parallel_ms=1.0)


def reference(replicas: int, local_steps: int, runs: list[list]) -> tuple[list[float], list]:
    """Each run's minibatches in order; returns the losses and each copy's parameters."""
    model = mlp()
    copies = [copy.deepcopy(model) for _ in range(replicas)]
    optimizers = [sgd(list(c.parameters())) for c in copies]
    losses = []
    for batches in runs:
        for m, (x, y) in enumerate(batches):
            c = m % replicas
            optimizers[c].zero_grad()
            loss = loss_fn(copies[c](x), y)
            loss.backward()
            optimizers[c].step()
            losses.append(loss.item())
            if (m + 1) % (replicas * local_steps) == 0:
                with torch.no_grad():
                    for params in zip(*(c.parameters() for c in copies)):
                        mean = torch.stack(params).mean(dim=0)
                        for p in params:
                            p.copy_(mean)
    return losses, [[p.detach().clone() for p in c.parameters()] for c in copies]


def stage_copies(runtime) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in c.params] for c in runtime.copies]


def pipeline_job(rank: int, world: int, cases: list, resume: tuple | None, folder: str) -> dict:
    """Each case trains one Pipeline; returns per case the losses, rank 0's state_dict and
    this rank's stage copies (stage index -> copies -> tensors)."""
    out = {}
    for stages, r, h, steps in cases:
        pipe = Pipeline(mlp(), loss_fn, sgd, plan=plan_for(stages), schedule="localsgd",
                        local_steps=h, model_replicas=r, timeout=60)
        losses = [float(loss) for loss in pipe.train(data(steps), steps=steps)]
        copies = {i: stage_copies(rt) for i, rt in pipe._stages.runtimes.items()}
        out[(r, h, steps)] = (losses, pipe.state_dict(), copies)
        pipe.close()
    if resume is not None:
        stages, r, h, (first, second) = resume
        pipe = Pipeline(mlp(), loss_fn, sgd, plan=plan_for(stages), schedule="localsgd",
                        local_steps=h, model_replicas=r, timeout=60)
        losses = [float(loss) for loss in pipe.train(data(first), steps=first)]
        pipe.save(folder)
        pipe.close()
        restored = Pipeline.load(folder, mlp(), loss_fn, sgd, schedule="localsgd",
                                 local_steps=h, model_replicas=r, timeout=60)
        losses += [float(loss) for loss in restored.train(data(second, seed=2), steps=second)]
        copies = {i: stage_copies(rt) for i, rt in restored._stages.runtimes.items()}
        out["resume"] = (losses, restored.state_dict(), copies)
        restored.close()
    return out


def check(stages: int, r: int | None, h: int, runs: list[list], losses: list[float],
          state: dict | None, copies_by_stage: list[dict]) -> None:
    replicas = stages if r is None else r
    want_losses, want_copies = reference(replicas, h, runs)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                               atol=1e-5, rtol=1e-4)
    # Parameters of the MLP in order: (weight, bias) of blocks 0, 2, 4.
    keys = [f"{b}.{n}" for b in (0, 2, 4) for n in ("weight", "bias")]
    if state is not None:  # copy 0 is the model that state_dict (and export) gives
        for key, want in zip(keys, want_copies[0]):
            torch.testing.assert_close(state[key], want, atol=1e-5, rtol=1e-4, msg=key)
    # Every copy of every stage, from the rank holding it.
    found = {}
    for per_rank in copies_by_stage:
        found.update(per_rank)
    offsets = [sum(1 for _ in mlp()[:a].parameters()) for a, _ in LAYOUTS[stages]]
    assert sorted(found) == list(range(stages))
    for stage, copies in found.items():
        assert len(copies) == replicas
        for c, tensors in enumerate(copies):
            for i, t in enumerate(tensors):
                torch.testing.assert_close(t, want_copies[c][offsets[stage] + i], atol=1e-5,
                                           rtol=1e-4, msg=f"stage {stage} copy {c} tensor {i}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("localsgd") / "ckpt")
    return launch(pipeline_job, 2, CASES[2], RESUME, folder, timeout=120)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return launch(pipeline_job, 3, CASES[3], None, "", timeout=120)


@pytest.mark.parametrize("case", CASES[2])
def test_two_processes_equal_reference_localsgd(two_ranks, case):
    stages, r, h, steps = case
    losses, state, _ = two_ranks[0][(r, h, steps)]
    for rank in two_ranks:  # every rank yields every step's loss
        assert rank[(r, h, steps)][0] == losses
    check(stages, r, h, [data(steps)], losses, state, [o[(r, h, steps)][2] for o in two_ranks])


@pytest.mark.parametrize("case", CASES[3])
def test_three_processes_equal_reference_localsgd(three_ranks, case):
    stages, r, h, steps = case
    losses, state, _ = three_ranks[0][(r, h, steps)]
    check(stages, r, h, [data(steps)], losses, state, [o[(r, h, steps)][2] for o in three_ranks])


def test_save_and_load_keep_every_copy_and_its_optimizer_state(two_ranks):
    stages, r, h, (first, second) = RESUME
    losses, state, _ = two_ranks[0]["resume"]
    # The partial round leaves the copies apart when saving: resuming exactly needs every
    # copy's weights and momentum (rounds start again with the second train call).
    check(stages, r, h, [data(first), data(second, seed=2)], losses, state,
          [o["resume"][2] for o in two_ranks])


@pytest.mark.parametrize("case", CASES[2] + CASES[3])
def test_local_pipeline_threads_equal_reference_localsgd(case):
    stages, r, h, steps = case
    pipe = LocalPipeline(mlp(), loss_fn, sgd, plan_for(stages), schedule="localsgd",
                         local_steps=h, model_replicas=r, timeout=60)
    losses = [float(loss) for loss in pipe.train(data(steps), steps)]
    copies = {stage: stage_copies(rt) for p in pipe._ranks for stage, rt in p._stages.runtimes.items()}
    check(stages, r, h, [data(steps)], losses, pipe.state_dict(), [copies])


def test_local_pipeline_runs_continue_with_the_same_copies():
    pipe = LocalPipeline(mlp(), loss_fn, sgd, plan_for(2), schedule="localsgd",
                         local_steps=1, model_replicas=2, timeout=60)
    losses = [float(loss) for loss in pipe.train(data(3), 3)]
    losses += [float(loss) for loss in pipe.train(data(4, seed=2), 4)]
    copies = {stage: stage_copies(rt) for p in pipe._ranks for stage, rt in p._stages.runtimes.items()}
    check(2, 2, 1, [data(3), data(4, seed=2)], losses, pipe.state_dict(), [copies])


@pytest.mark.parametrize("kwargs, match", [
    ({"chunks": 2}, "not chunks=2"),
    ({"microbatch_size": 2}, "not microbatch_size=2"),
    ({"local_steps": 0}, "local_steps must be an integer >= 1"),
    ({"model_replicas": 0}, "model_replicas must be an integer >= 1"),
    ({"model_replicas": 1.5}, "model_replicas must be an integer >= 1"),
])
def test_pipeline_refuses_bad_localsgd_options(kwargs, match):
    # Checked before the Pipeline joins a process group.
    with pytest.raises(ValueError, match=match):
        Pipeline(mlp(), loss_fn, sgd, schedule="localsgd", **kwargs)


def test_local_steps_and_model_replicas_apply_only_to_localsgd():
    with pytest.raises(ValueError, match="is an option of localsgd, not of"):
        Pipeline(mlp(), loss_fn, sgd, schedule="1f1b", local_steps=2)
    with pytest.raises(ValueError, match="is an option of localsgd, not of"):
        LocalPipeline(mlp(), loss_fn, sgd, plan_for(2), schedule="pipedream", model_replicas=2)


def test_local_pipeline_refuses_chunks_with_localsgd():
    with pytest.raises(ValueError, match="not chunks=2"):
        LocalPipeline(mlp(), loss_fn, sgd, plan_for(2), schedule="localsgd", chunks=2)


def test_localsgd_refuses_replicated_stages():
    plan = Plan(model="mlp", batch_size=BATCH, workers=3, schedule="pipedream",
                stages=[StagePlan(0, 3, 2, (0, 1), 1.0), StagePlan(3, 5, 1, (2,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    pipe = LocalPipeline(mlp(), loss_fn, sgd, plan, schedule="localsgd", timeout=60)
    with pytest.raises(ValueError, match="replicates the whole model"):
        list(pipe.train(data(2), 2))
