"""Adaptive re-planning against a rank slowed part-way: static plan, adaptive run, hindsight best.

Two ranks (processes, gloo, 1 thread each), 1f1b, chunks 4, a straight 2-stage pipeline, batch
32 of a fixed synthetic batch. Models: `a` (build_cnn, 9 blocks) and `convs` (vs_ddp's
build_convs, 6 blocks). From step --slow-from on, rank 1 is --slow x slower: its StageRuntime
compute methods sleep (slow - 1) x their own duration after running (the slowdown follows the
rank, not the blocks). Contenders, each one launch per round:

  static     the plan Pipeline(stages=2) makes from a profile of one microbatch taken here
  adaptive   the same plan with adapt=True, adapt_every=--adapt-every and profile= it
  hindsight  the hetero planner's split for speeds (1, 1/slow) +-(--neighbours) blocks, each
             run as plan= under the same slowdown; the best median counts

Rate: rank 0's samples/s from step slow_from + warm-up to the last (the move included).
recovery = (adaptive - static) / (hindsight - static). Rounds alternate their order; a run
disturbed by other processes runs again (--retries).

    python bench/adaptive.py [--models a,convs] [--steps a=80,convs=80] [--slow-from 10] \
        [--slow 1.5] [--adapt-every 5] [--repeats 2] [--neighbours 1] [--retries 1] \
        [--out bench/results/adaptive.md]

Writes --out and beside it .json (every run), .png (time per step) and _trace.json (Perfetto).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn
from pipedream_fast.pipeline import Pipeline

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
from harness import DISTURBED, fmt, say
from vs_ddp import build_convs, fixed_batch

BATCH = 32
CHUNKS = 4
SCHEDULE = "1f1b"
LR = 0.01
WARMUP = 3  # steps after the slowdown starts before the slowed window's clock starts
MODELS = {"a": build_cnn, "convs": build_convs}
TITLES = {"a": "model A (build_cnn)", "convs": "convs (vs_ddp.build_convs)"}
DEFAULT_STEPS = {"a": 80, "convs": 80}
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")

# In the slowed process only: whether the slowdown is on, its extra fraction, what it did.
_SLOW: dict[str, Any] = {"on": False, "extra": 0.5, "calls": 0, "compute_s": 0.0,
                         "slept_s": 0.0}


def install_slowdown(extra: float) -> None:
    """Wraps StageRuntime's compute methods (this process only): once `_SLOW["on"]`, each
    call sleeps `extra` x its own duration after running."""
    from pipedream_fast.runtime.stage import StageRuntime

    _SLOW["extra"] = extra
    for name in COMPUTE:
        original = getattr(StageRuntime, name, None)
        if original is None or getattr(original, "_slowed", False):
            continue

        @functools.wraps(original)
        def slowed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = _original(self, *args, **kwargs)
            if _SLOW["on"]:
                took = time.perf_counter() - began
                time.sleep(_SLOW["extra"] * took)
                _SLOW["calls"] += 1
                _SLOW["compute_s"] += took
                _SLOW["slept_s"] += time.perf_counter() - began - took
            return out

        slowed._slowed = True  # type: ignore[attr-defined]
        setattr(StageRuntime, name, slowed)


def describe(plan: Any) -> list[list[Any]]:
    return [[s.start, s.stop, list(s.ranks)] for s in plan.stages]


def rank_main(rank: int, world: int, model_name: str, plan: Plan, steps: int,
              slow_from: int, slow: float, adapt: dict[str, Any] | None, profile: Any
              ) -> dict[str, Any]:
    """One rank of one contender: `plan`; `adapt` the adapt options (None: static)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if rank == 1:
        install_slowdown(slow - 1.0)
    kwargs: dict[str, Any] = {"plan": plan}
    if adapt is not None:
        kwargs.update(adapt=True, profile=profile, **adapt)
    pipe = Pipeline(MODELS[model_name](), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=LR), schedule=SCHEDULE, chunks=CHUNKS,
                    timeout=600.0, **kwargs)
    began = time.perf_counter()
    ends: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds at each step's end
    busy: list[float] = []  # the machine's busy CPU seconds at each step's end
    first_plan = last = None
    for loss in pipe.train([fixed_batch()] * steps, steps):
        ends.append(time.perf_counter())
        last = loss
        cpu.append(time.process_time())
        busy.append(harness.machine_busy_s())
        first_plan = first_plan or describe(pipe.plan)
        if len(ends) == slow_from and rank == 1:
            _SLOW["on"] = True
    out = {"rank": rank, "began": began, "ends": ends, "cpu": cpu, "busy": busy,
           "first_plan": first_plan, "final_plan": describe(pipe.plan),
           "moves": harness.plain(list(getattr(pipe, "moves", []) or [])),
           "checks": harness.plain(list(getattr(pipe, "adapt_checks", []) or [])),
           "slow": dict(_SLOW) if rank == 1 else None,
           "last_loss": float(last) if last is not None else None}
    pipe.close()
    return out


# ---- the parent: plans, runs, figures -------------------------------------------------------

def profile_of(model_name: str, batch: int) -> Any:
    """The model's per-block profile here: one thread (as each rank runs), `batch` samples."""
    from pipedream_fast.profiler import profile_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, _ = fixed_batch()
    return profile_model(MODELS[model_name](), x[:batch], batch, progress=False,
                         model_name=model_name)


def plan_2(profile: Any, topology: str, **options: Any) -> Plan:
    from pipedream_fast.planner import make_plan
    from pipedream_fast.topology import Topology

    return make_plan(profile, Topology.parse(topology), schedule=SCHEDULE, straight=True,
                     **options)


def hetero_split(profile: Any, slow: float) -> int:
    """First block of stage 1 in the hetero planner's straight plan for speeds (1, 1/slow)."""
    plan = plan_2(profile, f"2x1e9@speeds=1,{1 / slow:.4f}", chunks=CHUNKS)
    if len(plan.stages) != 2:
        raise RuntimeError(f"the hetero planner chose {len(plan.stages)} stage(s) for "
                           f"{profile.model}: {describe(plan)}")
    return plan.stages[0].stop


def split_plan(profile: Any, split: int) -> Plan:
    """Two stages cut before block `split`, named after the profile's model and batch (so
    that it matches the profile adapt re-plans from)."""
    return Plan(profile.model, profile.batch_size, 2, SCHEDULE,
                [StagePlan(0, split, 1, (0,), 0.0),
                 StagePlan(split, len(profile.blocks), 1, (1,), 0.0)], 0.0, 0.0)


def window_start(slow_from: int) -> int:
    """Index of the step whose end starts the slowed window's clock."""
    return slow_from + WARMUP - 1


def rates(ends: list[float], slow_from: int) -> tuple[float, float]:
    """(unslowed samples/s, steps WARMUP..slow_from; slowed samples/s, from the end of step
    slow_from + WARMUP to the last), from rank 0's step end times."""
    before = BATCH * (slow_from - WARMUP) / (ends[slow_from - 1] - ends[WARMUP - 1])
    start = window_start(slow_from)
    return before, BATCH * (len(ends) - 1 - start) / (ends[-1] - ends[start])


def run_one(model_name: str, contender: str, plan: Plan, steps: int, profile: Any,
            args: argparse.Namespace) -> dict[str, Any]:
    adapt = {"adapt_every": args.adapt_every} if contender == "adaptive" else None
    t0 = time.perf_counter()
    r0, r1 = launch(rank_main, 2, model_name, plan, steps, args.slow_from, args.slow, adapt,
                    profile, timeout=600, threads_per_rank=1)
    before, after = rates(r0["ends"], args.slow_from)
    # Other processes' cores in the slowed window: the machine's busy time less both ranks'.
    w = window_start(args.slow_from)
    others = ((r0["busy"][-1] - r0["busy"][w]) - (r0["cpu"][-1] - r0["cpu"][w])
              - (r1["cpu"][-1] - r1["cpu"][w])) / (r0["ends"][-1] - r0["ends"][w])
    base = r0["ends"][0]
    moves = r0["moves"]
    for m in moves:  # rank 0's perf_counter, relative to its first step's end
        m["started_rel_s"] = m.get("started", base) - base
        m["ended_rel_s"] = m.get("ended", base) - base
    slow = r1["slow"] or {}
    row = {"model": model_name, "contender": contender, "split": r0["first_plan"][0][1],
           "steps": steps, "plan": r0["first_plan"], "final_plan": r0["final_plan"],
           "unslowed": before, "slowed": after, "others_cores": others,
           "step_ms": [(b - a) * 1e3 for a, b in zip([r0["began"]] + r0["ends"][:-1],
                                                     r0["ends"])],
           "ends_rel_s": [e - base for e in r0["ends"]], "moves": moves,
           "checks": r0["checks"], "last_loss": r0["last_loss"],
           "achieved_slowdown": (1 + slow["slept_s"] / slow["compute_s"]
                                 if slow.get("compute_s") else None),
           "wall_s": time.perf_counter() - t0}
    move = (f"; {len(moves)} move(s): " + "; ".join(
        f"before step {m['step']} {m['from']} -> {m['to']} in {m['seconds']:.2f} s"
        for m in moves) if moves else "")
    say(f"  {model_name:5s} {contender:9s} plan {row['plan']}  unslowed {before:6.1f}  "
        f"slowed {after:6.1f} samples/s  (rank 1 x{row['achieved_slowdown'] or 0:.2f}, "
        f"others {others:.2f} cores, {row['wall_s']:.0f} s){move}")
    return row


def contenders(static: Plan, candidates: list[int], profile: Any) -> list[tuple[str, Plan]]:
    """The launches of one model's round; a candidate equal to the static split is the
    static run itself, not launched twice."""
    split = static.stages[0].stop
    return [("static", static), ("adaptive", static)] + [
        ("hindsight", split_plan(profile, s)) for s in candidates if s != split]


def summarise(model_name: str, runs: list[dict[str, Any]], candidates: list[int]
              ) -> dict[str, Any]:
    def med(rows: list[dict[str, Any]], key: str = "slowed") -> float | None:
        return statistics.median([r[key] for r in rows]) if rows else None

    mine = [r for r in runs if r["model"] == model_name]
    static = [r for r in mine if r["contender"] == "static"]
    adaptive = [r for r in mine if r["contender"] == "adaptive"]
    # a candidate's runs: its own, or the static runs where it is the static plan
    by_split = {s: [r for r in mine if r["contender"] == "hindsight" and r["split"] == s]
                or [r for r in static if r["split"] == s] for s in candidates}
    cand = {s: med(rows) for s, rows in by_split.items()}
    best = max(cand, key=lambda s: cand[s] or 0.0)
    out: dict[str, Any] = {
        "static_split": static[0]["split"] if static else None,
        "static_plans": [r["plan"] for r in static],
        "candidates": {str(s): {"median": v, "unslowed": med(by_split[s], "unslowed"),
                                "others_cores": med(by_split[s], "others_cores"),
                                "runs": [r["slowed"] for r in by_split[s]],
                                "runs_others": [r["others_cores"] for r in by_split[s]],
                                "is_static": bool(static) and s == static[0]["split"]}
                       for s, v in cand.items()},
        "hindsight": cand[best], "hindsight_split": best}
    for name, rows in (("static", static), ("adaptive", adaptive)):
        out.update({name: med(rows), f"{name}_unslowed": med(rows, "unslowed"),
                    f"{name}_runs": [r["slowed"] for r in rows],
                    f"{name}_runs_others": [r["others_cores"] for r in rows],
                    f"{name}_others_cores": med(rows, "others_cores")})
    gap = out["hindsight"] - out["static"]
    out["gap"], out["gap_pct"] = gap, gap / out["static"] * 100
    if adaptive:
        out["recovery"] = (out["adaptive"] - out["static"]) / gap if gap > 0 else None
        out["moves"] = [{"repeat": r.get("repeat"), **{k: m.get(k) for k in (
            "step", "seconds", "from", "to", "reason", "bytes")}}
            for r in adaptive for m in r["moves"]]
        # per repeat: that round's adaptive against that round's static and best candidate
        per = []
        for i, a in enumerate(adaptive):
            s = static[i]["slowed"] if i < len(static) else None
            h = max((rows[i]["slowed"] for rows in by_split.values() if i < len(rows)),
                    default=None)
            per.append((a["slowed"] - s) / (h - s) if s is not None and h is not None
                       and h > s else None)
        out["recovery_by_repeat"] = per
    return out


# ---- outputs --------------------------------------------------------------------------------

def cores(v: float | None) -> str:
    """Other processes' cores (a small negative is measurement noise: shown as 0)."""
    return "-" if v is None else f"{max(v, 0.0):.2f}"


def marked(rates: list[float], others: list[float]) -> str:
    """Each run's rate, starred where other processes took more than DISTURBED cores."""
    return ", ".join(fmt(r) + ("\\*" if o > DISTURBED else "") for r, o in zip(rates, others))


def markdown(summary: dict[str, Any], runs: list[dict[str, Any]], meta: dict[str, Any],
             args: argparse.Namespace) -> str:
    lines = ["# Adaptive re-planning: one rank slowed part-way", "",
             f"Command: `{meta['command'].strip()}`", "",
             f"Machine: {meta['cores']} cores, {meta['cpu']}, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]}; {meta['date']}; commit {meta['commit']}. "
             f"Load average (1, 5, 15 min) at the start {meta['load'][0]}, at the end "
             f"{meta['load'][1]} (the machine is shared). Whole run {meta['wall_s']:.0f} s.", "",
             f"2 ranks (processes, gloo, 1 thread each), {SCHEDULE}, chunks {CHUNKS}, batch "
             f"{BATCH}; steps per run: "
             f"{', '.join(f'{m} {n}' for m, n in meta['steps'].items())}; rank 1 slowed "
             f"x{args.slow:g} from step {args.slow_from} (each compute call of StageRuntime "
             f"sleeps {args.slow - 1:g}x its own duration after running; the slowdown stays "
             f"with rank 1 whatever blocks it holds). Rates: rank 0's samples/s from the end of "
             f"step {window_start(args.slow_from) + 1} to the last (the adaptive run's move "
             f"included); unslowed: steps {WARMUP + 1}-{args.slow_from}. Medians of "
             f"{args.repeats} repeats, interleaved (every other round in reverse order). "
             f"Static: the plan `Pipeline(stages=2)` makes (the planner balancing 2 straight "
             f"stages by time), from a profile of {BATCH // CHUNKS} samples (the microbatch the "
             f"ranks compute) taken once here before the runs, passed as `plan=` (and to the "
             f"adaptive run `profile=`), so that static and adaptive start from the same plan "
             f"in every repeat. Adaptive: the same plan with `adapt=True, "
             f"adapt_every={args.adapt_every}`. Hindsight: the best measured of the candidate "
             f"splits, the hetero planner's split for speeds (1, 1/{args.slow:g}) and "
             f"+-{args.neighbours} blocks; a candidate that is the static split is the static "
             f"runs themselves. \"others\": cores that other processes took during the slowed "
             f"window (the machine's busy CPU time less both ranks' own); a run where they took "
             f"more than {DISTURBED} cores ran again (up to {args.retries} more times) and the "
             f"least disturbed was kept; runs still over it are starred (\\*). Plans are "
             f"[start, stop, ranks] per stage.", ""]
    for model_name, s in summary.items():
        lines += [f"## {TITLES[model_name]}", "",
                  f"Profiled block ms (forward + backward, 1 thread, batch {BATCH // CHUNKS}): "
                  f"{', '.join(f'{v:.1f}' for v in meta['profiles'][model_name])}. Equal-speed "
                  f"split: {meta['equal_splits'][model_name]}; hetero planner's split for the "
                  f"slowed machine: {meta['hetero_splits'][model_name]}.", "",
                  "| contender | plan | unslowed samples/s | slowed samples/s | runs | "
                  "others (cores) |", "| --- | --- | ---: | ---: | --- | ---: |"]
        mine = [r for r in runs if r["model"] == model_name and r["contender"] == "adaptive"]
        finals = " or ".join(sorted({json.dumps(r["final_plan"]) for r in mine}))
        named = [("static", s["static_plans"][0] if s["static_plans"] else "-")] + (
            [("adaptive", f"ends as {finals}")] if s.get("adaptive") is not None else [])
        for name, plan in named:
            lines.append(f"| {name} | {plan} | {fmt(s[f'{name}_unslowed'])} | {fmt(s[name])} | "
                         f"{marked(s[f'{name}_runs'], s[f'{name}_runs_others'])} | "
                         f"{cores(s[f'{name}_others_cores'])} |")
        for split, c in s["candidates"].items():
            mark = (" (the static runs)" if c["is_static"] else "") + (
                " **hindsight**" if int(split) == s["hindsight_split"] else "")
            lines.append(f"| split {split}{mark} | {split} + "
                         f"{meta['blocks'][model_name] - int(split)} blocks | "
                         f"{fmt(c['unslowed'])} | {fmt(c['median'])} | "
                         f"{marked(c['runs'], c['runs_others'])} | {cores(c['others_cores'])} |")
        lines += ["", f"Gap hindsight - static: {fmt(s['gap'])} samples/s "
                      f"({fmt(s['gap_pct'], '+.1f')}% of static)."]
        if s.get("adaptive") is None:
            lines.append("")
            continue
        rec = s.get("recovery")
        each = ", ".join(fmt(None if v is None else v * 100, ".0f") + "%"
                         for v in s["recovery_by_repeat"])
        lines.append(f"**Recovery** (adaptive - static) / (hindsight - static): "
                     f"**{fmt(None if rec is None else rec * 100, '.0f')}%** (by repeat: "
                     f"{each}): the issue's mark of 80% is "
                     f"{'met' if rec is not None and rec >= 0.8 else '**not met**'}.")
        lines += [f"- repeat {m['repeat'] + 1}: move before step {m['step']} (the slowdown "
                  f"began at step {args.slow_from}), {m['from']} -> {m['to']}, "
                  f"{fmt(m['seconds'], '.2f')} s, {m['bytes']} bytes as the runtime counts "
                  f"them ({m['reason']})" for m in s.get("moves", [])]
        if not s.get("moves"):
            lines.append("The adaptive runs made no move.")
        for run in (r for r in mine if r["checks"]):
            lines += ["", f"Checks of the adaptive run of repeat {run['repeat'] + 1} "
                          f"(speeds: rank 0, rank 1, the fastest 1):", ""]
            lines += [f"- step {c.get('step')}: speeds "
                      f"{', '.join(f'{v:.2f}' for v in c['speeds']) if c.get('speeds') else '-'}"
                      f"; {'**moved**' if c.get('moved') else 'stayed'}: {c.get('reason')}"
                      for c in run["checks"]]
        lines.append("")
    lines += [f"Per-step times: {meta['png']}; rank 0's steps of every run as a Chrome / "
              f"Perfetto trace, moves as spans: {meta['trace']}; every figure: "
              f"{meta['json']}.", ""]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace,
         path: Path) -> None:
    styles = ("-", "--", ":", "-.")
    with harness.figure(path, len(summary), 1, (10, 4 * len(summary))) as (_, axes):
        for ax, (model_name, s) in zip(axes[:, 0], summary.items()):
            mine = [r for r in runs if r["model"] == model_name]
            top = 0.0
            for contender, split, colour in (("static", None, "tab:red"),
                                             ("adaptive", None, "tab:blue"),
                                             ("hindsight", s["hindsight_split"], "tab:green")):
                rows = [r for r in mine if r["contender"] == contender
                        and (split is None or r["split"] == split)]
                if not rows and contender == "hindsight":  # the static plan was the best
                    rows = [r for r in mine if r["contender"] == "static"
                            and r["split"] == split]
                for row in sorted(rows, key=lambda r: r.get("repeat", 0)):
                    repeat = row.get("repeat", 0)
                    steps = len(row["step_ms"])
                    ax.plot(range(1, steps + 1), row["step_ms"], color=colour, lw=1,
                            ls=styles[repeat % len(styles)],
                            label=f"{contender}" + (f" (split {split})" if split is not None
                                                    else "")
                            + f", repeat {repeat + 1}: {row['slowed']:.1f} samples/s")
                    top = max(top, max(row["step_ms"][1:]))
                    for m in row["moves"]:
                        step = m["step"] + 1  # the move happens before step index m["step"]
                        ax.axvspan(step - 0.5, step + 0.5, color=colour, alpha=0.25)
                        right = step > 0.6 * steps  # the note on the span's left near the end
                        ax.text(step + (-0.8 if right else 0.8), 0.97 - 0.06 * repeat,
                                f"repeat {repeat + 1}: move {m['from']} -> {m['to']}, "
                                f"{m['seconds']:.2f} s", color=colour, fontsize=7,
                                ha="right" if right else "left", va="top",
                                transform=ax.get_xaxis_transform())
            ax.axvline(args.slow_from + 0.5, color="k", ls="--", lw=1, label="rank 1 slowed")
            ax.axvline(window_start(args.slow_from) + 1.5, color="grey", ls=":", lw=1,
                       label="slowed window's clock starts")
            ax.set_ylim(0, top * 1.25)
            harness.axes_text(ax, f"{TITLES[model_name]}: rank 0's time per step", "step",
                              "ms per step", {"fontsize": 7, "loc": "lower right", "ncol": 2},
                              grid=None)


def chrome_trace(runs: list[dict[str, Any]], path: Path) -> None:
    """Rank 0's steps per run as Chrome trace events (one track per run), moves as spans."""
    events: list[dict[str, Any]] = []
    for i, r in enumerate(runs):
        name = f"{r['model']} {r['contender']}" + (f" split {r['split']}"
                                                   if r["split"] is not None else "")
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i,
                       "args": {"name": f"{name} #{i}"}})
        prev = r["ends_rel_s"][0] - r["step_ms"][0] / 1e3
        for step, end in enumerate(r["ends_rel_s"]):
            events.append({"ph": "X", "name": f"step {step}", "pid": 0, "tid": i,
                           "ts": prev * 1e6, "dur": (end - prev) * 1e6,
                           "args": {"ms": (end - prev) * 1e3}})
            prev = end
        events += [{"ph": "X", "name": "move", "pid": 0, "tid": i, "cat": "move",
                    "ts": m["started_rel_s"] * 1e6,
                    "dur": (m["ended_rel_s"] - m["started_rel_s"]) * 1e6,
                    "args": {k: m.get(k) for k in ("step", "from", "to", "reason", "bytes",
                                                   "seconds")}} for m in r["moves"]]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def parse_steps(text: str, models: list[str]) -> dict[str, int]:
    """--steps: one count for every model, or MODEL=STEPS pairs (the others keep defaults)."""
    if "=" not in text:
        return {m: int(text) for m in models}
    steps = {m: DEFAULT_STEPS[m] for m in models}
    for part in text.split(","):
        name, _, value = part.partition("=")
        steps[name.strip()] = int(value)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="a,convs")
    parser.add_argument("--steps", default=",".join(f"{m}={n}" for m, n in DEFAULT_STEPS.items()),
                        help="steps per run: N, or MODEL=N pairs (default %(default)s)")
    parser.add_argument("--slow-from", type=int, default=10,
                        help="rank 1 is slowed from this step on (default 10)")
    parser.add_argument("--slow", type=float, default=1.5, help="rank 1's slowdown factor")
    parser.add_argument("--adapt-every", type=int, default=5,
                        help="adapt's check interval in steps (default 5)")
    parser.add_argument("--repeats", type=harness.positive, default=2)
    parser.add_argument("--neighbours", type=int, default=1,
                        help="hindsight candidates: the hetero split +- this many blocks")
    parser.add_argument("--retries", type=int, default=1,
                        help=f"runs again a run during which other processes took more than "
                             f"{DISTURBED} cores, up to this many times (default 1)")
    parser.add_argument("--out", default="bench/results/adaptive.md")
    args = parser.parse_args()
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    try:
        steps = parse_steps(args.steps, models)
    except ValueError:
        parser.error(f"--steps {args.steps!r}: give N or MODEL=N,...")
    for m, n in steps.items():
        if m not in MODELS:
            parser.error(f"--steps names unknown model {m!r}")
        if not WARMUP < args.slow_from < n - WARMUP - 1:
            parser.error(f"--slow-from must be in ({WARMUP}, steps - {WARMUP + 1}); {m} runs "
                         f"{n} steps")
    if args.slow <= 1.0:
        parser.error("--slow must be above 1")
    began = time.perf_counter()
    load_before = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    profiles, profile_ms, equal, hetero, blocks, candidates = {}, {}, {}, {}, {}, {}
    for m in models:
        say(f"profiling {m} (1 thread, batch {BATCH // CHUNKS}) ...")
        profiles[m] = profile_of(m, BATCH // CHUNKS)
        profile_ms[m] = [b.forward_ms + b.backward_ms for b in profiles[m].blocks]
        blocks[m] = len(profiles[m].blocks)
        equal[m] = plan_2(profiles[m], "2x1e9", strategy="time")  # as Pipeline(stages=2)
        hetero[m] = hetero_split(profiles[m], args.slow)
        candidates[m] = [s for s in range(hetero[m] - args.neighbours,
                                          hetero[m] + args.neighbours + 1)
                         if 1 <= s <= blocks[m] - 1]
        say(f"  block ms {', '.join(f'{v:.1f}' for v in profile_ms[m])}; equal-speed split "
            f"{equal[m].stages[0].stop}; hetero split {hetero[m]}; candidates {candidates[m]}")
    keep = ("slowed", "unslowed", "others_cores")
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        say(f"round {repeat + 1} of {args.repeats}")
        for m in models:
            order = contenders(equal[m], candidates[m], profiles[m])
            for contender, plan in (order[::-1] if repeat % 2 else order):
                row, rest = harness.least_disturbed(
                    functools.partial(run_one, m, contender, plan, steps[m], profiles[m], args),
                    lambda r: r["others_cores"], args.retries, say)
                if rest:
                    row["disturbed_runs"] = [{k: r[k] for k in keep} for r in rest]
                row["repeat"] = repeat
                runs.append(row)
    meta = {"command": harness.command(),
            "cores": os.cpu_count(), "cpu": harness.machine_info()["processor"],
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": harness.git("rev-parse", "HEAD"),
            "load": (load_before, ", ".join(f"{v:.2f}" for v in os.getloadavg())),
            "wall_s": time.perf_counter() - began, "profiles": profile_ms, "steps": steps,
            "equal_splits": {m: p.stages[0].stop for m, p in equal.items()},
            "hetero_splits": hetero, "blocks": blocks, "candidates": candidates}
    out = Path(args.out)
    png, data, trace = (out.with_suffix(".png"), out.with_suffix(".json"),
                        out.with_name(out.stem + "_trace.json"))
    meta.update(png=png.name, json=data.name, trace=trace.name)
    summary = {m: summarise(m, runs, candidates[m]) for m in models}
    for m, s in summary.items():
        say(f"{m}: static {s['static']:.1f}  hindsight {s['hindsight']:.1f} (split "
            f"{s['hindsight_split']})  gap {s['gap_pct']:+.1f}%"
            + ("" if s.get("adaptive") is None else
               f"  adaptive {s['adaptive']:.1f}  recovery "
               f"{fmt(None if s['recovery'] is None else s['recovery'] * 100, '.0f')}%"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(summary, runs, meta, args))
    harness.write_json(data, {"meta": meta, "args": vars(args), "summary": summary,
                              "runs": runs})
    plot(runs, summary, args, png)
    chrome_trace(runs, trace)
    say(f"wrote {out}, {data}, {png}, {trace} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
