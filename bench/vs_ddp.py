"""pipedream_fast against DistributedDataParallel on an emulated 2-machine cluster.

Per link rate (bench/netcluster.py) and model: DDP (16 samples per rank), and Pipeline on 2
stages with `pipedream` (one microbatch), `2bw` and `1f1b` (chunks=2), on one fixed batch of 32.
Models: `a` (build_cnn, cut at conv | fc) and `convs` (few parameters: data parallelism should
win). Against the planner's predictions and the balanced-pipeline limit; the reading under the
results' tables is written by hand.

    python bench/vs_ddp.py [--rates 10gbit,1gbit,100mbit] [--models a,convs] [--scale 1]
                           [--retries 1] [--out bench/results/vs_ddp.md]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pipedream_fast.models import build_cnn

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
import netcluster
from netcluster import BATCH, WORLD, two_stage_plan

LR = 0.01
# `pipedream-balanced`: `pipedream` on the profile's balanced cut where that is not the fixed
# one: how close the runtime gets to the balanced-pipeline limit with the planner's split.
LABELS = {"ddp": "DDP (gloo), 16 per rank", "pipedream": "pipedream_fast pipedream",
          "2bw": "pipedream_fast 2bw, chunks=2", "1f1b": "pipedream_fast 1f1b, chunks=2",
          "pipedream-balanced": "pipedream_fast pipedream, balanced cut"}
# (warm-up, measured) steps: DDP's step time grows as the link slows (140 MB a step for model
# A), so its count shrinks with the rate; pipelines' hardly depends on it.
DDP_STEPS = {"10gbit": (3, 15), "1gbit": (2, 8), "100mbit": (1, 3)}
PIPELINE_STEPS = (3, 15)
RETRY_BUDGET_S = 11 * 60  # no retries after this
LIMIT_GOAL = 0.9  # of the balanced-pipeline limit, at every bandwidth
PARTS = {"compute": ("forward", "backward", "backward_input", "backward_weight"),
         "waiting": (), "receives": ("recv_act", "recv_grad"), "sends": ("send_act", "send_grad"),
         "update": ("optimizer_step", "allreduce", "average"), "copies": ("snapshot", "release"),
         "other": ()}


def build_convs() -> nn.Sequential:
    """Conv-only model with few parameters: 5 convolutions at 32x32, average pool, tiny head."""
    widths = [(3, 32), (32, 64), (64, 64), (64, 64), (64, 64)]
    blocks: dict[str, nn.Module] = {
        f"conv{i + 1}": nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())
        for i, (cin, cout) in enumerate(widths)}
    blocks["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return nn.Sequential(OrderedDict(blocks))


MODELS = {"a": build_cnn, "convs": build_convs}
MODEL_TITLES = {"a": "model A (build_cnn)", "convs": "convs (conv-only, few parameters)"}
MODEL_A_SPLIT = 6  # conv | fc, as bench/vs_pipelining.py --set model_a


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


# ---- ranks (run inside the namespaces) -----------------------------------------------------

def breakdown(events: list[Any], begin_s: float, end_s: float, batches: int) -> dict[str, float]:
    """ms per batch of [begin_s, end_s) (the trace's perf_counter clock) in each of PARTS;
    `waiting`: a forward or backward's wait for its message, `other`: what no action covers."""
    parts = dict.fromkeys(PARTS, 0.0)
    part_of = {kind: part for part, kinds in PARTS.items() for kind in kinds}
    for event in events:
        if begin_s * 1e3 <= event.start_ms < end_s * 1e3:
            waited = float(event.args.get("waited_ms", 0.0))
            parts[part_of.get(event.kind, "other")] += event.duration_ms - waited
            parts["waiting"] += waited
    parts["other"] += (end_s - begin_s) * 1e3 - sum(parts.values())
    return {part: ms / batches for part, ms in parts.items()}


def worker(contender: str, model_name: str, split: int, warmup: int,
           measured: int) -> dict[str, Any]:
    """A contender's rank, or ("alone") the whole model on the whole batch in this process: its
    window after the warm-up (`netcluster.since`)."""
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = MODELS[model_name](), fixed_batch()
    if contender in ("ddp", "alone"):
        train = netcluster.trainer(model, contender == "ddp",
                                   lambda ps: torch.optim.SGD(ps, lr=LR))
        train([batch] * warmup)
        start = netcluster.snapshot()
        train([batch] * measured)
        return netcluster.since(start)
    schedule = "pipedream" if contender == "pipedream-balanced" else contender
    pipe = Pipeline(model, nn.functional.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=LR),
                    plan=two_stage_plan(model_name, split, len(model), schedule), timeout=600.0,
                    schedule=schedule, chunks=2 if contender in ("2bw", "1f1b") else 1, trace=True)
    for step, _ in enumerate(pipe.train([batch] * (warmup + measured), warmup + measured)):
        if step == warmup - 1:
            start = netcluster.snapshot()
    window = netcluster.since(start)
    window["breakdown"] = breakdown(pipe.last_events, start["seconds"],
                                    start["seconds"] + window["seconds"], measured)
    pipe.close()
    return window


# ---- the planner's view --------------------------------------------------------------------

def planner_view(model_name: str, rate_bits: int, split: int) -> dict[str, Any]:
    """ms per batch: the planner's plan for 2 workers at this rate, the bench's 2-stage pipeline
    (cut before `split`), DDP (from a profile at its per-rank batch); on free links, the
    balanced-pipeline limit and the best 2-stage cut's slower stage."""
    from pipedream_fast.planner import evaluate_plan, make_plan
    from pipedream_fast.topology import Topology

    prof, per_replica = profile(model_name), profile(model_name, BATCH // WORLD)
    topology = Topology.parse(f"{WORLD}x{rate_bits / 8:g}")
    stages = make_plan(prof, topology, schedule="pipedream").stages
    choice = "pipeline, blocks " + " / ".join(
        f"{s.start}-{s.stop - 1}" + (f" x{s.replicas}" if s.replicas > 1 else "") for s in stages)
    if len(stages) == 1:
        choice = "data parallel" if stages[0].replicas > 1 else "one worker"
    ddp = make_plan(per_replica, topology, schedule="1f1b", strategy="data-parallel", chunks=WORLD)
    pipeline = two_stage_plan(prof.model, split, len(prof.blocks), "pipedream")
    return {"choice": choice, "ddp_ms": ddp.bottleneck_ms * WORLD, "pipeline_split": split,
            "pipeline_ms": evaluate_plan(pipeline, prof, topology).bottleneck_ms,
            "limit_ms": make_plan(prof, Topology.parse("1x1e18")).bottleneck_ms / WORLD,
            "split_limit_ms": make_plan(prof, Topology.parse(f"{WORLD}x1e18"),
                                        straight=True).bottleneck_ms}


@functools.cache
def profile(model_name: str, batch: int = BATCH) -> Any:
    from pipedream_fast.profiler import profile_model

    torch.set_num_threads(1)  # as each rank runs
    torch.manual_seed(0)
    return profile_model(MODELS[model_name](), fixed_batch()[0][:batch], batch, progress=False,
                         model_name=model_name)


# ---- the harness ---------------------------------------------------------------------------

def run_all(models: list[str], rates: list[str], scale: float, retries: int) -> dict[str, Any]:
    """Every model and contender at every rate; the planner's views, one rank alone."""
    from pipedream_fast.planner.baselines import balanced_partition

    # the first block of stage 1 when 2 stages are balanced by profiled compute
    balanced = {m: balanced_partition([b.forward_ms + b.backward_ms
                                       for b in profile(m).blocks], 2)[1] for m in models}
    splits = {m: MODEL_A_SPLIT if m == "a" else balanced[m] for m in models}
    views = [{"model": m, "rate": r, **planner_view(m, netcluster.parse_rate(r), splits[m])}
             for m in models for r in rates]
    rows: list[dict[str, Any]] = []
    alone: list[dict[str, Any]] = []  # one rank's samples/s, measured next to the rest
    deadline = time.monotonic() + RETRY_BUDGET_S

    def run(cluster: netcluster.Cluster, model: str, contender: str, rate: str) -> dict[str, Any]:
        warmup, measured = DDP_STEPS.get(rate, (2, 5)) if contender == "ddp" else PIPELINE_STEPS
        measured = max(1, round(measured * scale))
        split = balanced[model] if contender == "pipedream-balanced" else splits[model]
        ranks = netcluster.run_workers(cluster, __file__,
                                       [contender, model, split, warmup, measured], 600.0)
        return {"model": model, "rate": rate, "contender": contender,
                "samples_per_s": BATCH * measured / ranks[-1]["seconds"],  # the last rank's clock
                "bytes_per_sample": sum(r["tx_bytes"] for r in ranks) / (BATCH * measured),
                "warmup": warmup, "measured": measured,
                "other_cores": harness.other_cores(ranks, sum(r["seconds"] for r in ranks) / WORLD),
                "breakdowns": [r["breakdown"] for r in ranks if "breakdown" in r]}

    def each(cluster: netcluster.Cluster, rate: str) -> None:
        for model in models:
            alone.append({"model": model, "rate": rate, "samples_per_s": BATCH * 8 / worker(
                "alone", model, 0, 3, 8)["seconds"]})
            harness.say(f"[{rate}] {model} one rank alone: {alone[-1]['samples_per_s']:.1f}/s")
            for contender in [c for c in LABELS if c != "pipedream-balanced"
                              or balanced[model] != splits[model]]:
                row, rest = harness.least_disturbed(
                    functools.partial(run, cluster, model, contender, rate),
                    lambda r: r["other_cores"], retries, harness.say, deadline)
                rows.append({**row, "tries": 1 + len(rest)})
                harness.say(f"[{rate}] {model} {LABELS[contender]:40s} "
                            f"{row['samples_per_s']:7.1f}/s {row['bytes_per_sample'] / 1e6:8.3f} "
                            f"MB/sample, others took {row['other_cores']:.2f} cores")

    links = netcluster.sweep(rates, each)
    splits.update({f"{m} balanced": balanced[m] for m in models if balanced[m] != splits[m]})
    return {"rows": rows, "links_mb_s": links, "splits": splits, "one_rank_alone": alone,
            "planner": views}


# ---- the report ----------------------------------------------------------------------------

def markdown(got: dict[str, Any], total_s: float) -> str:
    rows = got["rows"]
    ddp = {r["rate"]: f"{r['warmup']}+{r['measured']}" for r in rows if r["contender"] == "ddp"}
    lines = [*netcluster.header("pipedream_fast vs DistributedDataParallel on an emulated "
                                "2-machine cluster", got["links_mb_s"], total_s),
             "- Same work for every contender: a global batch of 32 per step, SGD lr 0.01, one "
             "fixed synthetic batch. DDP: 16 per rank. `pipedream`: one microbatch. `2bw` and "
             "`1f1b`: chunks=2 (two microbatches of 16, one update per step).",
             "- Samples/s: after the warm-up (a pipeline: its last rank's clock); steps, warm-up "
             "+ measured: DDP " + ", ".join(f"{k} {v}" for k, v in ddp.items()) + "; pipelines "
             + next(f"{r['warmup']}+{r['measured']}" for r in rows if r["contender"] != "ddp")
             + " at every rate. MB/sample: both ranks' veth tx_bytes over that window (frames, "
             "headers and ACKs included).",
             f"- Others: the cores other processes took meanwhile; over {harness.DISTURBED}, the "
             f"run was rerun and the less disturbed kept ({sum(r['tries'] > 1 for r in rows)} "
             f"of {len(rows)} runs were).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += model_section(model, got, list(got["links_mb_s"]))
    return "\n".join(lines) + "\n"


def model_section(model: str, got: dict[str, Any], rates: list[str]) -> list[str]:
    built, split, balanced = MODELS[model](), got["splits"][model], got["splits"].get(
        f"{model} balanced")
    names, params = list(dict(built.named_children())), list(built.parameters())
    views = {v["rate"]: v for v in got["planner"] if v["model"] == model}
    alone = {a["rate"]: a["samples_per_s"] for a in got["one_rank_alone"] if a["model"] == model}
    work_ms, profiled, cut = (views[rates[0]]["limit_ms"] * WORLD,
                              *(BATCH / views[rates[0]][k] * 1e3
                                for k in ("limit_ms", "split_limit_ms")))
    measured, planned, shares, where = [], [], [], []
    for rate in rates:
        view, here = views[rate], [r for r in got["rows"] if (r["model"], r["rate"]) == (model,
                                                                                        rate)]
        ddp, best = here[0], max(here[1:], key=lambda r: r["samples_per_s"])
        for index, row in enumerate(here):
            speed, size = row["samples_per_s"], row["bytes_per_sample"]
            label = LABELS[row["contender"]]
            measured.append([rate if index == 0 else "", label, f"{speed:.1f}",
                             f"{speed / ddp['samples_per_s']:.2f}x", f"{size / 1e6:.3f}",
                             f"{size / ddp['bytes_per_sample']:.3f}x", f"{row['other_cores']:.2f}",
                             view["choice"] if index == 0 else ""])
            if row["contender"].startswith("pipedream"):
                limit = WORLD * alone[rate]
                shares.append([rate, label, f"{speed:.1f}", f"{limit:.1f}", f"{speed / limit:.2f}",
                               f"{speed / profiled:.2f}",
                               "met" if speed / limit >= LIMIT_GOAL else "missed"])
                where += [[rate if rank == 0 else "", label if rank == 0 else "", rank,
                           *(f"{p[k]:.0f}" for k in PARTS)]
                          for rank, p in enumerate(row["breakdowns"])]
        planned.append([rate, view["choice"], f"{view['ddp_ms']:.0f}",
                        f"{BATCH / ddp['samples_per_s'] * 1e3:.0f}",
                        f"{view['pipeline_ms']:.0f} ({view['pipeline_split']})",
                        f"{BATCH / best['samples_per_s'] * 1e3:.0f} ({best['contender']})"])
    return [f"## {MODEL_TITLES[model]}", "",
            f"{sum(p.numel() for p in params) / 1e6:.2f} M parameters "
            f"({sum(p.numel() * p.element_size() for p in params) / 1e6:.1f} MB); pipelines: "
            f"2 stages, stage 1 starts at block {split} ({names[split]})."
            + (f" The balanced cut of this profile starts stage 1 at block {balanced} "
               f"({names[balanced]}): `pipedream, balanced cut`." if balanced is not None
               else ""), "",
            *harness.markdown_table(["link", "contender", "samples/s", "vs DDP", "MB/sample",
                                     "bytes vs DDP", "others (cores)", "planner's choice"],
                                    measured, left=2), "",
            "The planner (PipeDream's dynamic program, topology `2x<rate/8 bytes/s>`, this "
            "machine's profile with 1 thread) against the measurements, ms per batch of 32; "
            "DDP predicted from a profile at its per-rank batch of 16:", "",
            *harness.markdown_table(["link", "planner picks", "predicted: DDP, 16 per rank",
                                     "measured: DDP", "predicted: the measured 2-stage pipeline "
                                     "(split)", "measured: best pipeline"], planned, left=2), "",
            f"Against the balanced-pipeline limit, measured: {WORLD} x one rank alone (whole "
            f"model, same step, just before each rate's contenders). The profile's work per batch "
            f"({work_ms:.0f} ms) split evenly gives {profiled:.1f} samples/s, its best 2-stage cut "
            f"{cut:.1f} ({cut / profiled:.2f} of it). Goal: `pipedream` at {LIMIT_GOAL} or more.",
            "",
            *harness.markdown_table(["link", "contender", "samples/s", "limit (measured)",
                                     "of it", "of the profile's", "goal"], shares, left=2), "",
            "Where each rank's time goes under `pipedream`, ms per batch, from the runtime's "
            "trace: compute (less its waits), waiting (for a message), receives and sends "
            "(posting them), update, copies (weight versions), other (data feed, Python).", "",
            *harness.markdown_table(["link", "contender", "rank", *PARTS], where, left=2), ""]


def measure(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if not set(args.models) <= set(MODELS):
        sys.exit(f"vs_ddp: unknown model in {args.models}; choose among {', '.join(MODELS)}")
    began = time.monotonic()
    got = run_all(args.models, args.rates, args.scale, args.retries)
    return markdown(got, time.monotonic() - began), got


if __name__ == "__main__":
    sys.exit(netcluster.launch(__doc__, worker, "10gbit,1gbit,100mbit", measure, {
        "--models": dict(type=lambda s: s.split(","), default="a,convs",
                         help=f"comma-separated, among {', '.join(MODELS)} (default a,convs)"),
        "--scale": dict(type=float, default=1.0, help="multiply every measured step count"),
        "--retries": dict(type=int, default=1, metavar="N", help=f"run a contender again, up "
                          f"to N times, while others took over {harness.DISTURBED} cores")}))
