"""pipedream_fast against torch.distributed.pipelining, side by side on 2 ranks (gloo on loopback,
one intra-op thread each), samples/s in steady state. Sets (results in bench/results/):

  pairs (default)  model A, each of our schedules against torch's on the same stages and
                   microbatches, in interleaved rounds; losses compared (vs_pipelining.md)
  model_a          one run each: single process, torch Schedule1F1B, ours (model_a.md)
  interleaved      the planner's straight and looped plans, with the simulator (interleaved.md)
  zoo              the test zoo's transformers unedited: who splits and trains them, samples/s
                   in interleaved rounds, losses against a one-process loop, tied-weight drift
                   (zoo_vs_pipelining.md)

    python bench/vs_pipelining.py [--set pairs|model_a|interleaved|zoo] [--steps N] [--warmup N]
        [--repeats N] [--quick] [--models nanogpt,llama,gpt2,bert] [--out FILE.md]
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
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn
from pipedream_fast.training import model_loss, split_microbatches

import harness  # noqa: E402 - a sibling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the zoo set's `zoo`

BATCH, WORLD, LR = 32, 2, 0.01
BOUNDS = {2: [(0, 6), (6, 9)], 4: [(0, 3), (3, 6), (6, 7), (7, 9)]}  # blocks [start, stop)
# ours, torch's class, stages, microbatch counts per step, placement of the stages on the ranks
PAIRS = (("gpipe", "ScheduleGPipe", 2, (2, 4), "looped"),
         ("1f1b", "Schedule1F1B", 2, (2, 4), "looped"),
         ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, (4,), "looped"),
         ("zb-v", "ScheduleZBVZeroBubble", 4, (4, 8), "v"),
         ("dualpipe-v", "ScheduleDualPipeV", 4, (4, 8), "v"),
         ("interleaved-zb", "ScheduleInterleavedZeroBubble", 4, (4, 8), "looped"),
         ("looped-bfs", "ScheduleLoopedBFS", 4, (4, 8), "looped"))
DEFAULT = {"pairs": {"warmup": 3, "steps": 12, "repeats": 5},
           "zoo": {"warmup": 3, "steps": 40, "repeats": 2}}
QUICK = {"pairs": {"warmup": 2, "steps": 3, "repeats": 1},
         "zoo": {"warmup": 1, "steps": 2, "repeats": 1}}
FIRST_LOSS_TOL = 1e-4  # float32, mean of a few microbatch losses near 2.3
LAST_LOSS_TOL = 1e-3  # the same after a few SGD updates, accumulated in other orders
GOAL = 1.2  # 1f1b against Schedule1F1B
NEW_GOAL = 1.05  # issue 31: each of these against torch's, on the same stages and microbatches
NEW = ("zb-v", "dualpipe-v", "interleaved-zb", "looped-bfs")

MODELS = ("nanogpt", "llama", "gpt2", "bert")
SPLIT = {"nanogpt": "transformer.h.1", "llama": "model.layers.1", "gpt2": "transformer.h.1",
         "bert": "bert.encoder.layer.1"}
TARGET = {"nanogpt": "targets", "llama": "labels", "gpt2": "labels", "bert": "labels"}
# (embedding, head) of the models that tie them: the names of the one shared parameter
TIED = {"nanogpt": ("transformer.wte.weight", "lm_head.weight"),
        "llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight")}
DRIFTS = ("embedding_vs_head", "embedding_vs_loop", "head_vs_loop", "loop_moved")
CHUNKS, MOMENTUM = 2, 0.9
TIMEOUT = 60.0  # zoo: every collective and transfer; a one-sided failure costs at most this
FIRST_TOL, LAST_TOL = 1e-5, 1e-4  # zoo: relative, first step's loss (the forwards) and last's
DRIFT_TOL = 1e-6  # relative to the weight's largest entry: "identical" up to float noise
# A rank's error that only says its peer failed first: the table shows the peer's own.
PEER_SYMPTOM = re.compile(r"Connection (closed|reset)|Read error|Timed out|timed out|"
                          r"Broken pipe")
GROUPS = itertools.count()  # zoo: a process group per run, numbered alike on the ranks


# ---- shared by the sets ---------------------------------------------------------------------

def timed(steps: Iterable[Any], warmup: int, last: bool, began: float) -> dict[str, Any]:
    """A rank's run: `steps` yields each step's loss; the clock from the end of the warm-up,
    the last stage's losses, the set-up (from `began` to the end of the first step)."""
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


def rounds(sides: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, list[Any]]:
    """Each side's runs in interleaved rounds (`harness.alternate`), the last run's model
    collected before the next is built; a side that failed is not run again (the same failure
    again says nothing new)."""
    latest: dict[str, dict[str, Any]] = {}

    def driver(key: str) -> Callable[[], dict[str, Any] | None]:
        def one() -> dict[str, Any] | None:
            if "error" in latest.get(key, {}):
                return None
            gc.collect()
            latest[key] = sides[key]()
            return latest[key]
        return one

    runs = harness.alternate({key: driver(key) for key in sides}, repeats, warmup=False)
    return {key: [r for r in rs if r is not None] for key, rs in runs.items()}


def one_run(ranks: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """One run of one side from every rank's result: its window and losses; failed: the error
    of the rank whose error is its own, not its peer's dropped connection."""
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        own = [e for e in errors if not PEER_SYMPTOM.search(e)]
        return {"error": (own or errors)[0],
                "tracebacks": [r.get("traceback", "") for r in ranks if "error" in r]}
    return {**harness.window(ranks, samples), "first_step_s": max(r["first_step_s"] for r in ranks),
            "losses": next(r["losses"] for r in ranks if r["losses"] is not None)}


def side_by_side(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the runs that did not fail, their ratio, each round's ratio, the most CPU
    other processes took during a window."""
    ok = {side: [r for r in rs if "error" not in r] for side, rs in runs.items()}
    med = {side: statistics.median(r["samples_per_s"] for r in rs) if rs else None
           for side, rs in ok.items()}
    return {"ours_samples_per_s": med["ours"], "torch_samples_per_s": med["torch"],
            "ratio": med["ours"] / med["torch"] if med["ours"] and med["torch"] else None,
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


# ---- model A --------------------------------------------------------------------------------

def stage_rank(k: int, num_stages: int, placement: str) -> int:
    """Looped: stage k on rank k mod WORLD; "v": rank r holds stages r and 2 WORLD - 1 - r."""
    if placement == "v" and num_stages == 2 * WORLD:
        return k if k < WORLD else num_stages - 1 - k
    return k % WORLD


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch as bench/vs_ddp.py."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def torch_rank(rank: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
               warmup: int, steps: int, placement: str) -> dict[str, Any]:
    """torch.distributed.pipelining: this rank's stages of build_cnn(), `schedule`."""
    from torch.distributed import pipelining

    began = time.perf_counter()
    torch.manual_seed(0)
    children = list(build_cnn().children())
    mine = [k for k in range(len(stages)) if stage_rank(k, len(stages), placement) == rank]
    parts = [pipelining.PipelineStage(nn.Sequential(*children[stages[k][0]:stages[k][1]]), k,
                                      len(stages), torch.device("cpu")) for k in mine]
    opt = torch.optim.SGD([p for s in parts for p in s.submod.parameters()], lr=LR)
    sched = getattr(pipelining, schedule)(parts if len(parts) > 1 else parts[0], chunks,
                                          loss_fn=nn.functional.cross_entropy)
    first, last = 0 in mine, len(stages) - 1 in mine
    x, y = fixed_batch()
    call = ((x,) if first else (), {"target": y} if last else {})
    return timed(torch_steps(sched, opt, [call] * (warmup + steps), last), warmup, last, began)


def ours_rank(rank: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
              warmup: int, steps: int, placement: str) -> dict[str, Any]:
    """pipedream_fast's Pipeline on the same stages."""
    from pipedream_fast.pipeline import Pipeline

    began = time.perf_counter()
    torch.manual_seed(0)
    n, total = len(stages), warmup + steps
    plan = Plan("cnn", BATCH, WORLD, schedule,
                [StagePlan(a, b, 1, (stage_rank(k, n, placement),), 0.0)
                 for k, (a, b) in enumerate(stages)], 1.0, 1.0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=LR), plan=plan, schedule=schedule,
                    chunks=chunks)
    result = timed(pipe.train([fixed_batch()] * total, total), warmup,
                   stage_rank(n - 1, n, placement) == rank, began)
    pipe.close()
    return result


SIDES = {"ours": ours_rank, "torch": torch_rank}


def row_rank(rank: int, world: int, ours: str, theirs: str, stages: list[tuple[int, int]],
             chunks: int, warmup: int, steps: int, repeats: int,
             placement: str) -> dict[str, list[Any]]:
    """Both sides in interleaved rounds in this rank process, each run from a fresh model."""
    args = (stages, chunks, warmup, steps, placement)
    return rounds({"ours": lambda: ours_rank(rank, ours, *args),
                   "torch": lambda: torch_rank(rank, theirs, *args)}, repeats)


def measure(ours: str, theirs: str, stages: list[tuple[int, int]], chunks: int,
            sz: dict[str, int], placement: str) -> dict[str, Any]:
    by_rank = launch(row_rank, WORLD, ours, theirs, stages, chunks, sz["warmup"], sz["steps"],
                     sz["repeats"], placement, threads_per_rank=1)
    runs = {side: [one_run(list(ranks), BATCH * sz["steps"])
                   for ranks in zip(*(r[side] for r in by_rank))] for side in ("ours", "torch")}
    gaps = [loss_gaps(a["losses"], b["losses"]) for a, b in zip(runs["ours"], runs["torch"])]
    first, last = (max(g[k] for g in gaps) for k in (0, 1))
    n = len(stages)
    return {"schedule": ours, "torch_schedule": theirs, "stages": n, "bounds": stages,
            "placement": placement if n > WORLD else "plain",
            "ranks": [stage_rank(k, n, placement) for k in range(n)], "microbatches": chunks,
            **side_by_side(runs), "first_loss": runs["torch"][0]["losses"][0],
            "first_loss_diff": first, "last_loss_diff": last,
            "losses_agree": first <= FIRST_LOSS_TOL and last <= LAST_LOSS_TOL, "runs": runs}


def run_pairs(sz: dict[str, int]) -> dict[str, Any]:
    began, rows = time.monotonic(), []
    for ours, theirs, stages, counts, placement in PAIRS:
        for chunks in counts:
            try:
                r = measure(ours, theirs, BOUNDS[stages], chunks, sz, placement)
            except Exception as error:  # noqa: BLE001 - a side that cannot run is a result
                harness.unless_stopped(error)
                r = {"schedule": ours, "torch_schedule": theirs, "stages": stages,
                     "bounds": BOUNDS[stages], "placement": placement,
                     "microbatches": chunks, "error": harness.shorten(error, 600)}
            rows.append(r)
            harness.say(f"{ours:17s} {stages} stages {chunks} mb: " + (
                f"FAILED {r['error']}" if "error" in r else
                f"ours {r['ours_samples_per_s']:6.1f}  torch {r['torch_samples_per_s']:6.1f}  "
                f"ratio {r['ratio']:.2f}x  loss diff first {r['first_loss_diff']:.1e} "
                f"last {r['last_loss_diff']:.1e}"))
    one = [r for r in rows if r["schedule"] == "1f1b" and "error" not in r]
    new = [r for r in rows if r["schedule"] in NEW]
    new_ok = [r for r in new if "error" not in r]
    worst = min((r["ratio"] for r in one), default=0.0)
    return {"settings": {**sz, "batch": BATCH, "lr": LR, "ranks": WORLD,
                         "threads_per_rank": 1, "stages2": BOUNDS[2], "stages4": BOUNDS[4]},
            "machine": harness.machine_info(), "rows": rows,
            "goal": {"text": f"1f1b at least {GOAL}x Schedule1F1B on the same stages and "
                             f"microbatches", "met": worst >= GOAL, "worst_ratio": worst,
                     "ratios": {str(r["microbatches"]): r["ratio"] for r in one}},
            "new_goal": {"text": f"{', '.join(NEW)} each at least {NEW_GOAL}x torch's "
                                 f"{', '.join(t for o, t, *_ in PAIRS if o in NEW)} on the "
                                 f"same stages and microbatches, losses agreeing",
                         "met": len(new_ok) == len(new) and all(
                             r["ratio"] >= NEW_GOAL and r["losses_agree"] for r in new_ok),
                         "worst_ratio": min((r["ratio"] for r in new_ok), default=0.0),
                         "ratios": {f"{r['schedule']} {r['microbatches']}": r.get("ratio")
                                    for r in new},
                         "failed": [f"{r['schedule']} {r['microbatches']}" for r in new
                                    if "error" in r]},
            "losses_agree": all(r.get("losses_agree", False) for r in rows),
            "wall_s": time.monotonic() - began}


def pairs_markdown(result: dict[str, Any]) -> str:
    s, goal, new = result["settings"], result["goal"], result["new_goal"]
    bounds = {k: " | ".join(f"[{a}, {b})" for a, b in s[f"stages{k}"]) for k in (2, 4)}
    lines = head("pipedream_fast vs torch.distributed.pipelining, model A, 2 ranks, CPU", result, [
        f"- Model A (`build_cnn`), batch {s['batch']}, SGD lr {s['lr']}, one fixed batch; "
        f"{s['ranks']} ranks, gloo on loopback, 1 thread per rank. Stages (blocks [start, stop)): "
        f"{bounds[2]}; {bounds[4]} (the planner's looped plan, `--set interleaved`), looped "
        f"(ranks 0, 1, 0, 1) or in a V (0, 1, 1, 0), the same on both sides.",
        f"- Samples/s: {s['steps']} steps after {s['warmup']} warm-up steps; {s['repeats']} "
        f"repeat(s) in interleaved rounds (ours, torch, then torch, ours, ...) in one pair of "
        f"processes, each from a fresh model; medians, their ratio; per round: the lowest and "
        f"highest round's ratio (the noise).",
        f"- Losses: first and last step's mean microbatch loss, ours against torch, largest "
        f"difference; agreed within {FIRST_LOSS_TOL:g} and {LAST_LOSS_TOL:g}. Others: the most "
        f"CPU other processes took in a window (of {result['machine']['cores']} cores)."])
    table, errors = [], []
    for r in result["rows"]:
        row = [f"{r['schedule']} / {r['torch_schedule']}", r["stages"],
               ", ".join(map(str, r.get("ranks", []))) or "-", r["microbatches"]]
        if "error" in r:
            table.append(row + ["failed", "failed"] + ["-"] * 6)
            errors.append(f"- {row[0]}, {r['microbatches']} microbatches: `{r['error']}`")
            continue
        table.append(row + [f"{r['torch_samples_per_s']:.1f}", f"{r['ours_samples_per_s']:.1f}",
                            f"{r['ratio']:.2f}x",
                            f"{min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f}",
                            f"{r['first_loss_diff']:.1e}", f"{r['last_loss_diff']:.1e}",
                            "yes" if r["losses_agree"] else "**NO**",
                            f"{r['other_cores_max']:.2f}"])
    lines += harness.markdown_table(
        ["schedule (ours / torch)", "stages", "ranks", "microbatches", "torch samples/s",
         "ours samples/s", "ours/torch", "per round", "first-step loss diff", "last-step loss diff",
         "losses agree", "others (cores)"], table)
    if errors:
        lines += ["", "Failed rows (the error, as raised):", "", *errors]
    measured = ", ".join(f"{x:.2f}x at {mb} microbatches" for mb, x in goal["ratios"].items())
    new_measured = ", ".join(f"{name}: " + ("failed" if x is None else f"{x:.2f}x")
                             for name, x in new["ratios"].items())
    lines += ["", f"Goal: {goal['text']}: **{'met' if goal['met'] else 'missed'}** "
                  f"(measured {measured}).", "",
              f"Goal (issue 31): {new['text']}: **{'met' if new['met'] else 'missed'}** "
              f"(measured {new_measured}).", "",
              "Losses: " + ("ours and torch agree on every pair." if result["losses_agree"] else
                            "**ours and torch DISAGREE (or a side failed) on at least one pair: "
                            "those throughput figures may compare different computations.**")]
    return "\n".join(lines) + "\n"


def single_process(threads: int, sz: dict[str, int]) -> float:
    """Samples/s of plain training in this process on `threads` intra-op threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch()
    for step in range(sz["warmup"] + sz["steps"]):
        if step == sz["warmup"]:
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.set_num_threads(1)
    return BATCH * sz["steps"] / (time.perf_counter() - start)


def solo_rank(rank: int, world: int, side: str, *args: Any) -> dict[str, Any]:
    return SIDES[side](rank, *args)


def solo(side: str, schedule: str, stages: list[tuple[int, int]], chunks: int,
         sz: dict[str, int]) -> float:
    """Samples/s of one run of one side on 2 ranks, the stages looped."""
    ranks = launch(solo_rank, WORLD, side, schedule, stages, chunks, sz["warmup"], sz["steps"],
                   "looped", threads_per_rank=1)
    return harness.window(ranks, BATCH * sz["steps"])["samples_per_s"]


def run_set(name: str, sz: dict[str, int], out: str | None) -> None:
    """The single-run sets: model_a; interleaved, on the planner's plans from a profile at the
    microbatch size, with the simulator's prediction."""
    rows: list[tuple[str, float, str]] = []

    def record(label: str, value: float, note: str = "") -> None:
        rows.append((label, value, note))
        harness.say(f"{label:72s} {value:7.1f} samples/s {note}")

    if name == "model_a":
        record("single process, 1 thread", single_process(1, sz))
        record("single process, 2 threads", single_process(2, sz))
        for chunks in (2, 4):
            record(f"torch.distributed.pipelining 1F1B, 2 ranks, {chunks} microbatches",
                   solo("torch", "Schedule1F1B", BOUNDS[2], chunks, sz))
        record("pipedream_fast pipedream, 2 ranks (minibatch = microbatch)",
               solo("ours", "pipedream", BOUNDS[2], 1, sz))
        record("pipedream_fast 1f1b, 2 ranks, 4 microbatches",
               solo("ours", "1f1b", BOUNDS[2], 4, sz))
        if out:
            harness.write_results(out, "Model A, batch 32, CPU", [],
                                  ["contender", "samples/s", "vs 1-thread single process"],
                                  [(n, f"{v:.1f}", f"{v / rows[0][1]:.2f}x") for n, v, _ in rows])
        return
    from pipedream_fast.planner import make_plan
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.schedules import make_schedule
    from pipedream_fast.sim import ProfileCosts, simulate
    from pipedream_fast.topology import Topology

    chunks = 4
    torch.manual_seed(0)
    profile = profile_model(build_cnn(), fixed_batch()[0][: BATCH // chunks], BATCH // chunks,
                            progress=False, model_name="cnn")
    topology = Topology.parse("2x1.25e9")
    plans = [make_plan(profile, topology, schedule="1f1b", straight=True),
             make_plan(profile, topology, schedule="1f1b", stages_per_rank=2)]  # 2 per rank
    bounds = [[(s.start, s.stop) for s in p.stages] for p in plans]  # straight, looped
    harness.say(f"2 stages: {bounds[0]} | 4 looped stages: {bounds[1]}")
    for k, theirs in ((0, "Schedule1F1B"), (1, "ScheduleInterleaved1F1B"),
                      (1, "ScheduleInterleavedZeroBubble")):
        record(f"torch.distributed.pipelining {theirs}, {'2 x 2' if k else '2'} stages",
               solo("torch", theirs, bounds[k], chunks, sz))
    for k, ours in ((0, "1f1b"), (1, "interleaved-1f1b"), (0, "zb-h1")):
        sched = make_schedule(ours, len(bounds[k]), chunks * sz["steps"], chunks=chunks,
                              stage_ranks=[list(s.ranks) for s in plans[k].stages])
        costs = ProfileCosts.from_plan(profile, plans[k], bandwidth=1.25e9)
        guess = BATCH * sz["steps"] / simulate(sched, costs).makespan * 1e3
        record(f"pipedream_fast {ours}, {len(bounds[k])} stages",
               solo("ours", ours, bounds[k], chunks, sz), f"(simulator: {guess:.1f})")
    if out:
        v = [value for _, value, _ in rows]
        harness.write_results(
            out, "Interleaved 1F1B, model A, batch 32, 2 ranks, CPU",
            [f"Stages: 2-stage {bounds[0]}; looped {bounds[1]} (blocks [start, stop), "
             f"stage k on rank k mod 2), from a profile at the microbatch size; {chunks} "
             f"microbatches."],
            ["contender", "samples/s", "note"], [(n, f"{x:.1f}", note) for n, x, note in rows],
            [f"pipedream_fast interleaved-1f1b / torch ScheduleInterleaved1F1B: "
             f"**{v[4] / v[1]:.2f}x**; pipedream_fast zb-h1 / torch "
             f"ScheduleInterleavedZeroBubble: **{v[5] / v[2]:.2f}x**."])


# ---- the zoo's transformers (tests/zoo, 2 stages, 1F1B, 2 microbatches, SGD with momentum) --

def the_zoo() -> Any:
    import zoo  # tests/zoo; imports torchvision the way it must come before transformers

    return zoo


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


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
    if isinstance(item, dict):
        return dict(item)
    args = item if isinstance(item, (tuple, list)) else (item,)
    return dict(inspect.signature(model.forward).bind(*args).arguments)


def torch_split(name: str, model: nn.Module, item: Any) -> Any:
    """torch's split of `model` before SPLIT[name], traced on one microbatch given by keyword."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    mb = split_microbatches(named_inputs(model, item), CHUNKS)[0]
    return pipeline(model, mb_args=(), mb_kwargs=mb,
                    split_spec={SPLIT[name]: SplitPoint.BEGINNING})


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


def outside_loss(name: str) -> Any:
    """The loss each model computes inside, as a loss_fn of (its output, the targets)."""
    from transformers.loss.loss_utils import ForCausalLMLoss  # what Llama and GPT-2 call

    vocab = the_zoo().VOCAB

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out[0] if isinstance(out, (tuple, list)) else out
        if name == "nanogpt":
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1),
                                               ignore_index=-1)
        if name == "bert":
            return nn.functional.cross_entropy(logits.reshape(-1, 3), y.reshape(-1))
        return ForCausalLMLoss(logits, y, vocab_size=vocab)
    return loss


def zoo_torch(rank: int, name: str, items: list[Any], warmup: int, no_cache: bool,
              mode: str = "inside") -> dict[str, Any]:
    """torch's Schedule1F1B. "inside": the model called with its targets (a later stage's model
    inputs go to its rank's step() by placeholder name); "outside": without them, the same
    loss in the schedule's loss_fn (nanoGPT: `LossOutsideGPT`, an edit)."""
    from torch.distributed.pipelining import Schedule1F1B

    began = time.perf_counter()
    model = build(name, no_cache)
    named = [named_inputs(model, item) for item in items]
    # "inside": the loss_fn ignores the target, the schedule only splits it
    targets = [n.pop(TARGET[name]) if mode == "outside" else torch.zeros(the_zoo().BATCH)
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
    sched = Schedule1F1B(stage, CHUNKS, loss_fn=outside_loss(name) if mode == "outside"
                         else lambda out, _target: model_loss(out))
    calls = [((), {**{ph: n[root] for root, ph in mine.items()},
                   **({"target": target} if last else {})}) for n, target in zip(named, targets)]
    result = {**timed(torch_steps(sched, sgd(stage.submod.parameters()), calls, last), warmup,
                      last, began), "mode": mode}
    if name in TIED:
        result["tied"] = stage.submod.get_parameter(TIED[name][min(rank, 1)]).detach().clone()
    return result


def zoo_ours(rank: int, name: str, items: list[Any], warmup: int,
             no_cache: bool) -> dict[str, Any]:
    from pipedream_fast.pipeline import Pipeline

    began = time.perf_counter()
    model = build(name, no_cache)
    tied = model.get_parameter(TIED[name][0]) if name in TIED else None
    pipe = Pipeline(model, loss_fn=None, optimizer=sgd, split_points=[SPLIT[name]],
                    schedule="1f1b", chunks=CHUNKS, timeout=TIMEOUT)
    result = timed(pipe.train(items, steps=len(items)), warmup, rank == WORLD - 1, began)
    if tied is not None:  # this rank's copy, if its stages hold it
        held = {id(p) for m in pipe.stage_modules.values() for p in m.parameters()}
        result["tied"] = tied.detach().clone() if id(tied) in held else None
    pipe.close()
    return result


def attempt(fn: Any, rank: int, name: str, items: list[Any], *args: Any) -> dict[str, Any]:
    """`fn` on a process group of its own (a run that fails on one rank must not break the
    next); its error as its result. Rank 0 says what it ran and how long it took."""
    harness.fresh_group(rank, WORLD, next(GROUPS), timeout_s=TIMEOUT)
    began = time.monotonic()
    try:
        result = fn(rank, name, items, *args)
    except Exception as err:  # noqa: BLE001 - reported in the table
        result = {"error": harness.shorten(err), "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.monotonic() - began
    if rank == 0:
        no_cache, *mode = args[1:]
        harness.say(f"  rank 0: {name} {fn.__name__}{' (use_cache=False)' if no_cache else ''}"
                    f"{''.join(' ' + m for m in mode)}, {len(items)} steps: "
                    f"{'FAILED' if 'error' in result else 'ok'} in {result['wall_s']:.1f} s")
    return result


def zoo_model(rank: int, name: str, warmup: int, steps: int, repeats: int) -> dict[str, Any]:
    """torch's probe (rank 0); ours on the model as built where torch needs use_cache=False;
    torch on the model as called (one step each); then `repeats` rounds of both sides."""
    harness.fresh_group(rank, WORLD, next(GROUPS), timeout_s=TIMEOUT)
    shared = [torch_probe(name) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    no_cache = shared[0].get("use_cache_false") == "ok"
    record: dict[str, Any] = {"probe": shared[0], "no_cache": no_cache}
    if no_cache:  # the measured runs set use_cache=False: ours on the model as built too
        record["ours_as_built"] = attempt(zoo_ours, rank, name, batches(name, 1), 1, False)
    record["torch_inside"] = attempt(zoo_torch, rank, name, batches(name, 1), 1, no_cache)
    mode = "outside" if "error" in record["torch_inside"] else "inside"
    items = batches(name, warmup + steps)
    return {**record, "runs": rounds(
        {"ours": lambda: attempt(zoo_ours, rank, name, items, warmup, no_cache),
         "torch": lambda: attempt(zoo_torch, rank, name, items, warmup, no_cache, mode)}, repeats)}


def zoo_rank(rank: int, world: int, models: list[str], *sizes: int) -> dict[str, Any]:
    out = {name: zoo_model(rank, name, *sizes) for name in models}
    dist.destroy_process_group()
    return out


def reference(name: str, items: list[Any]) -> tuple[list[float], torch.Tensor | None]:
    """The one-process loop: each minibatch in CHUNKS microbatches, gradients accumulated
    (each microbatch's loss / CHUNKS), one SGD step. Returns the losses and the tied weight."""
    model = build(name).train()
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
    return losses, model.get_parameter(TIED[name][0]).detach().clone() if name in TIED else None


def drift(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def zoo_summary(ranks: list[dict[str, Any]], steps: int, want: list[float],
                tied: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """One run of one side: `one_run`, losses against the loop's, and with `tied` (the loop's
    weight at the end and at the start) the tied weights' drift."""
    run = one_run(ranks, the_zoo().BATCH * steps)
    if "error" not in run:
        run["first_loss_rel_diff"], run["last_loss_rel_diff"] = loss_gaps(run["losses"], want,
                                                                          relative=True)
        embedding, lm_head = ranks[0].get("tied"), ranks[-1].get("tied")
        if tied is not None and embedding is not None and lm_head is not None:
            run["tied"] = dict(zip(DRIFTS, (drift(embedding, lm_head), drift(embedding, tied[0]),
                                            drift(lm_head, tied[0]), drift(*tied))))
    return run


def one_step(ranks: list[dict[str, Any]], want: list[float]) -> dict[str, Any]:
    """A one-step check run: trained, with the loop's first loss?"""
    one = zoo_summary(ranks, 1, want[:1])
    if "error" in one:
        return {"ok": False, "error": one["error"]}
    return {"ok": one["first_loss_rel_diff"] <= FIRST_TOL,
            "first_loss_rel_diff": one["first_loss_rel_diff"]}


def zoo_row(name: str, records: list[dict[str, Any]], sz: dict[str, int]) -> dict[str, Any]:
    want, tied = reference(name, batches(name, sz["warmup"] + sz["steps"]))
    if tied is not None:
        tied = (tied, build(name).get_parameter(TIED[name][0]).detach().clone())
    sides = {side: [zoo_summary(list(ranks), sz["steps"], want, tied)
                    for ranks in zip(*(rec["runs"][side] for rec in records))]
             for side in ("ours", "torch")}
    probe, inside = records[0]["probe"], one_step([rec["torch_inside"] for rec in records], want)
    as_built = (one_step([rec["ours_as_built"] for rec in records], want)
                if "ours_as_built" in records[0] else None)
    ok = {side: [r for r in runs if "error" not in r] for side, runs in sides.items()}
    errors = {side: next((r["error"] for r in runs if "error" in r), None)
              for side, runs in sides.items()}
    needs = ("config.use_cache=False" if probe["as_built"] != "ok"
             and probe.get("use_cache_false") == "ok" else None)
    ours_split = "no: fails to train" if errors["ours"] and not ok["ours"] else "yes"
    if ours_split == "yes" and as_built is not None and not as_built["ok"]:
        ours_split = "no: " + ("fails to train (use_cache=True)" if "error" in as_built
                               else "its loss differs from the loop's (use_cache=True)")
    torch_split = "yes" if probe["as_built"] == "ok" else f"no: needs {needs}" if needs else "no"
    torch_trains = ("yes" if inside["ok"] else "no: fails at its first step" if "error" in inside
                    else "no: its loss differs from the loop's")
    row = {"model": name, "split_at": SPLIT[name], "tied": name in TIED, "ours_split": ours_split,
           "ours_as_built": as_built, "torch_split": torch_split, "torch_needs": needs,
           "torch_probe": probe, "torch_trains": torch_trains, "torch_inside": inside,
           "torch_mode": "inside" if inside["ok"] else "outside",
           "ours_error": errors["ours"], "torch_error": errors["torch"], **side_by_side(sides),
           "loop_first_loss": want[0], "loop_last_loss": want[-1]}
    for side, runs in ok.items():
        row[f"{side}_first_step_s"] = (statistics.median(r["first_step_s"] for r in runs)
                                       if runs else None)
        for key in ("first_loss_rel_diff", "last_loss_rel_diff"):
            row[f"{side}_{key}"] = max((r[key] for r in runs), default=None)
        for key in DRIFTS:
            row[f"{side}_tied_{key}"] = max((r["tied"][key] for r in runs if "tied" in r),
                                            default=None)
        first, last = row[f"{side}_first_loss_rel_diff"], row[f"{side}_last_loss_rel_diff"]
        gap = row[f"{side}_tied_embedding_vs_head"]
        row[f"{side}_losses_equal"] = (None if first is None else
                                       bool(first <= FIRST_TOL and last <= LAST_TOL))
        row[f"{side}_tied_identical"] = None if gap is None else bool(gap <= DRIFT_TOL)
    return {**row, "runs": sides, "no_cache": records[0]["no_cache"]}


def run_zoo(sz: dict[str, int], models: tuple[str, ...]) -> dict[str, Any]:
    began = time.monotonic()
    by_rank = launch(zoo_rank, WORLD, list(models), sz["warmup"], sz["steps"], sz["repeats"],
                     timeout=TIMEOUT, threads_per_rank=1)
    rows = [zoo_row(name, [r[name] for r in by_rank], sz) for name in models]
    for r in rows:
        harness.say(f"{r['model']:8s} ours {harness.fmt(r['ours_samples_per_s'], '6.1f')}  "
                    f"torch {harness.fmt(r['torch_samples_per_s'], '6.1f')}  ratio "
                    f"{harness.fmt(r['ratio'], '.2f')}  torch: {r['torch_split']}; "
                    f"{r['torch_trains']}")
    return {"settings": {**sz, "models": list(models), "batch": the_zoo().BATCH,
                         "chunks": CHUNKS, "ranks": WORLD, "threads_per_rank": 1, "lr": LR,
                         "momentum": MOMENTUM, "split": {m: SPLIT[m] for m in models}},
            "machine": harness.machine_info(transformers=version("transformers")),
            "rows": rows, "wall_s": time.monotonic() - began, "command": harness.command()}


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
        f"each side in interleaved rounds (ours, torch, then torch, ours, ...) in one pair of "
        f"processes; medians, their ratio (brackets: each round's). Set-up: model built to the "
        f"end of its first step. Others: CPU other processes took (of "
        f"{result['machine']['cores']} cores).",
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
                        choices=("pairs", "model_a", "interleaved", "zoo"))
    parser.add_argument("--quick", action="store_true",
                        help="fewest steps, 1 repeat (pairs: 2+3 steps; zoo: 1+2, does it run?)")
    for name, what in (("steps", "measured steps after the warm-up"), ("warmup", "warm-up steps"),
                       ("repeats", "runs of each side (pairs, zoo)")):
        parser.add_argument(f"--{name}", type=harness.positive, help=f"{what} (default: pairs "
                            f"{DEFAULT['pairs'][name]}, zoo {DEFAULT['zoo'][name]})")
    parser.add_argument("--models", default=",".join(MODELS), help="zoo: which, comma-separated")
    parser.add_argument("--out", help="write the markdown here (pairs, zoo: the JSON beside it)")
    args = parser.parse_args()
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models or set(models) - set(MODELS):
        parser.error(f"--models: choose among {', '.join(MODELS)}")
    torch.set_num_threads(1)
    which = "zoo" if args.set == "zoo" else "pairs"
    sz = harness.sizes(args, DEFAULT[which], QUICK[which], args.quick)
    if args.set in ("model_a", "interleaved"):
        run_set(args.set, sz, args.out)
        return 0
    result = run_zoo(sz, models) if args.set == "zoo" else run_pairs(sz)
    harness.emit(args.out, (zoo_markdown if args.set == "zoo" else pairs_markdown)(result), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
