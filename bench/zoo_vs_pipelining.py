"""pipedream_fast against torch.distributed.pipelining on the zoo's transformers, unedited.

The test zoo's models (tests/zoo: nanoGPT, Hugging Face Llama, GPT-2, BERT; tiny seeded configs),
each computing its loss from inputs that include the targets. 2 ranks (gloo, one thread each),
2 stages cut before the second transformer layer, 1F1B, 2 microbatches of 8, SGD lr 0.01 m 0.9:
torch's `pipeline(model, split_spec=...)` + `Schedule1F1B` against our
`Pipeline(model, loss_fn=None, split_points=[...], schedule="1f1b", chunks=2)`. Reported: (a)
whether each splits and trains the model as built (torch falls back to use_cache=False, then to
the loss outside the model, nanoGPT then EDITED: `LossOutsideGPT`); (b) samples/s, both sides
in interleaved rounds in one pair of processes, and each side's set-up; (c) first and last
losses against a one-process loop, and the tied embedding/head drift.

    python bench/zoo_vs_pipelining.py [--warmup 3] [--steps 40] [--repeats 2] [--smoke]
                                      [--models nanogpt,llama,gpt2,bert] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import re
import statistics
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT / "tests"), str(ROOT), str(BENCH)):  # the zoo, the package, harness
    if _path not in sys.path:
        sys.path.insert(0, _path)

import zoo  # noqa: E402  (tests/zoo: declares torchvision's operators before transformers)

zoo.import_torchvision()  # before transformers imports it (see its docstring)

from pipedream_fast.launch import launch  # noqa: E402
from pipedream_fast.training import model_loss, split_microbatches  # noqa: E402
import harness  # noqa: E402

MODELS = ("nanogpt", "llama", "gpt2", "bert")
SPLIT = {"nanogpt": "transformer.h.1", "llama": "model.layers.1", "gpt2": "transformer.h.1",
         "bert": "bert.encoder.layer.1"}
# (embedding, head) of the models that tie them: the names of the one shared parameter
TIED = {"nanogpt": ("transformer.wte.weight", "lm_head.weight"),
        "llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight")}
WORLD, CHUNKS = 2, 2
BATCH = zoo.BATCH
LR, MOMENTUM = 0.01, 0.9
TIMEOUT = 60.0  # every collective and transfer; a one-sided failure costs at most this
DEFAULT = {"warmup": 3, "steps": 40, "repeats": 2}
SMOKE = {"warmup": 1, "steps": 2, "repeats": 1}
FIRST_TOL = 1e-5  # relative, the first step's loss (initial weights: the forwards)
LAST_TOL = 1e-4  # relative, the last step's (after every update before it)
DRIFT_TOL = 1e-6  # relative to the weight's largest entry: "identical" up to float noise
# A rank's error that only says its peer failed first: the table shows the peer's own.
PEER_SYMPTOM = re.compile(r"Connection (closed|reset)|Read error|Timed out|timed out|"
                          r"Broken pipe")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def build(name: str, no_cache: bool = False) -> nn.Module:
    """The zoo's model, seeded, as built; `no_cache`: with `config.use_cache=False`."""
    model = zoo.ZOO[name].build()
    if no_cache:
        model.config.use_cache = False
    return model


def has_cache(name: str) -> bool:
    return bool(getattr(getattr(build(name), "config", None), "use_cache", False))


def batches(name: str, count: int) -> list[Any]:
    return zoo.ZOO[name].batches(count, 1)


def named_inputs(model: nn.Module, item: Any) -> dict[str, Any]:
    """A loader item as the model's keyword arguments (nanoGPT's `(idx, targets)` by name)."""
    if isinstance(item, dict):
        return dict(item)
    args = item if isinstance(item, (tuple, list)) else (item,)
    return dict(inspect.signature(model.forward).bind(*args).arguments)


# ---- ranks ---------------------------------------------------------------------------------

def torch_split(name: str, model: nn.Module, item: Any) -> Any:
    """torch.distributed.pipelining's split of `model` before SPLIT[name], traced on one
    microbatch of `item` given by keyword."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    mb = split_microbatches(named_inputs(model, item), CHUNKS)[0]
    return pipeline(model, mb_args=(), mb_kwargs=mb,
                    split_spec={SPLIT[name]: SplitPoint.BEGINNING})


def root_inputs(pipe: Any, stage: int) -> dict[str, str]:
    """The model inputs stage `stage` consumes directly: {model input name: the stage module's
    placeholder name}. A later stage's are passed to that rank's step() by placeholder name."""
    graph = pipe.split_gm.graph
    node = [n for n in graph.nodes if n.op == "call_module"][stage]  # the stages, in order
    placeholders = [n.name for n in pipe.get_stage_module(stage).graph.nodes
                    if n.op == "placeholder"]
    return {arg.target: ph for arg, ph in zip(node.args, placeholders)
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder"}


def torch_probe(name: str) -> dict[str, Any]:
    """pipeline() on the model as built, then (Hugging Face) with use_cache=False."""
    out: dict[str, Any] = {}
    for key, no_cache in (("as_built", False), ("use_cache_false", True)):
        if no_cache and (out["as_built"] == "ok" or not has_cache(name)):
            break
        try:
            torch_split(name, build(name, no_cache), batches(name, 1)[0])
            out[key] = "ok"
        except Exception as err:  # noqa: BLE001 - recorded
            out[key] = harness.shorten(err)
    return out


class LossOutsideGPT(nn.Module):
    """The zoo's nanoGPT EDITED for the loss outside: without targets nanoGPT computes the last
    position's logits only. The same modules; its forward with targets, less the loss."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.config, self.transformer, self.lm_head = gpt.config, gpt.transformer, gpt.lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


TARGET = {"nanogpt": "targets", "llama": "labels", "gpt2": "labels", "bert": "labels"}


def outside_loss(name: str) -> Any:
    """The loss each model computes inside, as a loss_fn of (its logits, the targets)."""
    def logits_of(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, (tuple, list)) else out

    if name == "nanogpt":
        return lambda out, y: nn.functional.cross_entropy(
            logits_of(out).reshape(-1, zoo.VOCAB), y.reshape(-1), ignore_index=-1)
    if name == "bert":
        return lambda out, y: nn.functional.cross_entropy(logits_of(out).reshape(-1, 3),
                                                          y.reshape(-1))
    from transformers.loss.loss_utils import ForCausalLMLoss  # what Llama and GPT-2 call
    return lambda out, y: ForCausalLMLoss(logits_of(out), y, vocab_size=zoo.VOCAB)


def torch_run(rank: int, name: str, items: list[Any], warmup: int, no_cache: bool,
              mode: str = "inside") -> dict[str, Any]:
    """torch's Schedule1F1B. mode "inside": the model called with its targets (a later stage's
    inputs go to its rank's step() by placeholder name); "outside": without them, the same
    loss in the schedule's loss_fn (nanoGPT: `LossOutsideGPT`, an edit)."""
    from torch.distributed.pipelining import Schedule1F1B

    began = time.perf_counter()
    model = build(name, no_cache)
    target_name = TARGET[name]
    if mode == "outside":
        items = [{k: v for k, v in named_inputs(model, item).items() if k != target_name}
                 | {"__target__": named_inputs(model, item)[target_name]} for item in items]
        if name == "nanogpt":
            model = LossOutsideGPT(model)
        loss_fn = outside_loss(name)
    else:
        loss_fn = lambda out, _target: model_loss(out)  # noqa: E731
    traced = [{k: v for k, v in it.items() if k != "__target__"} if mode == "outside" else it
              for it in items[:1]]
    pipe = torch_split(name, model, traced[0])
    stage = pipe.build_stage(rank, torch.device("cpu"))
    mine = root_inputs(pipe, rank)
    last = rank == WORLD - 1
    sched = Schedule1F1B(stage, CHUNKS, loss_fn=loss_fn)
    opt = sgd(stage.submod.parameters())
    clock = harness.Clock()
    losses: list[float] = []
    for step, item in enumerate(items):
        named = item if mode == "outside" else named_inputs(model, item)
        kwargs = {ph: named[root] for root, ph in mine.items()}
        target = named["__target__"] if mode == "outside" else torch.zeros(BATCH)
        opt.zero_grad()
        if last:
            mb_losses: list[torch.Tensor] = []
            sched.step(target=target, losses=mb_losses, **kwargs)
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        else:
            sched.step(**kwargs)
        opt.step()
        if step == 0:
            first = time.perf_counter() - began
        if step == warmup - 1:
            clock.warmed_up()
    result: dict[str, Any] = {**clock.done(), "losses": losses if last else None, "mode": mode,
                              "first_step_s": first}
    if name in TIED:
        params = dict(stage.submod.named_parameters())
        key = TIED[name][0] if rank == 0 else TIED[name][1]
        result["tied"] = params[key].detach().clone()
    return result


def ours_run(rank: int, name: str, items: list[Any], warmup: int,
             no_cache: bool) -> dict[str, Any]:
    from pipedream_fast.pipeline import Pipeline

    began = time.perf_counter()
    model = build(name, no_cache)
    tied = dict(model.named_parameters(remove_duplicate=False)).get(TIED[name][0]) \
        if name in TIED else None
    pipe = Pipeline(model, loss_fn=None, optimizer=sgd, split_points=[SPLIT[name]],
                    schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT)
    last = rank == WORLD - 1
    clock = harness.Clock()
    losses: list[float] = []
    for step, loss in enumerate(pipe.train(items, steps=len(items))):
        if last and loss is not None:
            losses.append(float(loss))
        if step == 0:
            first = time.perf_counter() - began
        if step == warmup - 1:
            clock.warmed_up()
    result: dict[str, Any] = {**clock.done(), "losses": losses if last else None,
                              "first_step_s": first}
    if tied is not None:
        held = {id(p) for m in pipe.stage_modules.values() for p in m.parameters()}
        result["tied"] = tied.detach().clone() if id(tied) in held else None
    pipe.close()
    return result


def attempt(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    began = time.monotonic()
    try:
        result = fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - reported in the table
        result = {"error": harness.shorten(err), "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.monotonic() - began
    if args[0] == 0:  # rank 0 says what it ran and how long it took (set-up included)
        rank, name, items, _warmup, no_cache, *mode = args
        print(f"  rank 0: {name} {fn.__name__}{' (use_cache=False)' if no_cache else ''}"
              f"{''.join(f' {m}' for m in mode)}, {len(items)} steps: "
              f"{'FAILED' if 'error' in result else 'ok'} in {result['wall_s']:.1f} s",
              flush=True)
    return result


def rank_main(rank: int, world: int, models: list[str], warmup: int,
              steps: int, repeats: int) -> dict[str, Any]:
    """Every model in turn: torch's probe (rank 0), ours on the model as built where torch
    needs use_cache=False, torch on the model as called (one step each), then `repeats` x
    (ours, torch) measured runs."""
    torch.set_num_threads(1)
    numbers = itertools.count()

    def fresh_group() -> None:
        harness.fresh_group(rank, WORLD, next(numbers), timeout_s=TIMEOUT)

    out: dict[str, Any] = {}
    for name in models:
        fresh_group()
        shared = [torch_probe(name) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        record: dict[str, Any] = {"probe": shared[0]}
        no_cache = shared[0].get("use_cache_false") == "ok"
        record["no_cache"] = no_cache
        if no_cache:  # the measured runs set use_cache=False: ours on the model as built too
            fresh_group()
            record["ours_as_built"] = attempt(ours_run, rank, name, batches(name, 1), 1, False)
        fresh_group()
        record["torch_inside"] = attempt(torch_run, rank, name, batches(name, 1), 1, no_cache)
        mode = "outside" if "error" in record["torch_inside"] else "inside"
        items = batches(name, warmup + steps)
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "torch": []}
        for _ in range(repeats):
            for side in ("ours", "torch"):
                if runs[side] and "error" in runs[side][-1]:
                    continue  # it failed once: the same failure again says nothing new
                fresh_group()
                runs[side].append(
                    attempt(ours_run, rank, name, items, warmup, no_cache) if side == "ours"
                    else attempt(torch_run, rank, name, items, warmup, no_cache, mode))
                gc.collect()
        record["runs"] = runs
        out[name] = record
        print(f"rank {rank}: {name} done", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


# ---- the harness ---------------------------------------------------------------------------

def reference(name: str, items: list[Any]) -> tuple[list[float], torch.Tensor | None]:
    """The one-process loop: each minibatch in CHUNKS microbatches, gradients accumulated
    (each microbatch's loss / CHUNKS), one SGD step. Returns the losses and the tied weight."""
    model = build(name).train()
    opt = sgd(model.parameters())
    losses = []
    for item in items:
        opt.zero_grad()
        total = 0.0
        for mb in split_microbatches(item, CHUNKS):
            loss = model_loss(zoo.call(model, mb))
            (loss / CHUNKS).backward()
            total += float(loss.detach()) / CHUNKS
        opt.step()
        losses.append(total)
    tied = dict(model.named_parameters(remove_duplicate=False))[TIED[name][0]] \
        if name in TIED else None
    return losses, (None if tied is None else tied.detach().clone())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def drift(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def side_summary(name: str, ranks: list[dict[str, Any]], steps: int, want: list[float],
                 want_tied: torch.Tensor | None, initial: torch.Tensor | None) -> dict[str, Any]:
    """One run of one side from both ranks' results."""
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        # The rank whose error is its own, not the peer's closed connection or timeout.
        own = [e for e in errors if not PEER_SYMPTOM.search(e)]
        tracebacks = [r.get("traceback", "") for r in ranks if "error" in r]
        return {"error": (own or errors)[0], "tracebacks": tracebacks}
    losses = next(r["losses"] for r in ranks if r["losses"] is not None)
    run: dict[str, Any] = {**harness.window(ranks, BATCH * steps), "losses": losses,
                           # model built, split, set up and its first step, on the last rank
                           "first_step_s": max(r["first_step_s"] for r in ranks),
                           "first_loss_rel_diff": rel(losses[0], want[0]),
                           "last_loss_rel_diff": rel(losses[-1], want[-1])}
    if name in TIED and want_tied is not None and initial is not None:
        embedding, head = ranks[0].get("tied"), ranks[-1].get("tied")
        if embedding is not None and head is not None:
            run["tied"] = {"embedding_vs_head": drift(embedding, head),
                           "embedding_vs_loop": drift(embedding, want_tied),
                           "head_vs_loop": drift(head, want_tied),
                           "loop_moved": drift(want_tied, initial)}
    return run


def run(sz: dict[str, int], models: tuple[str, ...]) -> dict[str, Any]:
    warmup, steps, repeats = sz["warmup"], sz["steps"], sz["repeats"]
    began = time.monotonic()
    by_rank = launch(rank_main, WORLD, list(models), warmup, steps, repeats,
                     timeout=TIMEOUT, threads_per_rank=1)
    torch.set_num_threads(1)
    rows = []
    for name in models:
        items = batches(name, warmup + steps)
        want, want_tied = reference(name, items)
        initial = None
        if name in TIED:
            initial = dict(build(name).named_parameters(remove_duplicate=False))[
                TIED[name][0]].detach().clone()
        records = [r[name] for r in by_rank]
        probe = records[0]["probe"]
        sides: dict[str, list[dict[str, Any]]] = {}
        for side in ("ours", "torch"):
            sides[side] = [side_summary(name, list(ranks), steps, want, want_tied, initial)
                           for ranks in zip(*(rec["runs"][side] for rec in records))]
        as_built = None
        if "ours_as_built" in records[0]:
            as_built = one_step([rec["ours_as_built"] for rec in records], name, want)
        inside = one_step([rec["torch_inside"] for rec in records], name, want)
        rows.append(summarize(name, probe, as_built, inside, sides, want))
        rows[-1]["no_cache"] = records[0]["no_cache"]
        r = rows[-1]
        print(f"{name:8s} ours {fmt_rate(r, 'ours')}  torch {fmt_rate(r, 'torch')}  "
              f"ratio {r['ratio'] if r['ratio'] is None else round(r['ratio'], 2)}  "
              f"torch: {r['torch_split']}; {r['torch_trains']}", flush=True)
    return {"settings": {**sz, "models": list(models), "batch": BATCH, "chunks": CHUNKS,
                         "ranks": WORLD, "threads_per_rank": 1, "lr": LR,
                         "momentum": MOMENTUM, "split": {m: SPLIT[m] for m in models}},
            "machine": harness.machine_info(transformers=version("transformers")),
            "rows": rows, "wall_s": time.monotonic() - began}


def fmt_rate(row: dict[str, Any], side: str) -> str:
    value = row[f"{side}_samples_per_s"]
    return "failed" if value is None else f"{value:6.1f}"


def one_step(ranks: list[dict[str, Any]], name: str, want: list[float]) -> dict[str, Any]:
    """A one-step check run: trained, with the loop's first loss?"""
    one = side_summary(name, ranks, 1, want[:1], None, None)
    if "error" in one:
        return {"ok": False, "error": one["error"]}
    return {"ok": one["first_loss_rel_diff"] <= FIRST_TOL,
            "first_loss_rel_diff": one["first_loss_rel_diff"]}


def summarize(name: str, probe: dict[str, Any], as_built: dict[str, Any] | None,
              inside: dict[str, Any], sides: dict[str, list[dict[str, Any]]],
              want: list[float]) -> dict[str, Any]:
    ok = {side: [r for r in runs if "error" not in r] for side, runs in sides.items()}
    errors = {side: next((r["error"] for r in runs if "error" in r), None)
              for side, runs in sides.items()}

    def median(side: str, key: str) -> float | None:
        return statistics.median(r[key] for r in ok[side]) if ok[side] else None

    def worst(side: str, key: str) -> float | None:
        return max((r[key] for r in ok[side]), default=None)

    def tied(side: str, key: str) -> float | None:
        return max((r["tied"][key] for r in ok[side] if "tied" in r), default=None)

    rates = {side: median(side, "samples_per_s") for side in ok}
    needs = "config.use_cache=False" if (probe["as_built"] != "ok" and
                                         probe.get("use_cache_false") == "ok") else None
    torch_split = "yes" if probe["as_built"] == "ok" else \
        "no: needs config.use_cache=False" if needs else "no"
    torch_trains = "yes" if inside["ok"] else "no: fails at its first step" \
        if "error" in inside else "no: its loss differs from the loop's"
    ours_split = "yes"
    if errors["ours"] and not ok["ours"]:
        ours_split = "no: fails to train"
    elif as_built is not None and not as_built["ok"]:
        ours_split = "no: " + ("fails to train (use_cache=True)" if "error" in as_built
                               else "its loss differs from the loop's (use_cache=True)")
    row = {"model": name, "split_at": SPLIT[name], "tied": name in TIED,
           "ours_split": ours_split, "ours_as_built": as_built,
           "torch_split": torch_split, "torch_needs": needs, "torch_probe": probe,
           "torch_trains": torch_trains, "torch_inside": inside,
           "torch_mode": "inside" if inside["ok"] else "outside",
           "ours_error": errors["ours"], "torch_error": errors["torch"],
           "ours_samples_per_s": rates["ours"], "torch_samples_per_s": rates["torch"],
           "ours_first_step_s": median("ours", "first_step_s"),
           "torch_first_step_s": median("torch", "first_step_s"),
           "other_cores_max": max((r["other_cores"] for runs in ok.values() for r in runs),
                                  default=None),
           "ratio": rates["ours"] / rates["torch"] if rates["ours"] and rates["torch"] else None,
           "pair_ratios": [a["samples_per_s"] / b["samples_per_s"]
                           for a, b in zip(ok["ours"], ok["torch"])],
           "loop_first_loss": want[0], "loop_last_loss": want[-1]}
    for side in ("ours", "torch"):
        first = row[f"{side}_first_loss_rel_diff"] = worst(side, "first_loss_rel_diff")
        last = row[f"{side}_last_loss_rel_diff"] = worst(side, "last_loss_rel_diff")
        for key in ("embedding_vs_head", "embedding_vs_loop", "head_vs_loop", "loop_moved"):
            row[f"{side}_tied_{key}"] = tied(side, key)
        row[f"{side}_losses_equal"] = (None if first is None else
                                       bool(first <= FIRST_TOL and last <= LAST_TOL))
        gap = row[f"{side}_tied_embedding_vs_head"]
        row[f"{side}_tied_identical"] = None if gap is None else bool(gap <= DRIFT_TOL)
    row["runs"] = sides
    return row


# ---- the report ----------------------------------------------------------------------------

def _pair(row: dict[str, Any], key: str) -> str:
    return f"{harness.fmt(row['ours_' + key], '.1e')} / {harness.fmt(row['torch_' + key], '.1e')}"


def _md(text: str) -> str:
    return text.replace("`", "'").replace("|", "/")


def failures(r: dict[str, Any]) -> list[str]:
    """A row's failures, verbatim (shortened)."""
    probe, m = r["torch_probe"], r["model"]
    said = [(probe["as_built"], "torch `pipeline()` on the model as built"),
            (probe.get("use_cache_false", "ok"), "torch `pipeline()` with use_cache=False"),
            (r["torch_inside"].get("error", "ok"), "torch training the model as called"),
            ((r["ours_as_built"] or {}).get("error", "ok"), "ours on the model as built"),
            (r["ours_error"] or "ok", "ours's measured runs"),
            (r["torch_error"] or "ok", "torch's measured runs")]
    return [f"- {m}, {where}: `{_md(text)}`" for text, where in said if text != "ok"]


def markdown(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    lines = ["# pipedream_fast vs torch.distributed.pipelining on the zoo's transformers, "
             "2 ranks, CPU", "",
             f"Command: `{harness.command()}`", "", harness.machine_line(m, result["wall_s"]), "",
             f"- Models: the test zoo's (tests/zoo), tiny seeded configs, each computing its own "
             f"loss. Batch {s['batch']}, {s['chunks']} microbatches, 1F1B, 2 stages cut before "
             f"the second transformer layer; {s['ranks']} ranks, gloo on loopback, 1 thread per "
             f"rank; SGD lr {s['lr']}, momentum {s['momentum']}.",
             "- Splits it: torch `pipeline(model, mb_args, mb_kwargs, split_spec={layer: "
             "SplitPoint.BEGINNING})`, ours `Pipeline(model, loss_fn=None, optimizer, "
             "split_points=[layer], schedule='1f1b', chunks=2)`, on the model as built (where "
             "torch needs `use_cache=False`, both sides' measured runs use it and one run of "
             "ours trains the model as built). Trains it: one step of torch's Schedule1F1B on "
             "the model called with its targets, its loss against the loop's; where that fails, "
             "torch's runs compute the loss in `loss_fn` (mode 'outside'; nanoGPT then needs "
             "an edited forward, `LossOutsideGPT`).",
             f"- Samples/s: {s['steps']} steps after {s['warmup']} warm-up steps (latest rank's "
             f"end of warm-up to latest end); {s['repeats']} run(s) of each side in one pair of "
             f"processes, medians, ratio of the medians (in brackets: each pair's).",
             f"- Losses: relative difference of the first and last step's loss from the "
             f"one-process loop with gradient accumulation, worst over the runs; equal within "
             f"{FIRST_TOL:g} and {LAST_TOL:g}. Tied drift: after {s['warmup'] + s['steps']} "
             f"steps, max |embedding - head| / max |head| across the stages; identical within "
             f"{DRIFT_TOL:g}.",
             "- Set-up: model built to the end of the first step, slower rank, median. Others "
             f"(cores): the most CPU other processes took in a measured window (of "
             f"{m['cores']} cores).", ""]
    table = []
    for r in result["rows"]:
        ratio = harness.fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else "")
        if len(r["pair_ratios"]) > 1:
            ratio += " (" + ", ".join(f"{x:.2f}" for x in r["pair_ratios"]) + ")"
        table.append([r["model"], r["ours_split"], r["torch_split"], r["torch_trains"],
                      r["torch_mode"], fmt_rate(r, "torch").strip(), fmt_rate(r, "ours").strip(),
                      ratio, _pair(r, "first_loss_rel_diff"), _pair(r, "last_loss_rel_diff"),
                      _pair(r, "tied_embedding_vs_head") if r["tied"] else "(untied)",
                      f"{harness.fmt(r['ours_first_step_s'])} / "
                      f"{harness.fmt(r['torch_first_step_s'])}",
                      harness.fmt(r["other_cores_max"], ".2f")])
    lines += harness.markdown_table(
        ["model", "ours splits and trains it", "torch splits it", "torch trains it", "torch mode",
         "torch samples/s", "ours samples/s", "ours/torch",
         "first-step loss vs loop (ours / torch)", "last-step loss vs loop (ours / torch)",
         "tied drift (ours / torch)", "set-up s (ours / torch)", "others (cores)"], table, left=5)
    lines += ["", "Failures, verbatim (shortened; each error, then its cause after '<-'):", ""]
    lines += [f for r in result["rows"] for f in failures(r)] or ["- none"]
    lines += ["", "Tied weights against the loop's after the same steps (max |w - w_loop| / max "
              "|w_loop|; last column: how far the loop's weight moved from its start):", ""]
    lines += harness.markdown_table(
        ["model", "ours embedding", "ours head", "torch embedding", "torch head", "loop moved"],
        [[r["model"]] + [harness.fmt(r[k], ".1e") for k in (
            "ours_tied_embedding_vs_loop", "ours_tied_head_vs_loop",
            "torch_tied_embedding_vs_loop", "torch_tied_head_vs_loop")]
         + [harness.fmt(r["ours_tied_loop_moved"] or r["torch_tied_loop_moved"], ".1e")]
         for r in result["rows"] if r["tied"]])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="1+2 steps, 1 run of each side: does it run? (measures nothing)")
    for name, what in (("warmup", "warm-up steps"), ("steps", "measured steps after the warm-up"),
                       ("repeats", "runs of each side per model")):
        parser.add_argument(f"--{name}", type=harness.positive,
                            help=f"{what} (default {DEFAULT[name]})")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, among {', '.join(MODELS)} (default all)")
    parser.add_argument("--out", help="write the markdown here and the JSON beside it (.json)")
    args = parser.parse_args()
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; choose among {', '.join(MODELS)}")
    torch.set_num_threads(1)
    result = run(harness.sizes(args, DEFAULT, SMOKE, args.smoke), models)
    result["command"] = harness.command()
    harness.emit(args.out, markdown(result), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
