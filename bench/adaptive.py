"""Adaptive re-planning against a rank slowed part-way: static plan, adaptive run, hindsight best.

Two ranks (processes, gloo, 1 thread each), 1f1b, chunks 4, a straight 2-stage pipeline, one
fixed batch of 32; models `a` (build_cnn) and `convs` (vs_ddp.build_convs). From step SLOW_FROM
on, rank 1's StageRuntime compute calls sleep (SLOW - 1) x their own duration (the slowdown
follows the rank, not the blocks). Each round launches, in alternating order: static (the plan
Pipeline(stages=2) makes from a profile taken here), adaptive (the same plan, adapt=True) and
hindsight (the hetero planner's split for speeds (1, 1/SLOW), +-NEIGHBOURS blocks, as plan=;
the best counts). Rate: rank 0's samples/s from WARMUP steps after the slowdown to the end;
recovery = (adaptive - static) / (hindsight - static).

    python bench/adaptive.py [--models a,convs] [--steps a=80,convs=80] [--repeats 2] \
        [--retries 1] [--out bench/results/adaptive.md]

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
from pipedream_fast.planner import make_plan
from pipedream_fast.profiler import profile_model
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.topology import Topology

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
from harness import DISTURBED, fmt, say
from vs_ddp import build_convs, fixed_batch

BATCH = 32
CHUNKS = 4
SCHEDULE = "1f1b"
SLOW_FROM = 10  # rank 1 is slowed from this step on
SLOW = 1.5  # ... by this factor
ADAPT_EVERY = 5  # adapt's check interval in steps
NEIGHBOURS = 1  # hindsight candidates: the hetero planner's split +- this many blocks
WARMUP = 3  # steps after the slowdown starts before the slowed window's clock starts
MODELS = {"a": build_cnn, "convs": build_convs}
TITLES = {"a": "model A (build_cnn)", "convs": "convs (vs_ddp.build_convs)"}
DEFAULT_STEPS = {"a": 80, "convs": 80}

# In the slowed process only: whether the slowdown is on and what it did.
_SLOW: dict[str, Any] = {"on": False, "calls": 0, "compute_s": 0.0, "slept_s": 0.0}


def install_slowdown() -> None:
    """Wraps StageRuntime's compute methods (this process only): once `_SLOW["on"]`, each
    call sleeps SLOW - 1 times its own duration after running."""
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        original = getattr(StageRuntime, name, None)
        if original is None or getattr(original, "_slowed", False):
            continue

        @functools.wraps(original)
        def slowed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = _original(self, *args, **kwargs)
            if _SLOW["on"]:
                took = time.perf_counter() - began
                time.sleep((SLOW - 1.0) * took)
                _SLOW["calls"] += 1
                _SLOW["compute_s"] += took
                _SLOW["slept_s"] += time.perf_counter() - began - took
            return out

        slowed._slowed = True  # type: ignore[attr-defined]
        setattr(StageRuntime, name, slowed)


def describe(plan: Any) -> list[list[Any]]:
    return [[s.start, s.stop, list(s.ranks)] for s in plan.stages]


def rank_main(rank: int, world: int, model_name: str, plan: Plan, steps: int, adapt: bool,
              profile: Any) -> dict[str, Any]:
    """One rank of one contender: `plan`, adapting from `profile` if `adapt`."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if rank == 1:
        install_slowdown()
    kwargs: dict[str, Any] = {"plan": plan}
    if adapt:
        kwargs.update(adapt=True, profile=profile, adapt_every=ADAPT_EVERY)
    pipe = Pipeline(MODELS[model_name](), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), schedule=SCHEDULE, chunks=CHUNKS,
                    timeout=600.0, **kwargs)
    began = time.perf_counter()
    clock = harness.Clock()  # over the slowed window, for the other processes' share
    ends: list[float] = []
    first_plan = last = window = None
    for loss in pipe.train([fixed_batch()] * steps, steps):
        ends.append(time.perf_counter())
        last = loss
        first_plan = first_plan or describe(pipe.plan)
        if len(ends) == SLOW_FROM and rank == 1:
            _SLOW["on"] = True
        if len(ends) == SLOW_FROM + WARMUP:
            clock.warmed_up()
        if len(ends) == steps:
            window = clock.done()
    out = {"began": began, "ends": ends, "window": window, "first_plan": first_plan,
           "final_plan": describe(pipe.plan),
           "moves": harness.plain(list(getattr(pipe, "moves", []) or [])),
           "checks": harness.plain(list(getattr(pipe, "adapt_checks", []) or [])),
           "slow": dict(_SLOW) if rank == 1 else None,
           "last_loss": float(last) if last is not None else None}
    pipe.close()
    return out


# ---- the parent: plans, runs, summaries -----------------------------------------------------

def profile_of(model_name: str) -> Any:
    """The model's per-block profile here: one thread (as each rank runs), one microbatch."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    micro = BATCH // CHUNKS
    return profile_model(MODELS[model_name](), fixed_batch()[0][:micro], micro,
                         progress=False, model_name=model_name)


def plan_2(profile: Any, topology: str, **options: Any) -> Plan:
    return make_plan(profile, Topology.parse(topology), schedule=SCHEDULE, straight=True,
                     **options)


def split_plan(profile: Any, split: int) -> Plan:
    """Two stages cut before block `split`, named after the profile's model and batch (so
    that it matches the profile adapt re-plans from)."""
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
    # Other processes' cores in the slowed window: the machine's busy time less both ranks'.
    others = harness.other_cores([r0["window"], r1["window"]], ends[-1] - ends[w])
    for m in r0["moves"]:  # rank 0's perf_counter, relative to its first step's end
        m["started_rel_s"] = m.get("started", ends[0]) - ends[0]
        m["ended_rel_s"] = m.get("ended", ends[0]) - ends[0]
    slow = r1["slow"] or {}
    row = {"model": model_name, "contender": contender, "split": r0["first_plan"][0][1],
           "steps": steps, "plan": r0["first_plan"], "final_plan": r0["final_plan"],
           "unslowed": before, "slowed": after, "others_cores": others,
           "step_ms": [(b - a) * 1e3 for a, b in zip([r0["began"]] + ends[:-1], ends)],
           "ends_rel_s": [e - ends[0] for e in ends], "moves": r0["moves"],
           "checks": r0["checks"], "last_loss": r0["last_loss"],
           "achieved_slowdown": (1 + slow["slept_s"] / slow["compute_s"]
                                 if slow.get("compute_s") else None),
           "wall_s": time.perf_counter() - t0}
    say(f"  {model_name:5s} {contender:9s} plan {row['plan']}  unslowed {before:6.1f}  slowed "
        f"{after:6.1f} samples/s  (rank 1 x{row['achieved_slowdown'] or 0:.2f}, others "
        f"{others:.2f} cores, {row['wall_s']:.0f} s)" + "".join(
            f"; move before step {m['step']} {m['from']} -> {m['to']} in {m['seconds']:.2f} s"
            for m in row["moves"]))
    return row


def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of the slowed and unslowed rates and other processes' cores."""
    def med(key: str) -> float | None:
        return statistics.median([r[key] for r in rows]) if rows else None

    return {"median": med("slowed"), "unslowed": med("unslowed"),
            "others_cores": med("others_cores"), "runs": [r["slowed"] for r in rows],
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
    out: dict[str, Any] = {"static_split": split, "static_plans": [r["plan"] for r in static],
                           "contenders": {"static": stats(static), "adaptive": stats(adaptive)},
                           "candidates": {str(s): c for s, c in cand.items()},
                           "hindsight": cand[best]["median"], "hindsight_split": best}
    out["static"] = s = out["contenders"]["static"]["median"]
    out["adaptive"] = a = out["contenders"]["adaptive"]["median"]
    out["gap"] = gap = out["hindsight"] - s
    out["gap_pct"] = gap / s * 100
    out["recovery"] = (a - s) / gap if gap > 0 else None
    out["moves"] = [{"repeat": r["repeat"], **{k: m.get(k) for k in (
        "step", "seconds", "from", "to", "reason", "bytes")}} for r in adaptive for m in r["moves"]]
    # per repeat: that round's adaptive against that round's static and best candidate
    per = []
    for i, run in enumerate(adaptive):
        s_i = static[i]["slowed"]
        h_i = max(rows[i]["slowed"] for rows in by_split.values() if i < len(rows))
        per.append((run["slowed"] - s_i) / (h_i - s_i) if h_i > s_i else None)
    out["recovery_by_repeat"] = per
    return out


# ---- outputs --------------------------------------------------------------------------------

def row_cells(name: str, plan: str, c: dict[str, Any]) -> list[str]:
    """A contender's table row; runs starred where other processes took over DISTURBED cores."""
    runs = ", ".join(fmt(r) + ("\\*" if o > DISTURBED else "")
                     for r, o in zip(c["runs"], c["runs_others"]))
    return [name, plan, fmt(c["unslowed"]), fmt(c["median"]), runs, fmt(c["others_cores"], ".2f")]


def markdown(summary: dict[str, Any], runs: list[dict[str, Any]], meta: dict[str, Any],
             repeats: int, retries: int) -> str:
    steps = ", ".join(f"{m} {info['steps']}" for m, info in meta["models"].items())
    lines = ["# Adaptive re-planning: one rank slowed part-way", "",
             f"Command: `{meta['command']}`", "",
             harness.machine_line(meta["machine"], meta["wall_s"]), "",
             f"2 ranks (processes, gloo, 1 thread each), {SCHEDULE}, chunks {CHUNKS}, batch "
             f"{BATCH}, steps per run: {steps}. Rank 1 slowed x{SLOW:g} from step {SLOW_FROM} "
             f"(its compute calls sleep {SLOW - 1:g}x their own duration, whatever blocks it "
             f"holds). Rates: rank 0's samples/s from the end of step {SLOW_FROM + WARMUP} to "
             f"the last, moves included (unslowed: steps {WARMUP + 1}-{SLOW_FROM}); medians of "
             f"{repeats} interleaved repeats. Static: the plan `Pipeline(stages=2)` makes from a "
             f"profile of {BATCH // CHUNKS} samples (the ranks' microbatch) taken once here, "
             f"passed as `plan=` (and to adaptive as `profile=`); adaptive: `adapt=True, "
             f"adapt_every={ADAPT_EVERY}`; hindsight: the best candidate split, the hetero "
             f"planner's for speeds (1, 1/{SLOW:g}) +-{NEIGHBOURS} blocks. \"others\": cores "
             f"other processes took in the slowed window (the machine's busy time less the "
             f"ranks'); a run over {DISTURBED} ran again (up to {retries} times), the least "
             f"disturbed kept; runs still over it are starred (\\*). Plans: [start, stop, "
             f"ranks] per stage.", ""]
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
        rec = s["recovery"]
        lines += [f"## {TITLES[model_name]}", "",
                  f"Profiled block ms (forward + backward, 1 thread, batch {BATCH // CHUNKS}): "
                  f"{', '.join(f'{v:.1f}' for v in info['block_ms'])}. Equal-speed split: "
                  f"{info['equal_split']}; hetero planner's split for the slowed machine: "
                  f"{info['hetero_split']}.", "",
                  *harness.markdown_table(["contender", "plan", "unslowed samples/s",
                                           "slowed samples/s", "runs", "others (cores)"], table,
                                          left=2),
                  "", f"Gap hindsight - static: {fmt(s['gap'])} samples/s "
                      f"({fmt(s['gap_pct'], '+.1f')}% of static).",
                  f"**Recovery** (adaptive - static) / (hindsight - static): "
                  f"**{fmt(None if rec is None else rec * 100, '.0f')}%** (by repeat: "
                  + ", ".join(fmt(None if v is None else v * 100, ".0f") + "%"
                              for v in s["recovery_by_repeat"])
                  + f"): the issue's mark of 80% is "
                  f"{'met' if rec is not None and rec >= 0.8 else '**not met**'}."]
        lines += [f"- repeat {m['repeat'] + 1}: move before step {m['step']} (the slowdown "
                  f"began at step {SLOW_FROM}), {m['from']} -> {m['to']}, "
                  f"{fmt(m['seconds'], '.2f')} s, {m['bytes']} bytes as the runtime counts "
                  f"them ({m['reason']})" for m in s["moves"]] or ["The adaptive runs made no move."]
        for run in (r for r in mine if r["checks"]):
            lines += ["", f"Checks of the adaptive run of repeat {run['repeat'] + 1} (speeds: "
                          f"rank 0, rank 1, the fastest 1):", ""]
            lines += [f"- step {c.get('step')}: speeds "
                      + (", ".join(f"{v:.2f}" for v in c["speeds"]) if c.get("speeds") else "-")
                      + f"; {'**moved**' if c.get('moved') else 'stayed'}: {c.get('reason')}"
                      for c in run["checks"]]
        lines.append("")
    lines += [f"Per-step times: {meta['png']}; rank 0's steps of every run as a Chrome / "
              f"Perfetto trace, moves as spans: {meta['trace']}; every figure: "
              f"{meta['json']}.", ""]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    styles = ("-", "--", ":", "-.")
    with harness.figure(path, len(summary), 1, (10, 4 * len(summary))) as (_, axes):
        for ax, (model_name, s) in zip(axes[:, 0], summary.items()):
            best = s["hindsight_split"]
            shown = [("static", None, "tab:red"), ("adaptive", None, "tab:blue"),
                     # the best candidate's runs, the static ones where it is the static plan
                     ("static" if s["candidates"][str(best)]["is_static"] else "hindsight",
                      best, "tab:green")]
            top = 0.0
            for contender, split, colour in shown:
                label = ("hindsight" if split is not None else contender) + (
                    f" (split {split})" if split is not None else "")
                for row in (r for r in runs if r["model"] == model_name
                            and r["contender"] == contender
                            and (split is None or r["split"] == split)):
                    repeat, steps = row["repeat"], len(row["step_ms"])
                    ax.plot(range(1, steps + 1), row["step_ms"], color=colour, lw=1,
                            ls=styles[repeat % len(styles)],
                            label=f"{label}, repeat {repeat + 1}: {row['slowed']:.1f} samples/s")
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
            ax.axvline(SLOW_FROM + 0.5, color="k", ls="--", lw=1, label="rank 1 slowed")
            ax.axvline(SLOW_FROM + WARMUP + 0.5, color="grey", ls=":", lw=1,
                       label="slowed window's clock starts")
            ax.set_ylim(0, top * 1.25)
            harness.axes_text(ax, f"{TITLES[model_name]}: rank 0's time per step", "step",
                              "ms per step", {"fontsize": 7, "loc": "lower right", "ncol": 2},
                              grid=None)


def chrome_trace(runs: list[dict[str, Any]], path: Path) -> None:
    """Rank 0's steps per run as Chrome trace events (one track per run), moves as spans."""
    events: list[dict[str, Any]] = []
    for i, r in enumerate(runs):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {
            "name": f"{r['model']} {r['contender']} split {r['split']} #{i}"}})
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="a,convs")
    parser.add_argument("--steps", default=",".join(f"{m}={n}" for m, n in DEFAULT_STEPS.items()),
                        help="steps per run: N, or MODEL=N pairs (default %(default)s)")
    parser.add_argument("--repeats", type=harness.positive, default=2)
    parser.add_argument("--retries", type=int, default=1,
                        help=f"runs again a run during which other processes took more than "
                             f"{DISTURBED} cores, up to this many times (default 1)")
    parser.add_argument("--out", default="bench/results/adaptive.md")
    args = parser.parse_args()
    models = args.models.split(",")
    if set(models) - set(MODELS):
        parser.error(f"--models {args.models}: choose from {', '.join(MODELS)}")
    steps = {m: DEFAULT_STEPS[m] for m in models}
    try:
        for part in args.steps.split(","):
            name, _, value = part.rpartition("=")
            steps.update({m: int(value) for m in models if not name or m == name.strip()})
    except ValueError:
        parser.error(f"--steps {args.steps!r}: give N or MODEL=N,...")
    if min(steps.values()) <= SLOW_FROM + WARMUP + 1:
        parser.error(f"--steps: each model needs at least {SLOW_FROM + WARMUP + 2}")
    began = time.perf_counter()
    load = [", ".join(f"{v:.2f}" for v in os.getloadavg())]
    profiles, equal, info = {}, {}, {}
    for m in models:
        say(f"profiling {m} (1 thread, batch {BATCH // CHUNKS}) ...")
        profiles[m] = profile = profile_of(m)
        equal[m] = plan_2(profile, "2x1e9", strategy="time")  # as Pipeline(stages=2)
        hetero = plan_2(profile, f"2x1e9@speeds=1,{1 / SLOW:.4f}", chunks=CHUNKS)
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
                row["disturbed_runs"] = [{k: r[k] for k in ("slowed", "unslowed",
                                                            "others_cores")} for r in rest]
                row["repeat"] = repeat
                runs.append(row)
    out = Path(args.out)
    png, data, trace = (out.with_suffix(".png"), out.with_suffix(".json"),
                        out.with_name(out.stem + "_trace.json"))
    load.append(", ".join(f"{v:.2f}" for v in os.getloadavg()))
    meta = {"command": harness.command(), "machine": harness.machine_info(
                commit=harness.git("rev-parse", "HEAD"),
                **{"load average (1, 5, 15 min) at the start": load[0], "at the end": load[1]}),
            "wall_s": time.perf_counter() - began, "models": info, "slow_from": SLOW_FROM,
            "slow": SLOW, "adapt_every": ADAPT_EVERY, "neighbours": NEIGHBOURS,
            "png": png.name, "json": data.name, "trace": trace.name}
    summary = {m: summarise([r for r in runs if r["model"] == m], info[m]["candidates"])
               for m in models}
    for m, s in summary.items():
        say(f"{m}: static {s['static']:.1f}  hindsight {s['hindsight']:.1f} (split "
            f"{s['hindsight_split']})  gap {s['gap_pct']:+.1f}%  adaptive {s['adaptive']:.1f}"
            f"  recovery {fmt(None if s['recovery'] is None else s['recovery'] * 100, '.0f')}%")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(summary, runs, meta, args.repeats, args.retries))
    harness.write_json(data, {"meta": meta, "args": vars(args), "summary": summary,
                              "runs": runs})
    plot(runs, summary, png)
    chrome_trace(runs, trace)
    say(f"wrote {out}, {data}, {png}, {trace} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
