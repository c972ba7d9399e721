"""pipedream_fast against torch.distributed.pipelining on 2 ranks (gloo on loopback, one
intra-op thread each), samples/s in steady state. `--set`, results in bench/results/:

  pairs (default)  model A: each of our schedules against torch's on the same stages and
                   microbatches, in interleaved rounds, losses compared (vs_pipelining.md)
  transformer      the same for 1f1b on a tiny nanoGPT at 16 and 32 microbatches, where the
                   runtimes' own costs dominate (transformer_pair.md)
  model_a          one run each: single process, torch Schedule1F1B, ours (model_a.md)
  zoo              the test zoo's transformers unedited: who splits and trains them, samples/s,
                   losses against a one-process loop, tied-weight drift (zoo_vs_pipelining.md)
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import itertools
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.runtime.transport import set_io_priority
from pipedream_fast.schedules import kind, looped_ranks
from pipedream_fast.models import build_cnn
from pipedream_fast.training import model_loss, split_microbatches
from pipedream_fast.tuning import Tuning

import harness  # noqa: E402 - a sibling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the zoo

BATCH, WORLD, LR = 32, 2, 0.01
NO_CACHE = "ours, no CPU cache"  # a side: Tuning(cpu_cache_mb=0), malloc's own behaviour
OUR_IO = "torch, our I/O priority"  # a side: torch with gloo's I/O threads as ours sets them
IO_NOTE = ("- Torch runs as its users run it: gloo's I/O threads at their default priority, set "
           "back before each of its runs (ours, in the same processes, sets every gloo I/O "
           "thread of the process, the default group's too, to `Tuning.io_priority`'s choice, "
           "idle for one compute thread). The column `torch, our I/O priority` is torch with "
           "that setting kept, and `ours/that` the ratio without it: how much of the lead is "
           "that one knob.")
CACHE_NOTE = ("- Ours runs as shipped, with its CPU block cache (`Tuning.cpu_cache_mb`): freed tensor "
              "memory kept for reuse, where torch's side runs with malloc's behaviour and faults "
              "its large blocks in afresh at every step. `bench/results/cpu_cache.md` separates "
              "the two: without the cache, ours is about torch's speed on model A.")
VOCAB, SEQ, LAYERS, HEADS, WIDTH = 64, 16, 2, 4, 64  # the transformer set's nanoGPT
A2, A4 = [(0, 6), (6, 9)], [(0, 3), (3, 6), (6, 7), (7, 9)]  # model A's blocks [start, stop)
# per model: ours, torch's class, stages, microbatch counts per step (the stages on the ranks
# as our schedule places them: `stage_ranks`)
PAIRS = {"cnn": (("gpipe", "ScheduleGPipe", A2, (2, 4)),
                 ("1f1b", "Schedule1F1B", A2, (2, 4)),
                 ("interleaved-1f1b", "ScheduleInterleaved1F1B", A4, (4,)),
                 ("zb-v", "ScheduleZBVZeroBubble", A4, (4, 8)),
                 ("dualpipe-v", "ScheduleDualPipeV", A4, (4, 8)),
                 ("interleaved-zb", "ScheduleInterleavedZeroBubble", A4, (4, 8)),
                 ("looped-bfs", "ScheduleLoopedBFS", A4, (4, 8))),
         "gpt": (("1f1b", "Schedule1F1B", [(0, 2), (2, 5)], (16, 32)),)}
# per model, the goals (JSON key: our schedules, the least ratio to torch's); new_goal: issue 31
GOALS = {"cnn": {"goal": (("1f1b",), 1.2),
                 "new_goal": (("zb-v", "dualpipe-v", "interleaved-zb", "looped-bfs"), 1.05)},
         "gpt": {"goal": (("1f1b",), 1.25)}}  # issue 34
DEFAULT = {"pairs": {"warmup": 3, "steps": 12, "repeats": 5},
           "transformer": {"warmup": 3, "steps": 30, "repeats": 5},
           "zoo": {"warmup": 3, "steps": 40, "repeats": 2}}
QUICK = {"pairs": {"warmup": 2, "steps": 3, "repeats": 1},
         "transformer": {"warmup": 2, "steps": 3, "repeats": 1},
         "zoo": {"warmup": 1, "steps": 2, "repeats": 1}}
FIRST_LOSS_TOL, LAST_LOSS_TOL = 1e-4, 1e-3  # float32 losses near 2.3, first and after updates

MODELS = ("nanogpt", "llama", "gpt2", "bert")
SPLIT = {"nanogpt": "transformer.h.1", "llama": "model.layers.1", "gpt2": "transformer.h.1",
         "bert": "bert.encoder.layer.1"}
# (embedding, head) of the models that tie them: the names of the one shared parameter
TIED = {"nanogpt": ("transformer.wte.weight", "lm_head.weight"),
        "llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight")}
DRIFTS = ("embedding_vs_head", "embedding_vs_loop", "head_vs_loop", "loop_moved")
CHUNKS, MOMENTUM = 2, 0.9
sgd = functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM)  # the zoo's optimizer
TIMEOUT = 60.0  # zoo: every collective and transfer; a one-sided failure costs at most this
FIRST_TOL, LAST_TOL = 1e-5, 1e-4  # zoo: relative, first step's loss (the forwards) and last's
DRIFT_TOL = 1e-6  # relative to the weight's largest entry: "identical" up to float noise
# A rank's error that only says its peer failed first: the table shows the peer's own.
PEER_SYMPTOM = re.compile(r"Connection (closed|reset)|Read error|Timed out|timed out|Broken pipe")
GROUPS = itertools.count()  # zoo: a process group per run, numbered alike on the ranks


# ---- shared by the sets ---------------------------------------------------------------------

def timed(steps: Iterable[Any], warmup: int, last: bool, began: float) -> dict[str, Any]:
    """A rank's run of `steps` (each yields its loss): clock after `warmup`, losses, set-up."""
    clock, losses = harness.Clock(), []
    for step, loss in enumerate(steps):
        if last and loss is not None:
            losses.append(float(loss))
        if step == 0:
            first = time.perf_counter() - began
        if step == warmup - 1:
            clock.warmed_up()
    return {**clock.done(), "losses": losses if last else None, "first_step_s": first}


def torch_steps(sched: Any, opt: torch.optim.Optimizer, calls: Iterable[tuple[Any, Any]],
                last: bool) -> Iterator[torch.Tensor | None]:
    """A torch schedule's steps, `calls` their (args, kwargs); the mean microbatch loss."""
    for args, kwargs in calls:
        opt.zero_grad()
        mb_losses: list[torch.Tensor] = []
        sched.step(*args, **kwargs, **({"losses": mb_losses} if last else {}))
        opt.step()
        yield torch.stack(mb_losses).detach().mean() if last else None


def ours_steps(model: nn.Module, loss_fn: Any, optimizer: Any, items: list[Any], warmup: int,
               last: bool, began: float, tied: nn.Parameter | None = None,
               **how: Any) -> dict[str, Any]:
    """Pipeline(model, loss_fn, optimizer, **how) on `items`; this rank's copy of `tied`."""
    from pipedream_fast.pipeline import Pipeline

    pipe = Pipeline(model, loss_fn, optimizer, **how)
    result = timed(pipe.train(items, len(items)), warmup, last, began)
    if tied is not None:
        held = {id(p) for m in pipe.stage_modules.values() for p in m.parameters()}
        result["tied"] = tied.detach().clone() if id(tied) in held else None
    pipe.close()
    return result


def rounds(sides: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, list[Any]]:
    """Each side's runs in alternating rounds, gc before each; a failed side is not rerun."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}

    def run(side: str) -> None:
        if not any("error" in r for r in runs[side]):
            gc.collect()
            runs[side].append(sides[side]())

    harness.alternate({side: functools.partial(run, side) for side in sides}, repeats,
                      warmup=False)
    return runs


def one_run(ranks: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """One run of a side from its ranks' results; failed: the first error not a peer's drop."""
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        own = [e for e in errors if not PEER_SYMPTOM.search(e)]
        return {"error": (own or errors)[0],
                "tracebacks": [r.get("traceback", "") for r in ranks if "error" in r]}
    return {**harness.window(ranks, samples), "first_step_s": max(r["first_step_s"] for r in ranks),
            "page_faults": [r["page_faults"] for r in ranks], "rss_mb": [r["rss_mb"] for r in ranks],
            "losses": next(r["losses"] for r in ranks if r["losses"] is not None)}


def side_by_side(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the runs that did not fail, ours/torch (and ours/`OUR_IO` where it ran),
    each round's, others' most CPU."""
    ok = {side: [r for r in rs if "error" not in r] for side, rs in runs.items()}
    med = {side: statistics.median(r["samples_per_s"] for r in rs) if rs else None
           for side, rs in ok.items()}
    mine = med.get(OUR_IO)  # torch with our I/O priority, where that side ran
    return {"ours_samples_per_s": med["ours"], "torch_samples_per_s": med["torch"],
            "ratio": med["ours"] / med["torch"] if med["ours"] and med["torch"] else None,
            **({"torch_our_io_samples_per_s": mine,
                "ratio_our_io": med["ours"] / mine if med["ours"] and mine else None}
               if OUR_IO in runs else {}),
            "pair_ratios": [a["samples_per_s"] / b["samples_per_s"]
                            for a, b in zip(ok["ours"], ok["torch"])],
            "other_cores_max": max((r["other_cores"] for rs in ok.values() for r in rs),
                                   default=None)}


def loss_gaps(losses: list[float], want: list[float], relative: bool = False) -> list[float]:
    """|first - want's first| and |last - want's last| (relative to want's: `relative`)."""
    return [abs(a - b) / (max(abs(b), 1e-12) if relative else 1.0)
            for a, b in ((losses[0], want[0]), (losses[-1], want[-1]))]


def head(title: str, result: dict[str, Any], bullets: list[str]) -> list[str]:
    return [f"# {title}", "", f"Command: `{harness.command()}`", "",
            harness.machine_line(result["machine"], result["wall_s"]), "", *bullets, ""]


# ---- pairs on an nn.Sequential's blocks: model A, a tiny nanoGPT ----------------------------

class Embed(nn.Module):
    """nanoGPT's forward up to its layers: token plus position embeddings (dropout 0)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))


def sequential(model: str) -> tuple[nn.Module, Callable[..., torch.Tensor], list[torch.Tensor]]:
    """The model (seeded), its loss, one fixed batch: model A; the zoo's nanoGPT as blocks,
    its head untied (torch's stages would each train a copy of a tied one)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model == "cnn":
        return build_cnn(), nn.functional.cross_entropy, [
            torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)]
    from zoo.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(SEQ, VOCAB, LAYERS, HEADS, WIDTH))
    gpt.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return (nn.Sequential(Embed(gpt), *gpt.transformer.h, gpt.transformer.ln_f, gpt.lm_head),
            lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
            [x, x.roll(-1, 1)])


def stage_ranks(schedule: str, num_stages: int) -> list[int]:
    """Each stage's rank as our `schedule` places them (a V, else looped: stage k on rank k
    mod WORLD); torch's side gets the same."""
    place = kind(schedule).placement or looped_ranks
    return [ranks[0] for ranks in place(num_stages, num_stages // WORLD)]


def placement_name(schedule: str, num_stages: int) -> str:
    """How the results name `stage_ranks`: "plain" (a stage a rank), "v" or "looped"."""
    if num_stages <= WORLD:
        return "plain"
    return "v" if kind(schedule).placement else "looped"


def side_rank(rank: int, world: int, side: str, schedule: str, model: str,
              stages: list[tuple[int, int]], chunks: int, warmup: int, steps: int,
              where: list[int]) -> dict[str, Any]:
    """One run on this rank of `side` ("ours", NO_CACHE: ours without the CPU block cache,
    "torch", OUR_IO: torch with gloo's I/O threads at our priority) on `stages`, `chunks`
    microbatches, stage k on rank `where[k]`."""
    began, total = time.perf_counter(), warmup + steps
    module, loss_fn, batch = sequential(model)
    last = where[-1] == rank
    if side in ("ours", NO_CACHE):
        plan = Plan(model, BATCH, WORLD, schedule, [StagePlan(a, b, 1, (r,), 0.0)
                                                    for (a, b), r in zip(stages, where)], 1.0, 1.0)
        tuning = Tuning(cpu_cache_mb=0) if side == NO_CACHE else Tuning()
        return ours_steps(module, loss_fn, lambda ps: torch.optim.SGD(ps, lr=LR), [batch] * total,
                          warmup, last, began, plan=plan, schedule=schedule, chunks=chunks,
                          tuning=tuning)
    from torch.distributed import pipelining

    # gloo's I/O threads (the default group's, which torch's stages use) as torch's users
    # have them, or as our Pipeline sets them (`Tuning.io_priority`'s "auto")
    set_io_priority("auto" if side == OUR_IO else "normal")
    blocks = list(module.children())
    parts = [pipelining.PipelineStage(nn.Sequential(*blocks[a:b]), k, len(stages),
                                      torch.device("cpu"))
             for k, (a, b) in enumerate(stages) if where[k] == rank]
    opt = torch.optim.SGD([p for s in parts for p in s.submod.parameters()], lr=LR)
    sched = getattr(pipelining, schedule)(parts if len(parts) > 1 else parts[0], chunks,
                                          loss_fn=loss_fn)
    call = (batch[:1] if where[0] == rank else (), {"target": batch[1]} if last else {})
    return timed(torch_steps(sched, opt, [call] * total, last), warmup, last, began)


def row_rank(rank: int, world: int, ours: str, theirs: str, repeats: int,
             *args: Any) -> dict[str, list[Any]]:
    """Both sides in interleaved rounds in this rank process, each run from a fresh model."""
    return rounds({"ours": lambda: side_rank(rank, world, "ours", ours, *args),
                   "torch": lambda: side_rank(rank, world, "torch", theirs, *args),
                   OUR_IO: lambda: side_rank(rank, world, OUR_IO, theirs, *args)}, repeats)


def measure(model: str, ours: str, theirs: str, stages: list[tuple[int, int]], chunks: int,
            sz: dict[str, int]) -> dict[str, Any]:
    where = stage_ranks(ours, len(stages))
    by_rank = launch(row_rank, WORLD, ours, theirs, sz["repeats"], model, stages, chunks,
                     sz["warmup"], sz["steps"], where, threads_per_rank=1)
    runs = {side: [one_run(list(ranks), BATCH * sz["steps"])
                   for ranks in zip(*(r[side] for r in by_rank))]
            for side in ("ours", "torch", OUR_IO)}
    gaps = [loss_gaps(a["losses"], b["losses"]) for a, b in zip(runs["ours"], runs["torch"])]
    first, last = (max(g[k] for g in gaps) for k in (0, 1))
    n = len(stages)
    return {"schedule": ours, "torch_schedule": theirs, "stages": n, "bounds": stages,
            "placement": placement_name(ours, n), "ranks": where, "microbatches": chunks,
            **side_by_side(runs), "first_loss": runs["torch"][0]["losses"][0],
            "first_loss_diff": first, "last_loss_diff": last,
            "losses_agree": first <= FIRST_LOSS_TOL and last <= LAST_LOSS_TOL, "runs": runs}


def goal(rows: list[dict[str, Any]], names: tuple[str, ...], least: float) -> dict[str, Any]:
    """Each of `names` at least `least` times torch's, losses agreeing: met?"""
    mine = [r for r in rows if r["schedule"] in names]
    ok = [r for r in mine if "error" not in r]
    theirs = ", ".join(dict.fromkeys(r["torch_schedule"] for r in mine))
    return {"text": f"{', '.join(names)} each at least {least}x torch's {theirs} on the same "
                    f"stages and microbatches, losses agreeing",
            "met": bool(mine) and len(ok) == len(mine) and all(
                r["ratio"] >= least and r["losses_agree"] for r in ok),
            "worst_ratio": min((r["ratio"] for r in ok), default=0.0),
            "ratios": {f"{r['schedule']} {r['microbatches']}": r.get("ratio") for r in mine},
            "failed": [f"{r['schedule']} {r['microbatches']}" for r in mine if "error" in r]}


def run_pairs(sz: dict[str, int], model: str) -> dict[str, Any]:
    began, rows = time.monotonic(), []
    for ours, theirs, stages, counts in PAIRS[model]:
        for chunks in counts:
            try:
                r = measure(model, ours, theirs, stages, chunks, sz)
            except Exception as error:  # noqa: BLE001 - a side that cannot run is a result
                harness.unless_stopped(error)
                r = {"schedule": ours, "torch_schedule": theirs, "stages": len(stages),
                     "bounds": stages, "placement": placement_name(ours, len(stages)),
                     "microbatches": chunks,
                     "error": harness.shorten(error, 600)}
            rows.append(r)
            harness.say(f"{ours} {len(stages)} stages {chunks} mb: ratio "
                        f"{harness.fmt(r.get('ratio'), '.2f')} {r.get('error', '')}")
    return {"settings": {**sz, "model": model, "batch": BATCH, "lr": LR, "ranks": WORLD,
                         "threads_per_rank": 1, "stages2": PAIRS[model][0][2],
                         **({"stages4": A4} if model == "cnn" else {})},
            "machine": harness.machine_info(), "rows": rows,
            **{key: goal(rows, *spec) for key, spec in GOALS[model].items()},
            "losses_agree": all(r.get("losses_agree", False) for r in rows),
            "wall_s": time.monotonic() - began}


def pairs_markdown(result: dict[str, Any]) -> str:
    s, cnn = result["settings"], result["settings"]["model"] == "cnn"
    bounds = "; ".join(" | ".join(f"[{a}, {b})" for a, b in s[key])
                       for key in ("stages2", "stages4") if key in s)
    model = (f"Model A (`build_cnn`), batch {s['batch']}; stages (blocks [start, stop)) {bounds}, "
             f"looped (ranks 0, 1, 0, 1) or in a V (0, 1, 1, 0)" if cnn else
             f"The zoo's nanoGPT (tests/zoo/gpt.py), {LAYERS} layers, width {WIDTH}, {HEADS} "
             f"heads, vocabulary {VOCAB}, head untied; batch {s['batch']} of {SEQ} tokens; "
             f"stages (blocks: embeddings, layers, ln_f, head) {bounds}: little compute per "
             f"microbatch, so each runtime's own cost dominates")
    lines = head("pipedream_fast vs torch.distributed.pipelining, " + (
        "model A" if cnn else "a small transformer") + ", 2 ranks, CPU", result, [
        f"- {model}; the same on both sides. One fixed batch, SGD lr {s['lr']}; {s['ranks']} "
        f"ranks, gloo on loopback, 1 thread per rank.",
        f"- Samples/s: {s['steps']} steps after {s['warmup']} warm-up; {s['repeats']} run(s) of "
        f"each side in interleaved rounds (ours, torch, torch with our I/O priority, then the "
        f"other way round, ...) in one pair of "
        f"processes, each from a fresh model; medians, their ratio; per round: the lowest and "
        f"highest round's ratio (the noise). Others: the most CPU other processes took in a "
        f"window (of {result['machine']['cores']} cores).",
        f"- Losses: first and last step's mean microbatch loss, ours against torch, largest "
        f"difference; agreed within {FIRST_LOSS_TOL:g} and {LAST_LOSS_TOL:g}.",
        IO_NOTE, CACHE_NOTE])
    table, errors = [], []
    for r in result["rows"]:
        row = [f"{r['schedule']} / {r['torch_schedule']}", r["stages"],
               ", ".join(map(str, r.get("ranks", []))) or "-", r["microbatches"]]
        if "error" in r:
            table.append(row + ["failed", "failed"] + ["-"] * 8)
            errors.append(f"- {row[0]}, {r['microbatches']} microbatches: `{r['error']}`")
            continue
        table.append(row + [f"{r['torch_samples_per_s']:.1f}", f"{r['ours_samples_per_s']:.1f}",
                            f"{r['ratio']:.2f}x",
                            f"{min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f}",
                            harness.fmt(r.get("torch_our_io_samples_per_s"), ".1f", "-"),
                            harness.fmt(r.get("ratio_our_io"), ".2f", "-") + "x",
                            f"{r['first_loss_diff']:.1e}", f"{r['last_loss_diff']:.1e}",
                            "yes" if r["losses_agree"] else "**NO**",
                            f"{r['other_cores_max']:.2f}"])
    lines += harness.markdown_table(
        ["schedule (ours / torch)", "stages", "ranks", "microbatches", "torch samples/s",
         "ours samples/s", "ours/torch", "per round", "torch, our I/O priority samples/s",
         "ours/that", "first-step loss diff", "last-step loss diff",
         "losses agree", "others (cores)"], table)
    lines += ["", "Failed rows (the error, as raised):", "", *errors] if errors else []
    for g in (result[key] for key in ("goal", "new_goal") if key in result):
        measured = ", ".join(f"{k}: {harness.fmt(x, '.2f', 'failed')}x"
                             for k, x in g["ratios"].items())
        lines += ["", f"Goal: {g['text']}: **{'met' if g['met'] else 'missed'}** "
                      f"(measured {measured})."]
    return "\n".join(lines + ["", "Losses: " + (
        "ours and torch agree on every pair." if result["losses_agree"] else
        "**ours and torch DISAGREE (or a side failed) on at least one pair.**")]) + "\n"


# ---- model_a: one run each, against plain training in one process ---------------------------

def run_model_a(sz: dict[str, int], out: str | None) -> None:
    def alone(threads: int) -> float:  # plain training in this process
        torch.set_num_threads(threads)
        model, loss_fn, (x, y) = sequential("cnn")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(sz["warmup"] + sz["steps"]):
            if step == sz["warmup"]:
                start = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        torch.set_num_threads(1)
        return BATCH * sz["steps"] / (time.perf_counter() - start)

    def solo(side: str, schedule: str, chunks: int) -> float:
        ranks = launch(side_rank, WORLD, side, schedule, "cnn", A2, chunks, sz["warmup"],
                       sz["steps"], stage_ranks("1f1b", len(A2)), threads_per_rank=1)
        return harness.window(ranks, BATCH * sz["steps"])["samples_per_s"]

    rows: list[tuple[str, float]] = []
    for label, fn, *args in (
            *((f"single process, {t} thread{'s' * (t > 1)}", alone, t) for t in (1, 2)),
            *((f"torch.distributed.pipelining 1F1B, 2 ranks, {c} microbatches", solo, "torch",
               "Schedule1F1B", c) for c in (2, 4)),
            ("pipedream_fast pipedream, 2 ranks (minibatch = microbatch)", solo, "ours",
             "pipedream", 1),
            ("pipedream_fast 1f1b, 2 ranks, 4 microbatches", solo, "ours", "1f1b", 4)):
        rows.append((label, fn(*args)))
        harness.say(f"{label:64s} {rows[-1][1]:7.1f} samples/s")
    if out:
        harness.write_results(out, "Model A, batch 32, CPU", [],
                              ["contender", "samples/s", "vs 1-thread single process"],
                              [(n, f"{v:.1f}", f"{v / rows[0][1]:.2f}x") for n, v in rows])


# ---- the zoo's transformers (tests/zoo, 2 stages, 1F1B, 2 microbatches, SGD with momentum) --

def the_zoo() -> Any:
    import zoo  # tests/zoo; imports torchvision the way it must come before transformers

    return zoo


def build(name: str, no_cache: bool = False) -> nn.Module:
    """The zoo's model, seeded, as built; `no_cache`: with `config.use_cache=False`."""
    model = the_zoo().ZOO[name].build()
    if no_cache:
        model.config.use_cache = False
    return model


def batches(name: str, count: int) -> list[Any]:
    return the_zoo().ZOO[name].batches(count, 1)


def named_inputs(model: nn.Module, item: Any) -> dict[str, Any]:
    """A loader item as the model's keyword arguments (nanoGPT's `(idx, targets)` by name)."""
    return dict(item if isinstance(item, dict) else
                inspect.signature(model.forward).bind(*item).arguments)


def torch_split(name: str, model: nn.Module, item: Any) -> Any:
    """torch's split of `model` before SPLIT[name], traced on one microbatch given by keyword."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    mb = split_microbatches(named_inputs(model, item), CHUNKS)[0]
    return pipeline(model, mb_args=(), mb_kwargs=mb, split_spec={SPLIT[name]: SplitPoint.BEGINNING})


def torch_probe(name: str) -> dict[str, Any]:
    """pipeline() on the model as built, then (Hugging Face) with use_cache=False."""
    out: dict[str, Any] = {}
    for key, no_cache in (("as_built", False), ("use_cache_false", True)):
        if no_cache and (out["as_built"] == "ok" or
                         not getattr(getattr(build(name), "config", None), "use_cache", False)):
            break
        try:
            torch_split(name, build(name, no_cache), batches(name, 1)[0])
            out[key] = "ok"
        except Exception as err:  # noqa: BLE001 - recorded
            out[key] = harness.shorten(err)
    return out


class LossOutsideGPT(nn.Module):
    """The zoo's nanoGPT EDITED for the loss outside (without targets it computes the last
    position's logits only): the same modules, its forward with targets less the loss."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.config, self.transformer, self.lm_head = gpt.config, gpt.transformer, gpt.lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def outside_loss(name: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    """The model's own loss: cross entropy (Llama's and GPT-2's on labels shifted by one)."""
    logits = out[0] if isinstance(out, (tuple, list)) else out
    if name in ("nanogpt", "bert"):
        return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-1)
    from transformers.loss.loss_utils import ForCausalLMLoss  # what Llama and GPT-2 call

    return ForCausalLMLoss(logits, y, vocab_size=logits.size(-1))


def zoo_torch(rank: int, name: str, items: list[Any], warmup: int, no_cache: bool,
              mode: str = "inside") -> dict[str, Any]:
    """torch's Schedule1F1B. "inside": the model called with its targets (a later stage's model
    inputs go to its rank's step() by placeholder name); "outside": without them, the same
    loss in the schedule's loss_fn (nanoGPT: `LossOutsideGPT`, an edit)."""
    from torch.distributed.pipelining import Schedule1F1B

    began = time.perf_counter()
    model = build(name, no_cache)
    named = [named_inputs(model, item) for item in items]
    target = "targets" if name == "nanogpt" else "labels"
    # "inside": the loss_fn ignores the target, the schedule only splits it
    targets = [n.pop(target) if mode == "outside" else torch.zeros(the_zoo().BATCH)
               for n in named]
    if mode == "outside" and name == "nanogpt":
        model = LossOutsideGPT(model)
    pipe = torch_split(name, model, named[0])
    stage = pipe.build_stage(rank, torch.device("cpu"))
    # the model inputs this stage consumes: {model input name: its stage module's placeholder}
    node = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"][rank]
    holders = [n.name for n in pipe.get_stage_module(rank).graph.nodes if n.op == "placeholder"]
    mine = {arg.target: ph for arg, ph in zip(node.args, holders)
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder"}
    last = rank == WORLD - 1
    sched = Schedule1F1B(stage, CHUNKS, loss_fn=functools.partial(outside_loss, name)
                         if mode == "outside" else lambda out, _target: model_loss(out))
    calls = [((), {**{ph: n[root] for root, ph in mine.items()},
                   **({"target": t} if last else {})}) for n, t in zip(named, targets)]
    result = {**timed(torch_steps(sched, sgd(stage.submod.parameters()), calls, last), warmup,
                      last, began), "mode": mode}
    if name in TIED:
        result["tied"] = stage.submod.get_parameter(TIED[name][min(rank, 1)]).detach().clone()
    return result


def zoo_ours(rank: int, name: str, items: list[Any], warmup: int,
             no_cache: bool) -> dict[str, Any]:
    began, model = time.perf_counter(), build(name, no_cache)
    return ours_steps(model, None, sgd, items, warmup, rank == WORLD - 1, began,
                      model.get_parameter(TIED[name][0]) if name in TIED else None,
                      split_points=[SPLIT[name]], schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT)


def attempt(fn: Any, rank: int, name: str, items: list[Any], *args: Any) -> dict[str, Any]:
    """`fn` on a process group of its own (a failure must not break the next run), its error
    as its result; rank 0 says how it went."""
    harness.fresh_group(rank, WORLD, next(GROUPS), timeout_s=TIMEOUT)
    began = time.monotonic()
    try:
        result = fn(rank, name, items, *args)
    except Exception as err:  # noqa: BLE001 - reported in the table
        result = {"error": harness.shorten(err), "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.monotonic() - began
    if rank == 0:
        harness.say(f"  {name} {fn.__name__}{args[1:]}, {len(items)} steps: "
                    f"{'FAILED' if 'error' in result else 'ok'} in {result['wall_s']:.1f} s")
    return result


def zoo_rank(rank: int, world: int, models: list[str], warmup: int, steps: int,
             repeats: int) -> dict[str, Any]:
    """Per model: torch's probe (rank 0); one step of ours on the model as built where torch
    needs use_cache=False, one of torch on the model as called; `repeats` rounds of both."""
    out = {}
    for name in models:
        harness.fresh_group(rank, WORLD, next(GROUPS), timeout_s=TIMEOUT)
        shared = [torch_probe(name) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        no_cache = shared[0].get("use_cache_false") == "ok"
        out[name] = {"probe": shared[0], "no_cache": no_cache}
        if no_cache:
            out[name]["ours_as_built"] = attempt(zoo_ours, rank, name, batches(name, 1), 1, False)
        inside = out[name]["torch_inside"] = attempt(zoo_torch, rank, name, batches(name, 1), 1,
                                                     no_cache)
        items, mode = batches(name, warmup + steps), "outside" if "error" in inside else "inside"
        out[name]["runs"] = rounds(
            {"ours": functools.partial(attempt, zoo_ours, rank, name, items, warmup, no_cache),
             "torch": functools.partial(attempt, zoo_torch, rank, name, items, warmup, no_cache,
                                        mode)}, repeats)
    dist.destroy_process_group()
    return out


def reference(name: str, items: list[Any]) -> tuple[list[float], list[torch.Tensor]]:
    """The one-process loop, CHUNKS microbatches' gradients accumulated per step: its losses;
    the tied weight at the end and at the start."""
    model = build(name).train()
    tied = [model.get_parameter(TIED[name][0]).detach().clone()] if name in TIED else []
    opt, losses = sgd(model.parameters()), []
    for item in items:
        opt.zero_grad()
        total = 0.0
        for mb in split_microbatches(item, CHUNKS):
            loss = model_loss(the_zoo().call(model, mb))
            (loss / CHUNKS).backward()
            total += float(loss.detach()) / CHUNKS
        opt.step()
        losses.append(total)
    return losses, [model.get_parameter(TIED[name][0]).detach().clone()] + tied if tied else []


def drift(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def zoo_summary(ranks: list[dict[str, Any]], steps: int, want: list[float],
                tied: list[torch.Tensor]) -> dict[str, Any]:
    """`one_run`, its losses against the loop's `want`, its tied weights' drift against the loop's
    `tied` (end, start); "ok": it ran, with the loop's first loss."""
    run = one_run(ranks, the_zoo().BATCH * steps)
    if "error" not in run:
        run["first_loss_rel_diff"], run["last_loss_rel_diff"] = loss_gaps(run["losses"], want,
                                                                          relative=True)
        embedding, lm_head = ranks[0].get("tied"), ranks[-1].get("tied")
        if tied and embedding is not None and lm_head is not None:
            run.update(zip((f"tied_{key}" for key in DRIFTS), (
                drift(embedding, lm_head), drift(embedding, tied[0]), drift(lm_head, tied[0]),
                drift(*tied))))
    run["ok"] = "error" not in run and run["first_loss_rel_diff"] <= FIRST_TOL
    return run


def zoo_row(name: str, records: list[dict[str, Any]], sz: dict[str, int]) -> dict[str, Any]:
    want, tied = reference(name, batches(name, sz["warmup"] + sz["steps"]))
    sides = {side: [zoo_summary(list(ranks), sz["steps"], want, tied)
                    for ranks in zip(*(rec["runs"][side] for rec in records))]
             for side in ("ours", "torch")}
    check = {key: zoo_summary([rec[key] for rec in records], 1, want[:1], [])
             for key in ("torch_inside", "ours_as_built") if key in records[0]}
    probe, inside, as_built = records[0]["probe"], check["torch_inside"], check.get("ours_as_built")
    ok = {side: [r for r in runs if "error" not in r] for side, runs in sides.items()}
    errors = {side: next((r["error"] for r in runs if "error" in r), None)
              for side, runs in sides.items()}
    needs = ("config.use_cache=False" if probe["as_built"] != "ok"
             and probe.get("use_cache_false") == "ok" else None)
    row = {"model": name, "split_at": SPLIT[name], "tied": name in TIED,
           "ours_split": ("no: fails to train" if not ok["ours"] else
                          "yes" if as_built is None or as_built["ok"] else
                          "no: fails to train (use_cache=True)" if "error" in as_built else
                          "no: its loss differs from the loop's (use_cache=True)"),
           "ours_as_built": as_built, "torch_needs": needs, "torch_probe": probe,
           "torch_split": ("yes" if probe["as_built"] == "ok" else
                           f"no: needs {needs}" if needs else "no"),
           "torch_trains": ("yes" if inside["ok"] else "no: fails at its first step"
                            if "error" in inside else "no: its loss differs from the loop's"),
           "torch_inside": inside, "torch_mode": "inside" if inside["ok"] else "outside",
           "ours_error": errors["ours"], "torch_error": errors["torch"], **side_by_side(sides),
           "loop_first_loss": want[0], "loop_last_loss": want[-1]}
    for side, runs in ok.items():  # set-up: the median run's; the others: the worst run's
        row[f"{side}_first_step_s"] = (statistics.median(r["first_step_s"] for r in runs)
                                       if runs else None)
        for key in ("first_loss_rel_diff", "last_loss_rel_diff", *(f"tied_{d}" for d in DRIFTS)):
            row[f"{side}_{key}"] = max((r[key] for r in runs if key in r), default=None)
    return {**row, "runs": sides, "no_cache": records[0]["no_cache"]}


def run_zoo(sz: dict[str, int], models: tuple[str, ...]) -> dict[str, Any]:
    began = time.monotonic()
    by_rank = launch(zoo_rank, WORLD, list(models), sz["warmup"], sz["steps"], sz["repeats"],
                     timeout=TIMEOUT, threads_per_rank=1)
    return {"settings": {**sz, "models": list(models), "batch": the_zoo().BATCH,
                         "chunks": CHUNKS, "ranks": WORLD, "threads_per_rank": 1, "lr": LR,
                         "momentum": MOMENTUM, "split": {m: SPLIT[m] for m in models}},
            "machine": harness.machine_info(transformers=version("transformers")),
            "rows": [zoo_row(name, [r[name] for r in by_rank], sz) for name in models],
            "wall_s": time.monotonic() - began, "command": harness.command()}


def zoo_markdown(result: dict[str, Any]) -> str:
    s, rows = result["settings"], result["rows"]
    lines = head("pipedream_fast vs torch.distributed.pipelining on the zoo's transformers, "
                 "2 ranks, CPU", result, [
        f"- The test zoo's models (tiny, seeded, each computing its own loss), batch "
        f"{s['batch']}, {s['chunks']} microbatches, 1F1B, 2 stages cut before the second layer; "
        f"{s['ranks']} ranks, gloo, 1 thread each; SGD lr {s['lr']}, momentum {s['momentum']}.",
        "- Splits it: torch `pipeline(model, split_spec=...)`, ours `Pipeline(model, "
        "loss_fn=None, split_points=[layer])`, as built (if torch needs `use_cache=False`, the "
        "measured runs use it, one run of ours trains it as built). Trains it: one step of "
        "torch's Schedule1F1B with the targets among the inputs, loss as the loop's; else "
        "torch's runs compute the loss in `loss_fn` (mode 'outside'; nanoGPT: `LossOutsideGPT`).",
        f"- Samples/s: {s['steps']} steps after {s['warmup']} warm-up; {s['repeats']} run(s) of "
        f"each side in interleaved rounds in one pair of processes; medians, their ratio "
        f"(brackets: each round's). Set-up: model built to the end of its first step. "
        f"Others: CPU other processes took (of {result['machine']['cores']} cores).",
        f"- Losses: first and last step's against the one-process loop (gradient accumulation), "
        f"relative, worst run; equal within {FIRST_TOL:g} and {LAST_TOL:g}. Tied drift after "
        f"{s['warmup'] + s['steps']} steps: max |embedding - head| / max |head|; identical "
        f"within {DRIFT_TOL:g}."])

    def pair(r: dict[str, Any], key: str, spec: str = ".1e") -> str:
        return f"{harness.fmt(r['ours_' + key], spec)} / {harness.fmt(r['torch_' + key], spec)}"

    table, failures = [], []
    for r in rows:
        ratio = harness.fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else "")
        if len(r["pair_ratios"]) > 1:
            ratio += " (" + ", ".join(f"{x:.2f}" for x in r["pair_ratios"]) + ")"
        table.append([r["model"], r["ours_split"], r["torch_split"], r["torch_trains"],
                      r["torch_mode"], harness.fmt(r["torch_samples_per_s"], none="failed"),
                      harness.fmt(r["ours_samples_per_s"], none="failed"), ratio,
                      pair(r, "first_loss_rel_diff"), pair(r, "last_loss_rel_diff"),
                      pair(r, "tied_embedding_vs_head") if r["tied"] else "(untied)",
                      pair(r, "first_step_s", ".1f"), harness.fmt(r["other_cores_max"], ".2f")])
        said = {"torch `pipeline()` on the model as built": r["torch_probe"]["as_built"],
                "torch `pipeline()` with use_cache=False": r["torch_probe"].get("use_cache_false"),
                "torch training the model as called": r["torch_inside"].get("error"),
                "ours on the model as built": (r["ours_as_built"] or {}).get("error"),
                "ours's measured runs": r["ours_error"], "torch's measured runs": r["torch_error"]}
        failures += [f"- {r['model']}, {where}: `" + text.replace("`", "'").replace("|", "/")
                     + "`" for where, text in said.items() if text not in (None, "ok")]
    lines += harness.markdown_table(
        ["model", "ours splits and trains it", "torch splits it", "torch trains it", "torch mode",
         "torch samples/s", "ours samples/s", "ours/torch",
         "first-step loss vs loop (ours / torch)", "last-step loss vs loop (ours / torch)",
         "tied drift (ours / torch)", "set-up s (ours / torch)", "others (cores)"], table, left=5)
    lines += ["", "Failures, verbatim (shortened; each error, then its cause after '<-'):", "",
              *(failures or ["- none"]), "",
              "Tied weights against the loop's after the same steps (max |w - w_loop| / max "
              "|w_loop|; last column: how far the loop's weight moved from its start):", ""]
    lines += harness.markdown_table(
        ["model", "ours embedding", "ours head", "torch embedding", "torch head", "loop moved"],
        [[r["model"]] + [harness.fmt(r[k], ".1e") for k in (
            "ours_tied_embedding_vs_loop", "ours_tied_head_vs_loop",
            "torch_tied_embedding_vs_loop", "torch_tied_head_vs_loop")]
         + [harness.fmt(r["ours_tied_loop_moved"] or r["torch_tied_loop_moved"], ".1e")]
         for r in rows if r["tied"]])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default="pairs",
                        choices=("pairs", "transformer", "model_a", "zoo"))
    parser.add_argument("--quick", action="store_true", help="fewest steps, 1 repeat: does it run?")
    for name in ("steps", "warmup", "repeats"):
        parser.add_argument(f"--{name}", type=harness.positive, help="default by set: " + ", ".join(
            f"{k} {v[name]}" for k, v in DEFAULT.items()))
    parser.add_argument("--models", default=",".join(MODELS), help="zoo: which, comma-separated")
    parser.add_argument("--out", help="write the markdown here (and the JSON beside it)")
    args = parser.parse_args()
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models or set(models) - set(MODELS):
        parser.error(f"--models: choose among {', '.join(MODELS)}")
    torch.set_num_threads(1)
    which = args.set if args.set in DEFAULT else "pairs"
    sz = harness.sizes(args, DEFAULT[which], QUICK[which], args.quick)
    if args.set == "model_a":
        run_model_a(sz, args.out)
    elif args.set == "zoo":
        result = run_zoo(sz, models)
        harness.emit(args.out, zoo_markdown(result), result)
    else:
        result = run_pairs(sz, "gpt" if args.set == "transformer" else "cnn")
        harness.emit(args.out, pairs_markdown(result), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
