"""pipedream_fast against torch.distributed.pipelining on the same stages and microbatches.

Model A (`pipedream_fast.models.build_cnn`: 6 convolutions + 3 large linear layers, 9 blocks),
batch 32, SGD lr 0.01, one fixed synthetic batch, 2 ranks on one machine (gloo on loopback,
one intra-op thread per rank). Pairs, each side by side on the very same stages:

  torch ScheduleGPipe             vs  pipedream_fast gpipe             2 stages, 2 and 4 microbatches
  torch Schedule1F1B              vs  pipedream_fast 1f1b              2 stages, 2 and 4 microbatches
  torch ScheduleInterleaved1F1B   vs  pipedream_fast interleaved-1f1b  4 stages (2 per rank), 4

Stages, blocks [start, stop): 2 stages [0, 6) | [6, 9), conv | fc, as bench/model_a.py
--split 6. 4 stages [0, 3) | [3, 6) | [6, 7) | [7, 9), stage k on rank k mod 2: the looped
plan the planner picked from a microbatch-size profile in bench/results/interleaved.md, fixed
here by hand so every run compares the same cut (--stages4 to change it). Torch 2.13's
ScheduleInterleaved1F1B needs n_microbatches % max(1, n_microbatches // ranks) == 0 and ours
needs a multiple of the ranks: 4 microbatches suit both.

Same computation on both sides: both seed torch with 0 and build the model, so the stages
start from identical weights (each side takes blocks [start, stop) of build_cnn()); both feed
the same fixed batch, split into the same microbatches, average the gradients over them and
step SGD once per step. As a guard, the mean microbatch loss of the first step (initial
weights: the forward) and of the last step (after every update before it: the backward and
the updates) are compared between the two sides of each pair.

Throughput: steady-state samples/s. Each rank stamps a system-wide monotonic clock when it
has finished the warm-up steps and when it has finished the last one; the window runs from
the latest warm-up stamp to the latest end stamp (as barriers would, without disturbing
either pipeline). Each row (pair, microbatch count) runs in one pair of rank processes
(pipedream_fast.launch): --repeats times ours then torch, ours, torch, ..., each run from a
freshly seeded, freshly built model with warm-up steps of its own; the report gives the median
of each side and the ratio of the medians. --fresh starts a new pair of processes for every
run instead (isolation against process state left by the other side, at about 5-15 s of
process start-up per run: too slow for --quick on 2 cores). Each rank also reads the machine's
busy CPU time, so the report says how many cores other processes took during the windows.

    python bench/vs_pipelining.py [--steps 12] [--warmup 3] [--repeats 5] [--quick] [--fresh]
                                  [--out bench/results/vs_pipelining.md]

--out writes the markdown there and the JSON beside it (same name, .json). A suite runner can
import `run(quick) -> dict` and `markdown(result) -> str`. The reading under the table is
written by hand after a run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn

BATCH = 32
WORLD = 2
LR = 0.01
BLOCKS = 9  # build_cnn's blocks: conv1..conv6, fc1..fc3
STAGES2 = (6,)  # first blocks of stages 1.. (conv | fc)
STAGES4 = (3, 6, 7)  # looped, stage k on rank k mod 2
# ours, torch's class, microbatch counts per step
PAIRS = (("gpipe", "ScheduleGPipe", (2, 4)),
         ("1f1b", "Schedule1F1B", (2, 4)),
         ("interleaved-1f1b", "ScheduleInterleaved1F1B", (4,)))
DEFAULT = {"warmup": 3, "steps": 12, "repeats": 5}
QUICK = {"warmup": 2, "steps": 3, "repeats": 1}
FIRST_LOSS_TOL = 1e-4  # float32, mean of a few microbatch losses near 2.3
LAST_LOSS_TOL = 1e-3  # the same after a few SGD updates, accumulated in other orders
GOAL = 1.2  # 1f1b against Schedule1F1B


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch as bench/model_a.py and bench/vs_ddp.py."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def bounds(firsts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Block ranges [start, stop) of the stages that begin at 0 and at each of `firsts`."""
    edges = [0, *firsts, BLOCKS]
    return list(zip(edges, edges[1:]))


def rank_of(stage: int) -> int:
    return stage % WORLD  # one stage per rank, or looped


# ---- ranks ---------------------------------------------------------------------------------

def machine_busy_s() -> float:
    """CPU seconds the whole machine spent in user and system mode since boot (all cores)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle ...
    except OSError:
        return 0.0
    return (int(fields[1]) + int(fields[2]) + int(fields[3])) / os.sysconf("SC_CLK_TCK")


class Clock:
    """A rank's stamps: the end of the warm-up and of the last step (system-wide monotonic
    clock, comparable across the ranks), with the machine's busy and this process's CPU time
    over that window."""

    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.busy = self.cpu = 0.0

    def warmed_up(self) -> None:
        self.start, self.busy, self.cpu = time.perf_counter(), machine_busy_s(), time.process_time()

    def done(self) -> dict[str, float]:
        self.end = time.perf_counter()
        return {"start": self.start, "end": self.end, "busy_s": machine_busy_s() - self.busy,
                "cpu_s": time.process_time() - self.cpu}


def torch_rank(rank: int, world: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
               warmup: int, steps: int) -> dict[str, Any]:
    """torch.distributed.pipelining: this rank's stages of build_cnn(), `schedule` with
    `chunks` microbatches, SGD over this rank's parameters."""
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    torch.manual_seed(0)
    children = list(build_cnn().children())
    mine = [k for k in range(len(stages)) if rank_of(k) == rank]
    parts = [pipelining.PipelineStage(nn.Sequential(*children[stages[k][0]:stages[k][1]]), k,
                                      len(stages), torch.device("cpu")) for k in mine]
    opt = torch.optim.SGD([p for s in parts for p in s.submod.parameters()], lr=LR)
    kind = getattr(pipelining, schedule)
    loss_fn = nn.functional.cross_entropy
    sched = (kind(parts, chunks, loss_fn=loss_fn) if len(parts) > 1
             else kind(parts[0], chunks, loss_fn=loss_fn))
    first, last = 0 in mine, len(stages) - 1 in mine
    x, y = fixed_batch()
    clock = Clock()
    losses: list[float] = []
    for step in range(warmup + steps):
        opt.zero_grad()
        mb_losses: list[torch.Tensor] = []
        sched.step(*((x,) if first else ()),
                   **({"target": y, "losses": mb_losses} if last else {}))
        opt.step()
        if last:
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        if step == warmup - 1:
            clock.warmed_up()
    return {**clock.done(), "losses": losses if last else None}


def ours_rank(rank: int, world: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
              warmup: int, steps: int) -> dict[str, Any]:
    """pipedream_fast's Pipeline on the same stages, one run of warm-up + measured steps."""
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plan = Plan("cnn", BATCH, world, schedule,
                [StagePlan(a, b, 1, (rank_of(k),), 0.0) for k, (a, b) in enumerate(stages)],
                1.0, 1.0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=LR), plan=plan, schedule=schedule,
                    chunks=chunks)
    last = rank_of(len(stages) - 1) == rank
    clock = Clock()
    losses: list[float] = []
    total = warmup + steps
    for step, loss in enumerate(pipe.train([fixed_batch()] * total, total)):
        if last and loss is not None:
            losses.append(float(loss))
        if step == warmup - 1:
            clock.warmed_up()
    stamps = clock.done()
    pipe.close()
    return {**stamps, "losses": losses if last else None}


def sides_rank(rank: int, world: int, sides: list[tuple[str, str]], stages: list[tuple[int, int]],
               chunks: int, warmup: int, steps: int) -> list[dict[str, Any]]:
    """Runs each (side, schedule) of `sides` in turn in this process, each from a freshly built
    model; returns their stamps and losses in that order."""
    out = []
    for side, schedule in sides:
        fn = ours_rank if side == "ours" else torch_rank
        out.append(fn(rank, world, schedule, stages, chunks, warmup, steps))
        gc.collect()  # the last side's stages and optimizer go before the next one is built
    return out


# ---- the harness ---------------------------------------------------------------------------

@dataclass
class Run:
    """One side of one pair, once: both ranks' stamps reduced to a window."""

    samples_per_s: float
    seconds: float
    other_cores: float
    losses: list[float]


def measure(sides: list[tuple[str, str]], stages: list[tuple[int, int]], chunks: int,
            warmup: int, steps: int) -> list[Run]:
    """Runs `sides` one after the other in one pair of rank processes."""
    by_rank = launch(sides_rank, WORLD, sides, stages, chunks, warmup, steps, threads_per_rank=1)
    return [window(list(ranks), steps) for ranks in zip(*by_rank)]


def window(ranks: list[dict[str, Any]], steps: int) -> Run:
    """One side's run from both ranks' stamps: from the latest end of warm-up to the latest
    end, as barriers would place it."""
    seconds = max(r["end"] for r in ranks) - max(r["start"] for r in ranks)
    own = sum(r["cpu_s"] for r in ranks)
    machine = sum(r["busy_s"] for r in ranks) / len(ranks)
    losses = next(r["losses"] for r in ranks if r["losses"] is not None)
    return Run(BATCH * steps / seconds, seconds, max(0.0, machine - own) / seconds, losses)


def run(quick: bool = False, *, steps: int | None = None, warmup: int | None = None,
        repeats: int | None = None, stages4: tuple[int, ...] = STAGES4, fresh: bool = False,
        log: bool = True) -> dict[str, Any]:
    """Measures every pair; returns a JSON-ready dict (settings, one row per pair, goal).
    `fresh`: every side of every repeat in a pair of processes of its own (default: one pair
    of processes per row runs all its repeats, ours, torch, ours, torch, ...)."""
    base = QUICK if quick else DEFAULT
    warmup = base["warmup"] if warmup is None else warmup
    steps = base["steps"] if steps is None else steps
    repeats = base["repeats"] if repeats is None else repeats
    if warmup < 1 or steps < 1 or repeats < 1:
        raise ValueError(f"warmup, steps and repeats must be >= 1, got {warmup}, {steps}, "
                         f"{repeats}")
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    for ours, theirs, counts in PAIRS:
        stages = bounds(stages4 if ours == "interleaved-1f1b" else STAGES2)
        for chunks in counts:
            order = [("ours", ours), ("torch", theirs)] * repeats
            done = ([r for one in order for r in measure([one], stages, chunks, warmup, steps)]
                    if fresh else measure(order, stages, chunks, warmup, steps))
            runs = {"ours": done[0::2], "torch": done[1::2]}
            row = summarize(ours, theirs, stages, chunks, runs)
            rows.append(row)
            if log:
                print(f"{ours:17s} {len(stages)} stages {chunks} mb: ours "
                      f"{row['ours_samples_per_s']:6.1f}  torch {row['torch_samples_per_s']:6.1f}"
                      f"  ratio {row['ratio']:.2f}x  first-step loss diff "
                      f"{row['first_loss_diff']:.1e}  last {row['last_loss_diff']:.1e}",
                      flush=True)
    one = [r for r in rows if r["schedule"] == "1f1b"]
    worst = min(r["ratio"] for r in one)
    return {"settings": {"quick": quick, "warmup": warmup, "steps": steps, "repeats": repeats,
                         "fresh": fresh,
                         "batch": BATCH, "lr": LR, "ranks": WORLD, "threads_per_rank": 1,
                         "stages2": bounds(STAGES2), "stages4": bounds(stages4)},
            "machine": {"cores": os.cpu_count(),
                        "processor": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "python": sys.version.split()[0],
                        "date": datetime.date.today().isoformat()},
            "rows": rows,
            "goal": {"text": f"1f1b at least {GOAL}x Schedule1F1B on the same stages and "
                             f"microbatches", "met": worst >= GOAL, "worst_ratio": worst,
                     "ratios": {str(r["microbatches"]): r["ratio"] for r in one}},
            "losses_agree": all(r["losses_agree"] for r in rows),
            "wall_s": time.monotonic() - began}


def summarize(ours: str, theirs: str, stages: list[tuple[int, int]], chunks: int,
              runs: dict[str, list[Run]]) -> dict[str, Any]:
    med = {side: statistics.median(r.samples_per_s for r in rs) for side, rs in runs.items()}
    first = max(abs(a.losses[0] - b.losses[0]) for a, b in zip(runs["ours"], runs["torch"]))
    last = max(abs(a.losses[-1] - b.losses[-1]) for a, b in zip(runs["ours"], runs["torch"]))
    return {"schedule": ours, "torch_schedule": theirs, "stages": len(stages),
            "bounds": stages, "microbatches": chunks,
            "ours_samples_per_s": med["ours"], "torch_samples_per_s": med["torch"],
            "ratio": med["ours"] / med["torch"],
            "pair_ratios": [a.samples_per_s / b.samples_per_s
                            for a, b in zip(runs["ours"], runs["torch"])],
            "first_loss": runs["torch"][0].losses[0], "first_loss_diff": first,
            "last_loss_diff": last,
            "losses_agree": first <= FIRST_LOSS_TOL and last <= LAST_LOSS_TOL,
            "other_cores_max": max(r.other_cores for rs in runs.values() for r in rs),
            "runs": {side: [asdict(r) for r in rs] for side, rs in runs.items()}}


# ---- the report ----------------------------------------------------------------------------

def command(result: dict[str, Any], out: str | None = None) -> str:
    s = result["settings"]
    parts = ["python bench/vs_pipelining.py"]
    if s["quick"]:
        parts.append("--quick")
    base = QUICK if s["quick"] else DEFAULT
    parts += [f"--{k} {s[k]}" for k in ("steps", "warmup", "repeats") if s[k] != base[k]]
    if s["fresh"]:
        parts.append("--fresh")
    if [tuple(b) for b in s["stages4"]] != bounds(STAGES4):
        parts.append("--stages4 " + ",".join(str(a) for a, _ in s["stages4"][1:]))
    if out:
        parts.append(f"--out {out}")
    return " ".join(parts)


def markdown(result: dict[str, Any], out: str | None = None) -> str:
    s, m, goal = result["settings"], result["machine"], result["goal"]
    measured = ", ".join(f"{ratio:.2f}x at {mb} microbatches"
                         for mb, ratio in goal["ratios"].items())
    lines = ["# pipedream_fast vs torch.distributed.pipelining, model A, 2 ranks, CPU", "",
             f"Command: `{command(result, out)}`", "",
             f"Date: {m['date']}. Machine: {m['cores']} cores, {m['processor']}, torch "
             f"{m['torch']}, Python {m['python']}. Whole run: {result['wall_s'] / 60:.1f} min.",
             "",
             f"- Model A (`build_cnn`, 9 blocks), batch {s['batch']}, SGD lr {s['lr']}, one fixed "
             f"synthetic batch; {s['ranks']} ranks, gloo on loopback, {s['threads_per_rank']} "
             f"intra-op thread per rank.",
             f"- Stages, blocks [start, stop): 2 stages {fmt_bounds(s['stages2'])}; 4 stages "
             f"{fmt_bounds(s['stages4'])}, stage k on rank k mod 2 (set by hand: the planner's "
             f"looped plan in bench/results/interleaved.md). Both sides run the very same "
             f"stages and microbatches.",
             f"- Samples/s: steady state over {s['steps']} steps after {s['warmup']} warm-up "
             f"steps, from the latest rank's end of warm-up to the latest rank's end; "
             f"{s['repeats']} repeat(s) interleaved ours, torch, ..., "
             + ("each run in a new pair of processes" if s["fresh"] else
                "all of a row's runs in one pair of processes, each from a freshly built model")
             + "; the table gives the medians and the ratio of the medians.",
             "- Loss check: the mean microbatch loss of the first step (same initial weights) "
             "and of the last step (after the same updates), ours against torch, largest "
             f"difference over the repeats; agreed if within {FIRST_LOSS_TOL:g} and "
             f"{LAST_LOSS_TOL:g}.", "",
             "| schedule (ours / torch) | stages | microbatches | torch samples/s | ours "
             "samples/s | ours/torch | first-step loss diff | last-step loss diff | "
             "others (cores) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['schedule']} / {r['torch_schedule']} | {r['stages']} | "
                     f"{r['microbatches']} | {r['torch_samples_per_s']:.1f} | "
                     f"{r['ours_samples_per_s']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['first_loss_diff']:.1e} | {r['last_loss_diff']:.1e} | "
                     f"{r['other_cores_max']:.2f} |")
    lines += ["", f"Goal: {goal['text']}: **{'met' if goal['met'] else 'missed'}** "
                  f"(measured {measured}).", "",
              "Losses: " + ("ours and torch agree on every pair." if result["losses_agree"] else
                            "**ours and torch DISAGREE on at least one pair: the throughput "
                            "figures may compare different computations.**"), "",
              "Others (cores): the most CPU that processes other than the two ranks took during "
              "any measured window of the pair (the machine's user+system time less the ranks' "
              f"own; the machine has {m['cores']} cores)."]
    return "\n".join(lines) + "\n"


def fmt_bounds(stages: list[Any]) -> str:
    return " | ".join(f"[{a}, {b})" for a, b in stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['warmup']}+{QUICK['steps']} steps, {QUICK['repeats']} "
                             f"repeat (a few minutes on 2 cores)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"measured steps after the warm-up (default {DEFAULT['steps']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"warm-up steps (default {DEFAULT['warmup']})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs of each side per pair (default {DEFAULT['repeats']})")
    parser.add_argument("--stages4", default=",".join(map(str, STAGES4)),
                        help="first blocks of stages 1-3 of the 4-stage split (default "
                             f"{','.join(map(str, STAGES4))})")
    parser.add_argument("--fresh", action="store_true",
                        help="a new pair of processes for every run (default: one per row)")
    parser.add_argument("--out", default=None,
                        help="write the markdown here and the JSON beside it (.json)")
    args = parser.parse_args()
    try:
        stages4 = tuple(int(v) for v in args.stages4.split(","))
    except ValueError:
        parser.error(f"--stages4 takes 3 block indices, e.g. 3,6,7; got {args.stages4!r}")
    if len(stages4) != 3 or list(stages4) != sorted(set(stages4)) or not 0 < stages4[0] \
            or stages4[-1] >= BLOCKS:
        parser.error(f"--stages4 takes 3 increasing block indices in 1..{BLOCKS - 1}, got "
                     f"{args.stages4!r}")
    for name in ("steps", "warmup", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    torch.set_num_threads(1)
    result = run(args.quick, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                 stages4=stages4, fresh=args.fresh)
    text = markdown(result, args.out)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
