"""Issue 9's "done when": `Pipeline` is a drop-in for a one-process training loop.

Every scenario runs on 2 processes (gloo) inside ONE launched job (process start-up dominates
on 2 cores) and is compared with a one-process reference computed here, in the test process:

* a shuffling DataLoader (no explicit generator) over a task that is learnable only when the
  labels stay with their inputs, with dropout, over several epochs: trains as well as one
  process, and the loader is left usable; a DistributedSampler is handled or refused;
* precision="bf16" equals one process under torch.autocast within bf16 tolerance;
* a weight tied across two stages (embedding and output head) equals one process exactly;
* global gradient clipping and an LR scheduler equal torch's clip_grad_norm_ and scheduler;
* evaluate() and predict() equal model.eval() under no_grad, on every rank;
* plan=None without example inputs, balance= and split_points= (and errors naming blocks);
* pipe.optimizers are the live optimizers; the loss is yielded on every rank.

Each scenario is caught separately in the job, so one missing feature fails its own tests only.
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import shutil
import tempfile
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from pipedream_fast.launch import launch
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
from pipedream_fast.training import GLOBAL_STATE
from pipedream_fast.world import ThreadShared, ThreadWorld
from runtime_reference import train_reference, train_reference_with

WORLD = 2
CHUNKS = 2
BATCH = 8
EPOCHS = 3
TIMEOUT = 20.0  # every transfer and collective of a scenario; bounds a stuck scenario


# --- models and data (built identically in every process) -----------------------------------

def built_alone(build: Callable[..., Any]) -> Callable[..., Any]:
    """Seeded construction holds the process's random state: rank threads take turns."""
    @functools.wraps(build)
    def alone(*args: Any, **kwargs: Any) -> Any:
        with GLOBAL_STATE:
            return build(*args, **kwargs)
    return alone


@built_alone
def classifier() -> nn.Sequential:
    """4 blocks (fc1, act, drop, out), with dropout; ~420 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 32), act=nn.ReLU(), drop=nn.Dropout(0.1),
                                     out=nn.Linear(32, 4)))


def class_data(n: int = 128) -> TensorDataset:
    """Labels are a fixed function of the inputs (argmax of a linear map, 4 classes): high
    accuracy is reachable only if every label meets its own input; shuffled labels stay near
    the majority class (a third)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.02)


def sgd(lr: float = 0.1, momentum: float = 0.9) -> Callable[[list[nn.Parameter]], Any]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).float().mean()


MLP5_BLOCKS = ["fc1", "act1", "fc2", "act2", "head"]


@built_alone
def mlp5() -> nn.Sequential:
    """5 named blocks, ~1.8k parameters."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(16, 32), act1=nn.Tanh(),
                                     fc2=nn.Linear(32, 32), act2=nn.Tanh(),
                                     head=nn.Linear(32, 5)))


def mlp_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(steps)]


VOCAB, DIM, SEQ = 11, 8, 6


class TiedHead(nn.Module):
    """The output layer reuses the embedding's weight: one Parameter, two blocks."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.weight = embed.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.weight)


@built_alone
def tiny_lm() -> nn.Sequential:
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    return nn.Sequential(OrderedDict(embed=embed, mix=nn.Linear(DIM, DIM), act=nn.Tanh(),
                                     head=TiedHead(embed)))


def lm_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((x, (x + 1) % VOCAB))
    return out


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def clip_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 10.0 * nn.functional.cross_entropy(out, y)  # large gradients: clipping is active


CLIP, LR_STEPS, TIED_STEPS, BF16_STEPS, PLAN_STEPS = 0.5, 4, 4, 6, 3


GPT_VOCAB, GPT_DIM, GPT_SEQ, GPT_STEPS = 64, 32, 8, 4
GPT_BALANCE = [3, 3]  # wte, wpe, h.0 | h.1, ln_f, lm_head: the tied weight on both stages
# The global gradient norms here are 0.85-0.95; "idle" lies between them and the norm
# that counted the tied weight twice (1.1-1.2), which clipped where one process does not.
GPT_CLIPS = {"engaged": 0.3, "idle": 1.05}


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(GPT_DIM)
        self.fc = nn.Linear(GPT_DIM, 4 * GPT_DIM)
        self.proj = nn.Linear(4 * GPT_DIM, GPT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(nn.functional.gelu(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    """nanoGPT's layout: token and position embeddings, blocks, a final LayerNorm and a head
    whose weight *is* the token embedding's (`transformer.wte.weight = lm_head.weight`)."""

    @built_alone
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(GPT_VOCAB, GPT_DIM), wpe=nn.Embedding(GPT_SEQ, GPT_DIM),
            h=nn.ModuleList([GPTBlock(), GPTBlock()]), ln_f=nn.LayerNorm(GPT_DIM)))
        self.lm_head = nn.Linear(GPT_DIM, GPT_VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randint(0, GPT_VOCAB, (BATCH, GPT_SEQ), generator=g)
        out.append((x, (x * 7 + 1) % GPT_VOCAB))
    return out


def gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, GPT_VOCAB), y.reshape(-1))


DP_STEPS, NAN_STEP, AFTER_NAN = 4, 2, 2
DP_CLIPS = {"engaged": 0.3, "idle": 1.5}  # the global gradient norms here are 0.6-1.0


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class RecordingDataset(Dataset):
    """Remembers which indices this process read (num_workers=0: the loader runs here)."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        self.seen.append(int(index))
        return self.base[index]


# --- the job: every scenario on every rank, each caught on its own ---------------------------

# The rank's world while a scenario runs as a thread (the `job` fixture's "threads" variant):
# the same per-rank Pipeline code, its collectives meeting in memory and its tensors handed
# over through the activation queues instead of gloo.
THREAD_WORLD: contextvars.ContextVar[ThreadWorld | None] = contextvars.ContextVar(
    "THREAD_WORLD", default=None)


def pipeline(*args: Any, **kwargs: Any) -> Pipeline:
    """A Pipeline rank of the scenario's world: this process's, or this thread's."""
    world = THREAD_WORLD.get()
    if world is not None:
        kwargs["_world"] = world
    return Pipeline(*args, **kwargs)


def floats(losses: Any) -> list[float | None]:
    return [None if x is None else float(x) for x in losses]


def two_stage(model: nn.Module, loss_fn: Callable, optimizer: Callable, balance: list[int],
              **kwargs: Any) -> Pipeline:
    return pipeline(model, loss_fn, optimizer, schedule="1f1b", chunks=CHUNKS, balance=balance,
                    timeout=TIMEOUT, **kwargs)


def scenario_loader(rank: int, world: int, out: dict[str, Any]) -> None:
    """Items 1, 5 and 7 on one pipeline: a shuffling loader with dropout for EPOCHS epochs,
    the loader reused, the optimizers checked live, then evaluation and prediction."""
    data = class_data()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    pipe = two_stage(classifier(), cross_entropy, adam, [2, 2])
    try:
        out["stages"] = list(pipe.stage_indices)
        out["losses"] = floats(pipe.train(loader, epochs=EPOCHS))
        out["trained"] = pipe.state_dict()
        # The loader is left as it was: a full epoch of its batches, then train() again.
        out["after_len"] = len(loader)
        out["after_samples"] = sum(len(y) for _, y in loader)
        out["again"] = floats(pipe.train(loader, epochs=1))
        # pipe.optimizers are this rank's live optimizers: lr 0 freezes the weights.
        optimizers = pipe.optimizers
        out["optimizers"] = [type(o).__name__ for o in optimizers]
        out["optimizers_match"] = [
            {id(p) for p in pipe.stage_modules[i].parameters()}
            == {id(p) for g in o.param_groups for p in g["params"]}
            for i, o in zip(pipe.stage_indices, optimizers)]
        out["schedulers"] = len(pipe.schedulers)
        before = pipe.state_dict()
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = 0.0
        list(pipe.train(loader, steps=2))
        frozen = pipe.state_dict()
        out["final"] = frozen
        if rank == 0:
            out["frozen_moved"] = max((before[k] - frozen[k]).abs().max().item() for k in before)
        # Evaluation and prediction, on the training set in order.
        ordered = DataLoader(data, batch_size=BATCH, shuffle=False)
        out["evaluate"] = pipe.evaluate(ordered, metrics={"accuracy": accuracy})
        x = data.tensors[0][:BATCH]
        out["predict_everywhere"] = pipe.predict(x, everywhere=True)
        out["predict"] = pipe.predict(x)
        after = pipe.state_dict()
        if rank == 0:
            out["eval_moved"] = max((after[k] - frozen[k]).abs().max().item() for k in after)
    finally:
        pipe.close()


def scenario_ragged_evaluate(rank: int, world: int, out: dict[str, Any]) -> None:
    """evaluate() over a loader whose last batch is smaller (36 = 4 x 8 + 4)."""
    pipe = two_stage(classifier(), cross_entropy, adam, [2, 2])
    try:
        loader = DataLoader(Subset(class_data(), range(36)), batch_size=BATCH)
        out["evaluate"] = pipe.evaluate(loader, metrics={"accuracy": accuracy})
    finally:
        pipe.close()


def scenario_distributed_sampler(rank: int, world: int, out: dict[str, Any]) -> None:
    data = RecordingDataset(class_data(64))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    pipe = two_stage(classifier(), cross_entropy, adam, [2, 2])
    out["stages"] = list(pipe.stage_indices)
    try:
        out["steps"] = len(list(pipe.train(loader, epochs=1)))
        out["seen"] = sorted(set(data.seen))
    except Exception as err:  # noqa: BLE001 - refusing is one of the accepted outcomes
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        pipe.close()


def scenario_bf16(rank: int, world: int, out: dict[str, Any]) -> None:
    pipe = two_stage(mlp5(), cross_entropy, sgd(0.2), [2, 3], precision="bf16")
    try:
        out["losses"] = floats(pipe.train(mlp_batches(BF16_STEPS), steps=BF16_STEPS))
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_tied(rank: int, world: int, out: dict[str, Any]) -> None:
    pipe = two_stage(tiny_lm(), lm_loss, sgd(0.5), [2, 2])
    try:
        out["stages"] = list(pipe.stage_indices)
        out["losses"] = floats(pipe.train(lm_batches(TIED_STEPS), steps=TIED_STEPS))
        out["tied"] = [p.detach().clone() for i in pipe.stage_indices
                       for p in pipe.stage_modules[i].parameters() if p.shape == (VOCAB, DIM)]
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_clip_and_scheduler(rank: int, world: int, out: dict[str, Any]) -> None:
    pipe = two_stage(mlp5(), clip_loss, sgd(0.1), [2, 3], clip_grad_norm=CLIP,
                     scheduler=step_lr)
    try:
        list(pipe.train(mlp_batches(LR_STEPS), steps=LR_STEPS))
        out["lrs"] = [s.get_last_lr() for s in pipe.schedulers]
        out["optimizer_lrs"] = [[g["lr"] for g in o.param_groups] for o in pipe.optimizers]
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_tied_clip(rank: int, world: int, out: dict[str, Any]) -> None:
    """nanoGPT's tied embedding and head on two stages, clipped by the global norm."""
    for name, clip in GPT_CLIPS.items():
        pipe = two_stage(TinyGPT(), gpt_loss, sgd(0.5, 0.0), GPT_BALANCE, clip_grad_norm=clip)
        try:
            out[f"{name}_losses"] = floats(pipe.train(gpt_batches(GPT_STEPS), steps=GPT_STEPS))
            out[name] = pipe.state_dict()
        finally:
            pipe.close()


def scenario_data_parallel(rank: int, world: int, out: dict[str, Any]) -> None:
    """Both ranks replicate the whole model: global clipping and the losses yielded."""
    for name, clip, chunks in [(n, c, CHUNKS) for n, c in DP_CLIPS.items()] + [("one", None, 1)]:
        pipe = pipeline(mlp5(), cross_entropy, sgd(0.1), schedule="data-parallel", chunks=chunks,
                        clip_grad_norm=clip, timeout=TIMEOUT)
        try:
            out[f"{name}_losses"] = floats(pipe.train(mlp_batches(DP_STEPS), steps=DP_STEPS))
            out[name] = pipe.state_dict()
            out[f"{name}_stages"] = [s.ranks for s in pipe.plan.stages]
        finally:
            pipe.close()


def nan_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DP_STEPS batches; step NAN_STEP's second microbatch (replica 1's share) is NaN."""
    batches = mlp_batches(DP_STEPS)
    batches[NAN_STEP][0][BATCH - 1, 0] = float("nan")
    return batches


def scenario_replica_nan(rank: int, world: int, out: dict[str, Any]) -> None:
    """A NaN loss that only one replica computes stops both at the same step, unapplied."""
    pipe = pipeline(mlp5(), cross_entropy, sgd(0.1), schedule="data-parallel", chunks=CHUNKS,
                    timeout=TIMEOUT)
    try:
        losses: list[float | None] = []
        try:
            for loss in pipe.train(nan_batches(), steps=DP_STEPS):
                losses.append(float(loss))
        except NonFiniteLoss as err:
            out["error"] = str(err)
        out["losses"] = losses
        out["after"] = floats(pipe.train(mlp_batches(AFTER_NAN, seed=7), steps=AFTER_NAN))
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_plan_none(rank: int, world: int, out: dict[str, Any]) -> None:
    pipe = pipeline(mlp5(), cross_entropy, sgd(), plan=None, schedule="1f1b", chunks=CHUNKS,
                    timeout=TIMEOUT)
    try:
        out["losses"] = floats(pipe.train(mlp_batches(PLAN_STEPS), steps=PLAN_STEPS))
        out["workers"] = pipe.plan.workers
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_stages(rank: int, world: int, out: dict[str, Any]) -> None:
    pipe = pipeline(mlp5(), cross_entropy, sgd(), stages=2, schedule="1f1b", chunks=CHUNKS,
                    timeout=TIMEOUT)
    try:
        list(pipe.train(mlp_batches(PLAN_STEPS), steps=PLAN_STEPS))
        out["stages"] = [(s.start, s.stop, tuple(s.ranks)) for s in pipe.plan.stages]
        out["state"] = pipe.state_dict()
    finally:
        pipe.close()


def scenario_manual_splits(rank: int, world: int, out: dict[str, Any]) -> None:
    for key, kwargs in (("balance", {"balance": [2, 3]}),
                        ("split_points", {"split_points": ["act2"]})):
        pipe = pipeline(mlp5(), cross_entropy, sgd(), schedule="1f1b", chunks=CHUNKS,
                        timeout=TIMEOUT, **kwargs)
        out[key] = [(s.start, s.stop, tuple(s.ranks)) for s in pipe.plan.stages]
        pipe.close()


def scenario_wrong_balance(rank: int, world: int, out: dict[str, Any]) -> None:
    try:
        pipe = pipeline(mlp5(), cross_entropy, sgd(), schedule="1f1b", chunks=CHUNKS,
                        balance=[2, 2], timeout=TIMEOUT)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        out["message"] = f"{type(err).__name__}: {err}"
        return
    pipe.close()
    out["message"] = "no error"


# Riskier scenarios last: a rank failing alone leaves its peer waiting for the timeout.
SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], None]] = {
    "loader": scenario_loader,
    "tied": scenario_tied,
    "clip_and_scheduler": scenario_clip_and_scheduler,
    "tied_clip": scenario_tied_clip,
    "data_parallel": scenario_data_parallel,
    "replica_nan": scenario_replica_nan,
    "bf16": scenario_bf16,
    "manual_splits": scenario_manual_splits,
    "wrong_balance": scenario_wrong_balance,
    "plan_none": scenario_plan_none,
    "stages": scenario_stages,
    "distributed_sampler": scenario_distributed_sampler,
    "ragged_evaluate": scenario_ragged_evaluate,
}


Outcome = tuple[dict[str, Any], "str | None"]  # what a scenario recorded, its traceback


def dropin_job(rank: int, world: int, stores: list[str]) -> dict[str, Outcome]:
    """Every scenario in turn, each on a process group of its own: a scenario that fails on
    one rank only leaves its peer waiting for the timeout and breaks their gloo pair, and
    the next scenario must not inherit that. Each scenario records its results as it goes, so
    a failure late in it (say, in evaluate) leaves the checks of its earlier parts to run."""
    results: dict[str, Outcome] = {}
    for (name, scenario), store in zip(SCENARIOS.items(), stores):
        out: dict[str, Any] = {}
        try:
            dist.destroy_process_group()
            # A file store per scenario: ports picked ahead of the job could be taken by then.
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=2 * TIMEOUT))
            scenario(rank, world, out)
            results[name] = (out, None)
        except Exception:  # noqa: BLE001 - reported by the scenario's own tests
            results[name] = (out, traceback.format_exc())
    return results


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """The references here are tiny: intra-op threads only contend for the 2 shared cores
    (a 4x8 matmul took 7 ms with 2 threads under load, 0.1 ms with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def threads_job(world: int) -> list[dict[str, Outcome]]:
    """Every scenario with its ranks as threads of this process, each scenario in a world
    of its own (as `dropin_job` gives each a process group of its own)."""
    results: list[dict[str, Outcome]] = [{} for _ in range(world)]

    def rank_thread(rank: int, name: str, shared: ThreadShared) -> None:
        out: dict[str, Any] = {}
        THREAD_WORLD.set(ThreadWorld(rank, shared))
        try:
            SCENARIOS[name](rank, world, out)
            results[rank][name] = (out, None)
        except Exception:  # noqa: BLE001 - reported by the scenario's own tests
            results[rank][name] = (out, traceback.format_exc())
            shared.abort(f"rank {rank} failed")  # its peers must not wait for it

    for name in SCENARIOS:
        shared = ThreadShared(world, 2 * TIMEOUT)
        threads = [threading.Thread(target=rank_thread, args=(r, name, shared), daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * TIMEOUT)
    return results


@pytest.fixture(scope="module", params=["processes", "threads"])
def job(request: Any) -> list[dict[str, Outcome]]:
    """Every scenario on 2 ranks: processes (one launched job) or threads of this process."""
    if request.param == "threads":
        return threads_job(WORLD)
    folder = tempfile.mkdtemp(prefix="dropin-stores-")
    try:
        return launch(dropin_job, WORLD, [os.path.join(folder, name) for name in SCENARIOS],
                      timeout=60, threads_per_rank=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def result(job: list[dict[str, Outcome]], name: str, rank: int, *keys: str) -> dict[str, Any]:
    """What scenario `name` recorded on `rank`; fails with its traceback unless it finished,
    or at least recorded `keys`."""
    out, error = job[rank][name]
    missing = [k for k in keys if k not in out]
    if error is not None and (missing or not keys):
        pytest.fail(f"scenario {name!r} failed on rank {rank} before recording "
                    f"{missing or 'everything'}:\n{error}")
    assert not missing, f"scenario {name!r} did not record {missing} on rank {rank}"
    return out


# --- one-process references -----------------------------------------------------------------

def eval_metrics(model: nn.Module, data: TensorDataset) -> dict[str, float]:
    """model.eval() under no_grad; per-sample means over the whole dataset (which is what
    sample-weighted means of per-microbatch means come to)."""
    model.eval()
    x, y = data.tensors if isinstance(data, TensorDataset) else \
        tuple(torch.stack(t) for t in zip(*[data[i] for i in range(len(data))]))
    with torch.no_grad():
        out = model(x)
    return {"loss": cross_entropy(out, y).item(), "accuracy": accuracy(out, y).item()}


def loaded(factory: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    model = factory()
    model.load_state_dict(state)
    return model


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                      atol: float = 2e-5, rtol: float = 1e-4) -> None:
    """`got` (pipe.state_dict()) holds every parameter and buffer under its original name;
    a tied weight may appear under one of its names or under all of them."""
    model_keys = set(want)
    assert set(got) <= model_keys, f"unknown keys {sorted(set(got) - model_keys)}"
    for key in model_keys - set(got):  # only the other names of a tied weight may be missing
        assert any(torch.equal(want[key], want[k]) for k in got), f"missing {key}"
    for key in got:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=key)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)


def one_process_loader_run(seed: int, mismatched: bool = False) -> dict[str, float]:
    """What the loader scenario does, in one process: same model, loader settings, optimizer,
    chunks and number of updates. `mismatched` feeds the targets of an independently shuffled
    second loader: the failure a pipeline would have if labels did not travel with inputs."""
    data = class_data()
    model = classifier()
    torch.manual_seed(seed)  # the shuffles and the dropout masks
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    other = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)

    def epochs() -> Any:
        for _ in range(EPOCHS):
            if mismatched:
                yield from ((x, y) for (x, _), (_, y) in zip(loader, other))
            else:
                yield from loader
    state = train_reference_with(model, epochs(), CHUNKS, cross_entropy, adam)
    return eval_metrics(loaded(classifier, state), data)


# --- 1. a shuffling DataLoader with dropout, over several epochs ------------------------------

ACCURACY_FLOOR = 0.85  # one process reaches >= 0.95 here; mismatched labels <= 0.55


def test_a_label_mismatch_would_be_caught():
    """The teeth of the next test: the task is not learnable when labels miss their inputs."""
    good = one_process_loader_run(seed=0)
    bad = [one_process_loader_run(seed=s, mismatched=True)["accuracy"] for s in (0, 1)]
    assert good["accuracy"] >= 0.95 > ACCURACY_FLOOR
    assert max(bad) < ACCURACY_FLOOR - 0.2, bad


def test_shuffling_loader_with_dropout_trains_as_well_as_one_process(job):
    got = result(job, "loader", 0, "trained", "losses")
    metrics = eval_metrics(loaded(classifier, got["trained"]), class_data())
    want = one_process_loader_run(seed=0)
    # One process over 10 shuffle/dropout seeds: accuracy 0.95-0.98, loss 0.19-0.22.
    assert metrics["accuracy"] >= ACCURACY_FLOOR, (metrics, want)
    assert abs(metrics["accuracy"] - want["accuracy"]) <= 0.06, (metrics, want)
    assert abs(metrics["loss"] - want["loss"]) <= 0.1, (metrics, want)
    steps = EPOCHS * (len(class_data()) // BATCH)
    losses = got["losses"]
    assert len(losses) == steps
    # The training losses fall the way one process's do: the last epoch's mean is low.
    last_epoch = losses[-steps // EPOCHS:]
    assert sum(last_epoch) / len(last_epoch) < 0.5 * losses[0], losses


def test_the_loader_is_usable_after_train(job):
    for rank in range(WORLD):
        got = result(job, "loader", rank, "after_len", "after_samples", "again")
        assert got["after_len"] == len(class_data()) // BATCH
        assert got["after_samples"] == len(class_data())
        again = got["again"]
        assert len(again) == len(class_data()) // BATCH  # a second train(loader, epochs=1)
        assert all(x is not None and math.isfinite(x) for x in again)


def test_a_distributed_sampler_is_handled_or_refused(job):
    outcomes = [result(job, "distributed_sampler", rank) for rank in range(WORLD)]
    if any("error" in o for o in outcomes):
        for rank, o in enumerate(outcomes):
            assert "DistributedSampler" in o.get("error", ""), (rank, o)
        return
    # Handled: one replica of the first stage, so it must have read every sample in the epoch
    # (a DistributedSampler left as is would feed it only its half: silently wrong).
    for rank, o in enumerate(outcomes):
        assert o["steps"] == 64 // BATCH, (rank, o)
        if 0 in o["stages"]:
            assert o["seen"] == list(range(64)), (rank, o["seen"])


# --- 2. bf16 ----------------------------------------------------------------------------------

def test_bf16_equals_one_process_under_autocast(job):
    """Each stage runs the one-process autocast's very ops (the activation crosses the cut in
    bf16, as it flows in one process), so the result is equal up to float summation order,
    far closer than to fp32 training, from which bf16 ends ~1e-3 away."""
    got = result(job, "bf16", 0, "state")["state"]
    batches = mlp_batches(BF16_STEPS)
    want = train_reference_with(mlp5(), batches, CHUNKS, cross_entropy, sgd(0.2),
                                autocast_dtype=torch.bfloat16)
    fp32 = train_reference_with(mlp5(), batches, CHUNKS, cross_entropy, sgd(0.2))
    atol = 2e-5
    assert_same_state(got, want, atol=atol, rtol=1e-4)
    assert set(got) == set(want)
    assert max_difference(got, fp32) > 10 * atol  # teeth: fp32 training ends elsewhere
    initial = mlp5().state_dict()
    assert max_difference(got, initial) > 1e-2  # it did train
    losses = [result(job, "bf16", r, "losses")["losses"] for r in range(WORLD)]
    assert all(len(x) == BF16_STEPS and all(map(math.isfinite, x)) for x in losses)


# --- 3. tied weights across stages --------------------------------------------------------------

def test_a_weight_tied_across_stages_trains_like_one_process(job):
    ranks = [result(job, "tied", r, "stages", "tied") for r in range(WORLD)]
    ranks[0] = result(job, "tied", 0, "state")
    assert [r["stages"] for r in ranks] == [[0], [1]]
    want = train_reference(tiny_lm(), lm_batches(TIED_STEPS), CHUNKS, lm_loss, sgd(0.5))
    got = ranks[0]["state"]
    assert "embed.weight" in got or "head.weight" in got
    assert_same_state(got, want)
    # Both stages hold the tied weight (embedding on stage 0, head on stage 1), and it is the
    # same after training: the sum of both stages' gradients updated both copies.
    tied = [t for r in ranks for t in r["tied"]]
    assert len(tied) == 2, [len(r["tied"]) for r in ranks]
    torch.testing.assert_close(tied[0], tied[1], atol=0, rtol=0)
    torch.testing.assert_close(tied[0], want["embed.weight"], atol=2e-5, rtol=1e-4)
    # Teeth: each stage updating its copy with its own gradient only ends elsewhere.
    untied = tiny_lm()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    alone = train_reference(untied, lm_batches(TIED_STEPS), CHUNKS, lm_loss, sgd(0.5))
    assert (alone["embed.weight"] - want["embed.weight"]).abs().max() > 1e-3
    assert (alone["head.weight"] - want["head.weight"]).abs().max() > 1e-3


# --- 4. global gradient clipping and an LR scheduler ------------------------------------------

def test_global_clipping_and_scheduler_equal_one_process(job):
    batches = mlp_batches(LR_STEPS)
    norms: list[float] = []
    want = train_reference_with(mlp5(), batches, CHUNKS, clip_loss, sgd(0.1),
                                clip_grad_norm=CLIP, make_scheduler=step_lr, norms=norms)
    assert min(norms) > 2 * CLIP, norms  # clipping is active on every update
    got = result(job, "clip_and_scheduler", 0, "state")
    assert_same_state(got["state"], want)
    assert set(got["state"]) == set(want)
    # Teeth: without clipping, or with per-stage clipping, or without the scheduler, it differs.
    unclipped = train_reference_with(mlp5(), batches, CHUNKS, clip_loss, sgd(0.1),
                                     make_scheduler=step_lr)
    constant = train_reference_with(mlp5(), batches, CHUNKS, clip_loss, sgd(0.1),
                                    clip_grad_norm=CLIP)
    assert max_difference(want, unclipped) > 1e-2
    assert max_difference(want, constant) > 1e-3
    for rank in range(WORLD):
        got = result(job, "clip_and_scheduler", rank, "lrs", "optimizer_lrs")
        assert got["lrs"] == [[0.1 * 0.5 ** LR_STEPS]], got["lrs"]
        assert got["optimizer_lrs"] == [[0.1 * 0.5 ** LR_STEPS]], got["optimizer_lrs"]


def test_per_stage_clipping_would_differ():
    """Clipping each stage by its own norm is the likely wrong implementation: show it ends
    elsewhere than the global clipping the previous test demands."""
    batches = mlp_batches(LR_STEPS)
    want = train_reference_with(mlp5(), batches, CHUNKS, clip_loss, sgd(0.1),
                                clip_grad_norm=CLIP, make_scheduler=step_lr)
    model = mlp5()
    stages = [list(model[:2].parameters()), list(model[2:].parameters())]
    optimizer = sgd(0.1)(list(model.parameters()))
    scheduler = step_lr(optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            (clip_loss(model(xs), ys) / CHUNKS).backward()
        for params in stages:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        scheduler.step()
    assert max_difference(want, model.state_dict()) > 1e-3


@pytest.mark.parametrize("name", GPT_CLIPS)
def test_global_clipping_with_a_weight_tied_across_stages_equals_one_process(job, name):
    """The tied weight's gradient counts once in the global norm, as in one process (the
    stages' norms once summed the whole of a stage's flat gradient buffer under its first
    parameter, so the tied weight counted twice or not at all)."""
    clip = GPT_CLIPS[name]
    norms: list[float] = []
    want = train_reference_with(TinyGPT(), gpt_batches(GPT_STEPS), CHUNKS, gpt_loss,
                                sgd(0.5, 0.0), clip_grad_norm=clip, norms=norms)
    if name == "engaged":
        assert min(norms) > 2 * clip, norms
        unclipped = train_reference_with(TinyGPT(), gpt_batches(GPT_STEPS), CHUNKS, gpt_loss,
                                         sgd(0.5, 0.0))
        assert max_difference(want, unclipped) > 1e-3  # teeth: clipping changes the result
    else:
        assert max(norms) < clip, norms
    got = result(job, "tied_clip", 0, name)[name]
    assert_same_state(got, want, atol=1e-6, rtol=1e-5)
    assert "lm_head.weight" in got or "transformer.wte.weight" in got


@pytest.mark.parametrize("name", DP_CLIPS)
def test_global_clipping_of_a_replicated_stage_equals_one_process(job, name):
    """The norm is that of the averaged gradient, whether or not clipping engages (the
    replicas' gradients were once reduced twice, so the update and its norm doubled)."""
    clip = DP_CLIPS[name]
    norms: list[float] = []
    want = train_reference_with(mlp5(), mlp_batches(DP_STEPS), CHUNKS, cross_entropy,
                                sgd(0.1), clip_grad_norm=clip, norms=norms)
    assert (min(norms) > 2 * clip) if name == "engaged" else (max(norms) < clip), norms
    got = result(job, "data_parallel", 0, name, f"{name}_stages")
    assert got[f"{name}_stages"] == [(0, 1)]  # one stage, on both ranks
    assert_same_state(got[name], want, atol=1e-6, rtol=1e-5)


# --- 5. evaluate and predict ----------------------------------------------------------------

def test_evaluate_equals_one_process_evaluation_on_every_rank(job):
    ranks = [result(job, "loader", r, "final", "evaluate") for r in range(WORLD)]
    model = loaded(classifier, ranks[0]["final"])
    want = eval_metrics(model, class_data())
    got = ranks[0]["evaluate"]
    assert set(got) == {"loss", "accuracy"}
    assert all(isinstance(v, float) for v in got.values()), got
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert ranks[1]["evaluate"] == got  # identical dict on every rank
    # evaluate and predict never update the weights
    assert result(job, "loader", 0, "eval_moved")["eval_moved"] == 0.0


def test_evaluate_weights_a_ragged_last_batch_by_samples(job):
    data = Subset(class_data(), range(36))
    want = eval_metrics(classifier(), data)  # untrained: the scenario evaluates at once
    # The unweighted mean of the 5 batch means differs: the weighting matters here.
    model = classifier().eval()
    with torch.no_grad():
        means = [cross_entropy(model(x), y).item() for x, y in DataLoader(data, batch_size=BATCH)]
    assert abs(sum(means) / len(means) - want["loss"]) > 1e-4
    got = [result(job, "ragged_evaluate", r, "evaluate")["evaluate"] for r in range(WORLD)]
    assert got[0]["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got[0]["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert got[1] == got[0]


def test_predict_equals_the_model_in_eval_mode(job):
    ranks = [result(job, "loader", r, "final", "predict_everywhere", "predict")
             for r in range(WORLD)]
    model = loaded(classifier, ranks[0]["final"]).eval()
    with torch.no_grad():
        want = model(class_data().tensors[0][:BATCH])
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["predict_everywhere"], want, atol=1e-5, rtol=1e-4,
                                   msg=f"rank {rank}")
    last = [rank for rank, r in enumerate(ranks) if 1 in r["stages"]]
    assert last == [1]
    assert ranks[0]["predict"] is None
    torch.testing.assert_close(ranks[1]["predict"], want, atol=1e-5, rtol=1e-4)


# --- 6. plans without ceremony --------------------------------------------------------------

def test_plan_none_without_example_inputs_trains_on_the_first_minibatch(job):
    got = [result(job, "plan_none", r) for r in range(WORLD)]
    assert got[0]["workers"] == WORLD
    want = train_reference(mlp5(), mlp_batches(PLAN_STEPS), CHUNKS, cross_entropy, sgd())
    assert_same_state(got[0]["state"], want)  # 1f1b is synchronous, whatever the plan
    assert set(got[0]["state"]) == set(want)
    for r in got:
        assert len(r["losses"]) == PLAN_STEPS
        assert all(x is not None and math.isfinite(x) for x in r["losses"])


def test_stages_asks_the_planner_for_a_straight_pipeline(job):
    got = result(job, "stages", 0)
    stages = got["stages"]
    assert len(stages) == 2 and stages[0][0] == 0 and stages[1][1] == len(MLP5_BLOCKS)
    assert stages[0][1] == stages[1][0] and [s[2] for s in stages] == [(0,), (1,)]
    want = train_reference(mlp5(), mlp_batches(PLAN_STEPS), CHUNKS, cross_entropy, sgd())
    assert_same_state(got["state"], want)


def test_balance_and_split_points_give_the_expected_stages(job):
    for rank in range(WORLD):
        got = result(job, "manual_splits", rank)
        assert got["balance"] == [(0, 2, (0,)), (2, 5, (1,))]
        assert got["split_points"] == [(0, 3, (0,)), (3, 5, (1,))]  # a stage starts at act2


def test_a_wrong_balance_names_the_model_blocks(job):
    for rank in range(WORLD):
        message = result(job, "wrong_balance", rank, "message")["message"]
        assert message != "no error"
        assert all(name in message for name in MLP5_BLOCKS), message


# --- 7. optimizers and losses on every rank -------------------------------------------------

def test_optimizers_are_this_ranks_live_stage_optimizers(job):
    for rank in range(WORLD):
        got = result(job, "loader", rank, "stages", "optimizers", "optimizers_match",
                     "schedulers")
        assert got["stages"] == [rank]
        assert got["optimizers"] == ["Adam"]
        assert got["optimizers_match"] == [True]  # exactly the stage's parameters
        assert got["schedulers"] == 0
    assert result(job, "loader", 0, "frozen_moved")["frozen_moved"] == 0.0  # lr 0 set through pipe.optimizers
    # ...and the same weights trained before that: the optimizers were the ones in use.
    assert max_difference(result(job, "loader", 0, "trained")["trained"], classifier().state_dict()) > 0.1


def test_the_loss_is_yielded_on_every_rank_and_equal(job):
    for name in ("loader", "tied", "bf16"):
        losses = [result(job, name, r, "losses")["losses"] for r in range(WORLD)]
        assert all(x is not None for x in losses[0]), name
        assert losses[0] == losses[1], name


@pytest.mark.parametrize("chunks", [CHUNKS, 1])
def test_every_replica_yields_the_loss_of_the_whole_step(job, chunks):
    """Each replica computes half the microbatches of a step (none of some steps with
    chunks=1), yet every rank yields the step's mean over all of them, as one process does."""
    name = "idle" if chunks == CHUNKS else "one"
    losses: list[float] = []
    clip = DP_CLIPS["idle"] if chunks == CHUNKS else None
    train_reference_with(mlp5(), mlp_batches(DP_STEPS), chunks, cross_entropy, sgd(0.1),
                         clip_grad_norm=clip, losses=losses)
    got = [result(job, "data_parallel", r, f"{name}_losses")[f"{name}_losses"]
           for r in range(WORLD)]
    assert got[0] == got[1]
    assert got[0] == pytest.approx(losses, rel=1e-6)


def test_a_nan_on_one_replica_stops_every_rank_at_that_step_unapplied(job):
    """Only replica 1 computes the NaN loss; both ranks learn it from the step's loss, stop
    before its update, and train on from the weights before it (a rank stopping alone would
    leave its peer waiting for the timeout)."""
    got = [result(job, "replica_nan", r, "error", "losses", "after") for r in range(WORLD)]
    for r in got:
        assert "of step 3 is nan" in r["error"] and "stopped after step 2" in r["error"], r
        assert len(r["losses"]) == NAN_STEP
    assert "seen on rank 1" in got[1]["error"] and "another replica" in got[0]["error"]
    assert got[0]["losses"] == got[1]["losses"] and got[0]["after"] == got[1]["after"]
    losses: list[float] = []
    trained = mlp_batches(DP_STEPS)[:NAN_STEP] + mlp_batches(AFTER_NAN, seed=7)
    want = train_reference_with(mlp5(), trained, CHUNKS, cross_entropy, sgd(0.1),
                                losses=losses)
    assert got[0]["losses"] + got[0]["after"] == pytest.approx(losses, rel=1e-6)
    assert_same_state(result(job, "replica_nan", 0, "state")["state"], want)


# --- 8. the loss of a step with a replicated stage inside a pipeline (3 processes) -------------

SHARED_PLANS = {"last_replicated": ("1f1b", [[0], [1, 2]]),
                "first_replicated": ("gpipe", [[0, 1], [2]])}
SHARED_STEPS, SHARED_BREAK, SHARED_AGAIN = 5, 3, 2


def shared_loss_job(rank: int, world: int) -> dict[str, Any]:
    """Each plan trains SHARED_BREAK steps and leaves `train` (a break), then trains on: a
    rank that joined the loss's all-reduce too early (before the sends its peers wait for) or
    too late (after starting the next step) would hang here."""
    from pipedream_fast.formats import Plan, StagePlan
    out: dict[str, Any] = {}
    batches = mlp_batches(SHARED_STEPS + SHARED_AGAIN)
    for name, (schedule, ranks) in SHARED_PLANS.items():
        stages = [StagePlan(0, 2, len(ranks[0]), tuple(ranks[0]), 1.0),
                  StagePlan(2, 5, len(ranks[1]), tuple(ranks[1]), 1.0)]
        plan = Plan("mlp5", BATCH, world, schedule, stages, 1.0, 1.0)
        pipe = pipeline(mlp5(), cross_entropy, sgd(0.1), plan=plan, schedule=schedule,
                        chunks=CHUNKS, timeout=TIMEOUT)
        try:
            losses = []
            for loss in pipe.train(batches[:SHARED_STEPS], steps=SHARED_STEPS):
                losses.append(float(loss))
                if len(losses) == SHARED_BREAK:
                    break
            losses += floats(pipe.train(batches[SHARED_STEPS:], steps=SHARED_AGAIN))
            out[name] = losses
            out[f"{name}_state"] = pipe.state_dict()
        finally:
            pipe.close()
    return out


@pytest.fixture(scope="module")
def shared_job() -> list[dict[str, Any]]:
    return launch(shared_loss_job, 3, timeout=60, threads_per_rank=1)


@pytest.mark.parametrize("name", SHARED_PLANS)
def test_a_pipeline_with_a_replicated_stage_yields_the_whole_steps_loss(shared_job, name):
    batches = mlp_batches(SHARED_STEPS + SHARED_AGAIN)
    trained = batches[:SHARED_BREAK] + batches[SHARED_STEPS:]
    losses: list[float] = []
    want = train_reference_with(mlp5(), trained, CHUNKS, cross_entropy, sgd(0.1),
                                losses=losses)
    got = [r[name] for r in shared_job]
    assert got[0] == got[1] == got[2], got
    assert got[0] == pytest.approx(losses, rel=1e-6)
    assert_same_state(shared_job[0][f"{name}_state"], want)
