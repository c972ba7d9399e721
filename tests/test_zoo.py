"""Public model code, unedited, through `Pipeline` (issue 18's zoo): a nanoGPT-style GPT (an
`assert` in forward, the loss computed by the model, tied embedding and head), Hugging Face
Llama (GQA, rotary, tied embeddings), GPT-2 and BERT (an attention mask), torchvision's
ResNet-18 (skip connections, batch norm) and timm's ViT-tiny, at tiny sizes.

For every model, on 2 processes in ONE launched job (process start-up dominates on 2 cores),
each compared with a one-process loop computed here:

* `stages=2`, 1f1b, `chunks=2`, `clip_grad_norm` equals the loop with gradient accumulation and
  `clip_grad_norm_` to 1e-5 relative over 10 steps (losses and weights);
* `pipe.state_dict()` has exactly the model's `state_dict()` keys and loads with strict=True
  into a fresh instance, which then gives the pipeline's outputs;
* `precision="bf16"` equals the loop under `torch.autocast(bfloat16)`;
* pipedream learns (untied models), or is refused at construction naming the tied weights;
* `schedule="auto"` with no plan picks something that trains.

The same models with their real drop rates (dropout, stochastic depth, drop path), and
torchvision's Swin and EfficientNet-B0, train 2 steps, then `predict` (twice) and `evaluate`
equal the trained weights loaded into the model in eval mode.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.launch import launch
from pipedream_fast.training import model_loss, split_microbatches

# Checked without importing: torchvision can be imported only after the zoo's preparation.
_MISSING = [m for m in ("torchvision", "transformers", "timm") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"the model zoo needs {', '.join(_MISSING)}: pip install -e '.[zoo]'",
                allow_module_level=True)

from zoo import DROPPING, ZOO, ZooModel, call, one_torch_thread, relative  # noqa: E402 - after the check above

# One launched job runs every case (about 3 minutes on 2 quiet cores): its fixture's setup
# counts against the first test's timeout.
pytestmark = pytest.mark.timeout(1200)

WORLD, CHUNKS, STEPS, CLIP = 2, 2, 10, 0.5
TIMEOUT = 60.0
Outcome = tuple[dict[str, Any], str | None]


# Steps small enough that training is not chaotic: the pipeline sums in another order than
# the loop (1e-7 apart), and a chaotic run grows that past the 1e-5 bar. ResNet-18 with batch
# norm over 4-sample microbatches is chaotic at lr 0.01: the loop itself, run with 2 threads
# instead of 1, ends 1.9e-5 apart after 10 clipped steps (3.4e-6 at lr 0.001).
LR = {"resnet18": 1e-3}


def optimizer_for(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=LR.get(name, 0.01), momentum=0.9)


def split_item(entry: ZooModel, item: Any) -> tuple[Any, Any]:
    return (item, ()) if entry.loss_fn is None else (item[0], item[1])


def loss_of(entry: ZooModel, out: Any, target: Any) -> torch.Tensor:
    return model_loss(out) if entry.loss_fn is None else entry.loss_fn(out, target)


def reference(entry: ZooModel, steps: int, *, clip: float | None = None,
              autocast: torch.dtype | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop: each minibatch in CHUNKS microbatches, gradients accumulated (each
    microbatch's loss / CHUNKS), clipped over all parameters, one SGD step."""
    model = entry.build().train()
    optimizer = optimizer_for(entry.name)(list(model.parameters()))
    losses = []
    for item in entry.batches(steps, 1):
        inputs, target = split_item(entry, item)
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(split_microbatches(inputs, CHUNKS), split_microbatches(target, CHUNKS)):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = loss_of(entry, call(model, xs), ys)
            (loss / CHUNKS).backward()
            total += float(loss) / CHUNKS
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- what each rank runs ----------------------------------------------------------------------

def pipeline(entry: ZooModel, **kwargs: Any) -> Any:
    from pipedream_fast.pipeline import Pipeline
    options: dict[str, Any] = {"stages": 2, "schedule": "1f1b", "chunks": CHUNKS,
                               "timeout": TIMEOUT}
    options.update(kwargs)
    options.setdefault("optimizer", optimizer_for(entry.name))
    return Pipeline(entry.build(), loss_fn=entry.loss_fn, **options)


def exact(entry: ZooModel, rank: int, out: dict[str, Any]) -> None:
    pipe = pipeline(entry, clip_grad_norm=CLIP)
    out["losses"] = [float(loss) for loss in pipe.train(entry.batches(STEPS, 1), steps=STEPS)]
    out["blocks"] = [list(s.extra.get("blocks", [])) for s in pipe.plan.stages]
    out["state"] = pipe.state_dict()
    item = entry.batches(1, 7)[0]
    inputs = split_item(entry, item)[0]
    out["predict"] = pipe.predict(inputs, everywhere=True)
    out["evaluate"] = pipe.evaluate(entry.batches(2, 7))["loss"]
    pipe.close()


def bf16(entry: ZooModel, rank: int, out: dict[str, Any]) -> None:
    pipe = pipeline(entry, precision="bf16")
    out["losses"] = [float(loss) for loss in pipe.train(entry.batches(3, 1), steps=3)]
    pipe.close()


def asynchronous(entry: ZooModel, rank: int, out: dict[str, Any]) -> None:
    batches = entry.batches(4, 1) * 6  # the same 4 minibatches, 6 times: learnable
    try:  # tied weights are refused at construction, or at the capture on the first batch
        pipe = pipeline(entry, schedule="pipedream", chunks=1,
                        optimizer=lambda ps: torch.optim.Adam(ps, lr=3e-3))
        out["losses"] = [float(loss) for loss in pipe.train(batches, steps=len(batches))]
    except ValueError as err:
        out["refused"] = str(err)
        return
    pipe.close()


def automatic(entry: ZooModel, rank: int, out: dict[str, Any]) -> None:
    pipe = pipeline(entry, stages=None, schedule="auto", chunks=None)
    out["schedule"] = pipe.schedule_name if pipe.plan is not None else None
    out["losses"] = [float(loss) for loss in pipe.train(entry.batches(3, 1), steps=3)]
    out["schedule"] = pipe.schedule_name
    pipe.close()


def evaluation(entry: ZooModel, rank: int, out: dict[str, Any], **options: Any) -> None:
    pipe = pipeline(entry, **options)
    out["losses"] = [float(loss) for loss in pipe.train(entry.batches(2, 1), steps=2)]
    out["state"] = pipe.state_dict()
    inputs = split_item(entry, entry.batches(1, 7)[0])[0]
    out["predict"] = [pipe.predict(inputs, everywhere=True) for _ in range(2)]
    out["evaluate"] = pipe.evaluate(entry.batches(2, 7))["loss"]
    pipe.close()


SCENARIOS: dict[str, Callable[[ZooModel, int, dict[str, Any]], None]] = {
    "exact": exact, "bf16": bf16, "async": asynchronous, "auto": automatic}
# (model, scenario) for every case of the job: the drop-rate models only evaluate.
CASES = [(m, s) for m in ZOO for s in SCENARIOS] + [(m, "eval") for m in DROPPING]


def zoo_job(rank: int, world: int, stores: list[str]) -> dict[str, Outcome]:
    """Every (model, scenario) in turn, each on a process group of its own (a scenario that
    fails on one rank must not leave the next one a broken group)."""
    torch.set_num_threads(1)
    results: dict[str, Outcome] = {}
    for (model, scenario), store in zip(CASES, stores):
        out: dict[str, Any] = {}
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            # A file store per case: ports picked ahead of the job could be taken by then.
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=2 * TIMEOUT))
            if scenario == "eval":
                evaluation(DROPPING[model], rank, out)
            else:
                SCENARIOS[scenario](ZOO[model], rank, out)
            results[f"{model}/{scenario}"] = (out, None)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            results[f"{model}/{scenario}"] = (out, traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def job() -> list[dict[str, Outcome]]:
    folder = tempfile.mkdtemp(prefix="zoo-stores-")
    stores = [os.path.join(folder, f"case{i}") for i in range(len(CASES))]
    try:
        return launch(zoo_job, WORLD, stores, timeout=900, threads_per_rank=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    yield from one_torch_thread()


def result(job: list[dict[str, Outcome]], case: str, rank: int = 0) -> dict[str, Any]:
    out, error = job[rank][case]
    if error is not None:
        pytest.fail(f"{case} failed on rank {rank}:\n{error}")
    return out


# --- the tests ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_1f1b_with_clipping_equals_the_plain_loop(job: Any, name: str) -> None:
    entry = ZOO[name]
    got = result(job, f"{name}/exact")
    assert len(got["blocks"]) == 2 and all(got["blocks"]), got["blocks"]
    want_losses, want_state = reference(entry, STEPS, clip=CLIP)
    for rank in range(WORLD):  # the loss of every step, on every rank
        losses = result(job, f"{name}/exact", rank)["losses"]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= 1e-5, \
            (losses, want_losses)
    state = got["state"]
    assert set(state) == set(want_state), (sorted(set(want_state) ^ set(state)))
    # Relative over the whole model (a bias near zero has no meaningful relative error of
    # its own); the worst tensors are named if it fails.
    keys = [k for k in want_state if want_state[k].is_floating_point()]
    whole = relative(torch.cat([state[k].flatten().double() for k in keys]),
                     torch.cat([want_state[k].flatten().double() for k in keys]))
    worst = sorted((relative(state[k], want_state[k]), k) for k in keys)[-3:]
    assert whole <= 1e-5, (whole, worst)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_state_dict_loads_strictly_and_reproduces_the_pipeline(job: Any, name: str) -> None:
    entry = ZOO[name]
    got = result(job, f"{name}/exact")
    fresh = entry.build()
    fresh.load_state_dict(got["state"], strict=True)
    fresh.eval()
    inputs = split_item(entry, entry.batches(1, 7)[0])[0]
    with torch.no_grad():
        want = call(fresh, inputs)
    for rank in range(WORLD):
        predicted = result(job, f"{name}/exact", rank)["predict"]
        for a, b in zip(torch.utils._pytree.tree_leaves(predicted),
                        torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_evaluate_equals_the_trained_model_in_eval_mode(job: Any, name: str) -> None:
    entry = ZOO[name]
    got = result(job, f"{name}/exact")
    model = entry.build()
    model.load_state_dict(got["state"], strict=True)
    model.eval()
    with torch.no_grad():
        losses = [float(loss_of(entry, call(model, x), y))
                  for x, y in (split_item(entry, item) for item in entry.batches(2, 7))]
    for rank in range(WORLD):  # the same figure on every rank
        assert abs(result(job, f"{name}/exact", rank)["evaluate"] - sum(losses) / 2) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_bf16_equals_one_process_autocast(job: Any, name: str) -> None:
    want, _ = reference(ZOO[name], 3, autocast=torch.bfloat16)
    got = result(job, f"{name}/bf16")["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_pipedream_learns_or_refuses_tied_weights(job: Any, name: str) -> None:
    entry = ZOO[name]
    got = result(job, f"{name}/async")
    if entry.tied:
        assert "refused" in got, got
        assert "ties weights" in got["refused"] and "synchronous" in got["refused"]
        return
    losses = got["losses"]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert all(map(lambda v: v == v, losses)) and last < 0.9 * first, losses


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_auto_picks_a_schedule_that_trains(job: Any, name: str) -> None:
    got = result(job, f"{name}/auto")
    assert got["schedule"] and all(torch.isfinite(torch.tensor(got["losses"]))), got


@pytest.mark.parametrize("name", ["nanogpt", "gpt2"])
def test_rank_threads_capture_and_train_like_the_loop(name: str) -> None:
    """ranks='threads': every rank thread captures the caller's one model with torch.export
    (in turns) while rank 0 profiles it; then 1f1b with clipping equals the plain loop."""
    entry = ZOO[name]
    want_losses, want_state = reference(entry, 4, clip=CLIP)
    pipe = pipeline(entry, clip_grad_norm=CLIP, ranks="threads", workers=WORLD)
    try:
        losses = [float(loss) for loss in pipe.train(entry.batches(4, 1), steps=4)]
        state = pipe.state_dict()
    finally:
        pipe.close()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= 1e-5
    keys = [k for k in want_state if want_state[k].is_floating_point()]
    assert relative(torch.cat([state[k].flatten().double() for k in keys]),
                    torch.cat([want_state[k].flatten().double() for k in keys])) <= 1e-5


def check_evaluation(entry: ZooModel, got: list[dict[str, Any]]) -> None:
    """Every rank's two predictions and evaluated loss against the model in eval mode with
    the weights rank 0 returned."""
    model = entry.build()
    model.load_state_dict(got[0]["state"], strict=True)
    model.eval()
    inputs = split_item(entry, entry.batches(1, 7)[0])[0]
    if isinstance(inputs, dict) and "use_cache" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "use_cache": False}  # as the pipeline calls it: no cache returned
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(call(model, inputs))
        want_loss = sum(float(loss_of(entry, call(model, x), y)) for x, y in
                        (split_item(entry, item) for item in entry.batches(2, 7))) / 2
    for out in got:
        first, second = (torch.utils._pytree.tree_leaves(p) for p in out["predict"])
        assert all(torch.equal(a, b) for a, b in zip(first, second)), \
            "two predictions of one input differ"
        assert len(first) == len(want)
        for a, b in zip(first, want):
            assert relative(a, b) <= 1e-5, relative(a, b)
        assert abs(out["evaluate"] - want_loss) <= 1e-5 * abs(want_loss), \
            (out["evaluate"], want_loss)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DROPPING))
def test_with_real_drop_rates_predict_and_evaluate_equal_the_model_in_eval_mode(
        job: Any, name: str) -> None:
    check_evaluation(DROPPING[name], [result(job, f"{name}/eval", r) for r in range(WORLD)])


@pytest.mark.parametrize("name", ["vit_tiny+drop_path", "swin_tiny", "efficientnet_b0"])
def test_with_real_drop_rates_on_rank_threads_too(name: str) -> None:
    entry = DROPPING[name]
    out: dict[str, Any] = {}
    evaluation(entry, 0, out, ranks="threads", workers=WORLD)
    check_evaluation(entry, [out])
