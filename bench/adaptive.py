"""Adaptive re-planning against a rank slowed part-way: static plan, adaptive run, hindsight best.

A 2-stage 1f1b pipeline on 2 ranks, rank 1 slowed SLOW x from step SLOW_FROM. Each round runs, in
alternating order, static (Pipeline(stages=2)'s plan), adaptive (the same, adapt=True) and
hindsight (the hetero planner's split +-NEIGHBOURS blocks, the best counting). Writes --out and
beside it .json (every run) and .png (time per step).

    python bench/adaptive.py [--models a,convs] [--repeats 2] ... [--out bench/results/adaptive.md]
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
from pipedream_fast.planner import make_plan
from pipedream_fast.profiler import profile_model
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.topology import Topology

import harness  # noqa: E402 - a sibling
from harness import DISTURBED, fmt, say
from vs_ddp import build_convs, fixed_batch

BATCH, CHUNKS, SCHEDULE = 32, 4, "1f1b"
SLOW_FROM, SLOW = 10, 1.5  # rank 1 is slowed from this step on, by this factor
ADAPT_EVERY = 5  # adapt's check interval in steps
NEIGHBOURS = 1  # hindsight candidates: the hetero planner's split +- this many blocks
WARMUP = 3  # steps after the slowdown starts before the slowed window's clock starts
MODELS = {"a": build_cnn, "convs": build_convs}
TITLES = {"a": "model A (build_cnn)", "convs": "convs (vs_ddp.build_convs)"}
STEPS = 80  # per run, by default

_SLOW: dict[str, Any] = {"on": False, "compute_s": 0.0, "slept_s": 0.0}  # in the slowed rank


def slowed(original: Any) -> Any:
    """`original`, a StageRuntime compute method, sleeping SLOW - 1 times its own duration after
    it runs once `_SLOW["on"]`."""
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = original(self, *args, **kwargs)
        if _SLOW["on"]:
            took = time.perf_counter() - began
            time.sleep((SLOW - 1.0) * took)
            _SLOW["compute_s"] += took
            _SLOW["slept_s"] += time.perf_counter() - began - took
        return out
    return wrapper


def describe(plan: Any) -> list[list[Any]]:
    return [[s.start, s.stop, list(s.ranks)] for s in plan.stages]


def rank_main(rank: int, world: int, model_name: str, plan: Plan, steps: int, adapt: bool,
              profile: Any) -> dict[str, Any]:
    """One rank of one contender: `plan`, adapting from `profile` if `adapt`."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if rank == 1:  # a launched process of its own: the slowdown stays in it
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            setattr(StageRuntime, name, slowed(getattr(StageRuntime, name)))
    extra = {"adapt": True, "profile": profile, "adapt_every": ADAPT_EVERY} if adapt else {}
    pipe = Pipeline(MODELS[model_name](), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), schedule=SCHEDULE, chunks=CHUNKS,
                    timeout=600.0, plan=plan, **extra)
    began, clock = time.perf_counter(), harness.Clock()  # the clock: over the slowed window
    ends: list[float] = []
    last = None
    for loss in pipe.train([fixed_batch()] * steps, steps):
        ends.append(time.perf_counter())
        last = loss
        _SLOW["on"] = _SLOW["on"] or (len(ends) == SLOW_FROM and rank == 1)
        if len(ends) == SLOW_FROM + WARMUP:
            clock.warmed_up()
    out = {"began": began, "ends": ends, "window": clock.done(),
           "final_plan": describe(pipe.plan), "moves": harness.plain(list(pipe.moves)),
           "checks": harness.plain(list(pipe.adapt_checks)),
           "slowdown": 1 + _SLOW["slept_s"] / _SLOW["compute_s"] if _SLOW["compute_s"] else None,
           "last_loss": float(last) if last is not None else None}
    pipe.close()
    return out


# ---- the parent: plans, runs, summaries -----------------------------------------------------
def split_plan(profile: Any, split: int) -> Plan:
    """Two stages cut before block `split`, named as the profile adapt re-plans from."""
    return Plan(profile.model, profile.batch_size, 2, SCHEDULE,
                [StagePlan(0, split, 1, (0,), 0.0),
                 StagePlan(split, len(profile.blocks), 1, (1,), 0.0)], 0.0, 0.0)


def run_one(model_name: str, contender: str, plan: Plan, steps: int, profile: Any
            ) -> dict[str, Any]:
    t0 = time.perf_counter()
    r0, r1 = launch(rank_main, 2, model_name, plan, steps, contender == "adaptive", profile,
                    timeout=600, threads_per_rank=1)
    ends = r0["ends"]
    w = SLOW_FROM + WARMUP - 1  # the step whose end starts the slowed window's clock
    before = BATCH * (SLOW_FROM - WARMUP) / (ends[SLOW_FROM - 1] - ends[WARMUP - 1])
    after = BATCH * (len(ends) - 1 - w) / (ends[-1] - ends[w])
    others = harness.other_cores([r0["window"], r1["window"]], ends[-1] - ends[w])
    row = {"model": model_name, "contender": contender, "split": plan.stages[0].stop,
           "steps": steps, "plan": describe(plan), "final_plan": r0["final_plan"],
           "unslowed": before, "slowed": after, "others_cores": others,
           "step_ms": [(b - a) * 1e3 for a, b in zip([r0["began"]] + ends[:-1], ends)],
           "moves": r0["moves"], "checks": r0["checks"], "last_loss": r0["last_loss"],
           "achieved_slowdown": r1["slowdown"], "wall_s": time.perf_counter() - t0}
    say(f"  {model_name:5s} {contender:9s} plan {row['plan']}  unslowed {before:6.1f}  slowed "
        f"{after:6.1f} samples/s  (rank 1 x{row['achieved_slowdown'] or 0:.2f}, others "
        f"{others:.2f} cores, {row['wall_s']:.0f} s)")
    return row


def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of the slowed and unslowed rates and other processes' cores."""
    med = {k: statistics.median([r[k] for r in rows]) if rows else None
           for k in ("slowed", "unslowed", "others_cores")}
    return {"median": med.pop("slowed"), **med, "runs": [r["slowed"] for r in rows],
            "runs_others": [r["others_cores"] for r in rows]}


def summarise(mine: list[dict[str, Any]], candidates: list[int]) -> dict[str, Any]:
    """One model's runs: static, adaptive, each candidate split, the gap and its recovery."""
    static = [r for r in mine if r["contender"] == "static"]
    adaptive = [r for r in mine if r["contender"] == "adaptive"]
    split = static[0]["split"]
    # a candidate's runs: its own, or the static runs where it is the static plan
    by_split = {s: [r for r in mine if r["contender"] == "hindsight" and r["split"] == s]
                or [r for r in static if r["split"] == s] for s in candidates}
    cand = {s: {**stats(rows), "is_static": s == split} for s, rows in by_split.items()}
    best = max(cand, key=lambda s: cand[s]["median"] or 0.0)
    s, a, h = stats(static)["median"], stats(adaptive)["median"], cand[best]["median"]
    # per repeat: that round's adaptive against that round's static and best candidate
    per = []
    for i, run in enumerate(adaptive):
        s_i = static[i]["slowed"]
        h_i = max(rows[i]["slowed"] for rows in by_split.values() if i < len(rows))
        per.append((run["slowed"] - s_i) / (h_i - s_i) if h_i > s_i else None)
    return {"static_split": split, "static_plans": [r["plan"] for r in static],
            "contenders": {"static": stats(static), "adaptive": stats(adaptive)},
            "candidates": {str(k): c for k, c in cand.items()},
            "hindsight": h, "hindsight_split": best, "static": s, "adaptive": a,
            "gap": h - s, "gap_pct": (h - s) / s * 100,
            "recovery": (a - s) / (h - s) if h > s else None,
            "moves": [{"repeat": r["repeat"], **{k: m.get(k) for k in (
                "step", "seconds", "from", "to", "reason", "bytes")}}
                for r in adaptive for m in r["moves"]],
            "recovery_by_repeat": per}


# ---- outputs --------------------------------------------------------------------------------
def row_cells(name: str, plan: str, c: dict[str, Any]) -> list[str]:
    """A contender's table row; runs starred where other processes took over DISTURBED cores."""
    runs = ", ".join(fmt(r) + ("\\*" if o > DISTURBED else "")
                     for r, o in zip(c["runs"], c["runs_others"]))
    return [name, plan, fmt(c["unslowed"]), fmt(c["median"]), runs, fmt(c["others_cores"], ".2f")]


def pct(value: float | None) -> str:
    return fmt(None if value is None else value * 100, ".0f") + "%"


def markdown(summary: dict[str, Any], runs: list[dict[str, Any]], meta: dict[str, Any],
             repeats: int, retries: int) -> str:
    steps = ", ".join(f"{m} {info['steps']}" for m, info in meta["models"].items())
    lines = ["# Adaptive re-planning: one rank slowed part-way", "",
             f"Command: `{meta['command']}`", "",
             harness.machine_line(meta["machine"], meta["wall_s"]), "",
             f"2 ranks (processes, gloo, 1 thread each), {SCHEDULE}, chunks {CHUNKS}, batch "
             f"{BATCH}, steps per run: {steps}. Rank 1's compute calls sleep {SLOW - 1:g}x their "
             f"own duration from step {SLOW_FROM}. Rates: rank 0's samples/s from step "
             f"{SLOW_FROM + WARMUP} to the end, moves included (unslowed: steps {WARMUP + 1}-"
             f"{SLOW_FROM}); medians of {repeats} interleaved repeats. Static: "
             f"`Pipeline(stages=2)`'s plan from a profile at the microbatch ({BATCH // CHUNKS}); "
             f"adaptive: the same with `adapt=True, adapt_every={ADAPT_EVERY}`; hindsight: the "
             f"best split within {NEIGHBOURS} of the hetero planner's for speeds (1, 1/{SLOW:g})."
             f" \"others\": cores other processes took in the slowed window; a run over "
             f"{DISTURBED} ran again (up to {retries} times); runs still over it are starred. "
             f"Plans: [start, stop, ranks] per stage.", ""]
    for model_name, s in summary.items():
        info = meta["models"][model_name]
        mine = [r for r in runs if r["model"] == model_name and r["contender"] == "adaptive"]
        finals = " or ".join(sorted({json.dumps(r["final_plan"]) for r in mine}))
        table = [row_cells("static", str(s["static_plans"][0]), s["contenders"]["static"]),
                 row_cells("adaptive", f"ends as {finals}", s["contenders"]["adaptive"])]
        for split, c in s["candidates"].items():
            mark = (" (the static runs)" if c["is_static"] else "") + (
                " **hindsight**" if int(split) == s["hindsight_split"] else "")
            table.append(row_cells(f"split {split}{mark}",
                                   f"{split} + {info['blocks'] - int(split)} blocks", c))
        met = s["recovery"] is not None and s["recovery"] >= 0.8
        lines += [f"## {TITLES[model_name]}", "",
                  f"Profiled block ms (forward + backward, 1 thread, batch {BATCH // CHUNKS}): "
                  f"{', '.join(f'{v:.1f}' for v in info['block_ms'])}. Equal-speed split: "
                  f"{info['equal_split']}; hetero planner's split for the slowed machine: "
                  f"{info['hetero_split']}.", "",
                  *harness.markdown_table(["contender", "plan", "unslowed samples/s",
                                           "slowed samples/s", "runs", "others (cores)"], table,
                                          left=2),
                  "", f"**Recovery** (adaptive - static) / (hindsight - static, {fmt(s['gap'])} "
                      f"samples/s, {fmt(s['gap_pct'], '+.1f')}%): **{pct(s['recovery'])}** (by "
                      f"repeat: {', '.join(map(pct, s['recovery_by_repeat']))}): the issue's "
                      f"mark of 80% is {'met' if met else '**not met**'}."]
        lines += [f"- repeat {m['repeat'] + 1}: move before step {m['step']}, {m['from']} -> "
                  f"{m['to']}, {fmt(m['seconds'], '.2f')} s, {m['bytes']} bytes ({m['reason']})"
                  for m in s["moves"]] or ["The adaptive runs made no move."]
        for run in (r for r in mine if r["checks"]):
            seen = [f"{c.get('step')}: " + "/".join(f"{v:.2f}" for v in c.get("speeds") or [])
                    + (" **moved**" if c.get("moved") else "") for c in run["checks"]]
            lines.append(f"- repeat {run['repeat'] + 1}, adapt's checks (step: speeds of rank 0/"
                         f"rank 1, the fastest 1): {'; '.join(seen)}.")
        lines.append("")
    lines += [f"Per-step times: {meta['png']}; every figure: {meta['json']}.", ""]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    styles = ("-", "--", ":", "-.")
    with harness.figure(path, len(summary), 1, (10, 4 * len(summary))) as (_, axes):
        for ax, (model_name, s) in zip(axes[:, 0], summary.items()):
            best, top = s["hindsight_split"], 0.0
            for row in (r for r in runs if r["model"] == model_name):
                # the best split's runs: the static ones where it is the static plan
                kinds = (("static", "tab:red", row["contender"] == "static"),
                         ("adaptive", "tab:blue", row["contender"] == "adaptive"),
                         (f"hindsight (split {best})", "tab:green",
                          row["contender"] != "adaptive" and row["split"] == best))
                for label, colour in ((k, c) for k, c, shown in kinds if shown):
                    repeat, steps = row["repeat"], len(row["step_ms"])
                    ax.plot(range(1, steps + 1), row["step_ms"], color=colour, lw=1,
                            ls=styles[repeat % len(styles)],
                            label=f"{label}, repeat {repeat + 1}: {row['slowed']:.1f} samples/s")
                    top = max(top, max(row["step_ms"][1:]))
                    for m in row["moves"]:  # before step index m["step"]: plotted at +1
                        ax.axvspan(m["step"] + 0.5, m["step"] + 1.5, color=colour, alpha=0.25)
            ax.axvline(SLOW_FROM + 0.5, color="k", ls="--", lw=1, label="rank 1 slowed")
            ax.axvline(SLOW_FROM + WARMUP + 0.5, color="grey", ls=":", lw=1,
                       label="slowed window's clock starts")
            ax.set_ylim(0, top * 1.25)
            harness.axes_text(ax, f"{TITLES[model_name]}: rank 0's time per step", "step",
                              "ms per step", {"fontsize": 7, "loc": "lower right", "ncol": 2},
                              grid=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="a,convs")
    parser.add_argument("--steps", default=str(STEPS), help="per run: N, or MODEL=N,...")
    parser.add_argument("--repeats", type=harness.positive, default=2)
    parser.add_argument("--retries", type=int, default=1, help="runs again, up to this many "
                        f"times, a run in which other processes took over {DISTURBED} cores")
    parser.add_argument("--out", default="bench/results/adaptive.md")
    args = parser.parse_args()
    models = args.models.split(",")
    if set(models) - set(MODELS):
        parser.error(f"--models {args.models}: choose from {', '.join(MODELS)}")
    given = dict(part.rpartition("=")[::2] for part in args.steps.split(","))  # "": all
    try:
        steps = {m: int(given.get(m) or given.get("") or STEPS) for m in models}
    except ValueError:
        parser.error(f"--steps {args.steps!r}: give N or MODEL=N,...")
    if min(steps.values()) <= SLOW_FROM + WARMUP + 1:
        parser.error(f"--steps: each model needs at least {SLOW_FROM + WARMUP + 2}")
    began, load = time.perf_counter(), [", ".join(f"{v:.2f}" for v in os.getloadavg())]
    profiles, equal, info = {}, {}, {}
    torch.set_num_threads(1)  # the profile: one thread and one microbatch, as each rank runs
    for m in models:
        say(f"profiling {m} (1 thread, batch {BATCH // CHUNKS}) ...")
        torch.manual_seed(0)
        profiles[m] = profile = profile_model(MODELS[m](), fixed_batch()[0][:BATCH // CHUNKS],
                                              BATCH // CHUNKS, progress=False, model_name=m)
        equal[m] = make_plan(profile, Topology.parse("2x1e9"), schedule=SCHEDULE, straight=True,
                             strategy="time")  # as Pipeline(stages=2)
        hetero = make_plan(profile, Topology.parse(f"2x1e9@speeds=1,{1 / SLOW:.4f}"),
                           schedule=SCHEDULE, straight=True, chunks=CHUNKS)
        if len(hetero.stages) != 2:
            raise RuntimeError(f"the hetero planner chose {len(hetero.stages)} stage(s) for "
                               f"{m}: {describe(hetero)}")
        split, blocks = hetero.stages[0].stop, len(profile.blocks)
        info[m] = {"steps": steps[m], "blocks": blocks, "equal_split": equal[m].stages[0].stop,
                   "hetero_split": split,
                   "block_ms": [b.forward_ms + b.backward_ms for b in profile.blocks],
                   "candidates": [s for s in range(split - NEIGHBOURS, split + NEIGHBOURS + 1)
                                  if 1 <= s <= blocks - 1]}
        say(f"  {info[m]}")
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        say(f"round {repeat + 1} of {args.repeats}")
        for m in models:
            # a candidate equal to the static split is the static run itself, not launched twice
            order = [("static", equal[m]), ("adaptive", equal[m])] + [
                ("hindsight", split_plan(profiles[m], s)) for s in info[m]["candidates"]
                if s != info[m]["equal_split"]]
            for contender, plan in (order[::-1] if repeat % 2 else order):
                row, rest = harness.least_disturbed(
                    functools.partial(run_one, m, contender, plan, steps[m], profiles[m]),
                    lambda r: r["others_cores"], args.retries, say)
                runs.append({**row, "repeat": repeat, "disturbed_runs": [
                    {k: r[k] for k in ("slowed", "unslowed", "others_cores")} for r in rest]})
    out = Path(args.out)
    png, data = out.with_suffix(".png"), out.with_suffix(".json")
    load.append(", ".join(f"{v:.2f}" for v in os.getloadavg()))
    meta = {"command": harness.command(), "machine": harness.machine_info(
                commit=harness.git("rev-parse", "HEAD"),
                **{"load average (1, 5, 15 min) at the start": load[0], "at the end": load[1]}),
            "wall_s": time.perf_counter() - began, "models": info, "slow_from": SLOW_FROM,
            "slow": SLOW, "adapt_every": ADAPT_EVERY, "neighbours": NEIGHBOURS,
            "png": png.name, "json": data.name}
    summary = {m: summarise([r for r in runs if r["model"] == m], info[m]["candidates"])
               for m in models}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(summary, runs, meta, args.repeats, args.retries))
    harness.write_json(data, {"meta": meta, "args": vars(args), "summary": summary, "runs": runs})
    plot(runs, summary, png)
    say(f"wrote {out}, {data}, {png} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
