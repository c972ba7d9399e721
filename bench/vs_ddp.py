"""pipedream_fast against DistributedDataParallel on an emulated 2-machine cluster.

Per link rate (bench/netcluster.py) and model: DDP (16 samples per rank), and Pipeline on 2
stages with `pipedream` (one microbatch), `2bw` and `1f1b` (chunks=2), on one fixed batch of 32.
Models: `a` (build_cnn, cut at conv | fc) and `convs` (few parameters: data parallelism should
win). Against the planner's predictions and the balanced-pipeline limit; the reading under the
results' tables is written by hand.

    python bench/vs_ddp.py [--rates 10gbit,1gbit,100mbit] ... [--out bench/results/vs_ddp.md]
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
def worker(contender: str, model_name: str, split: int, warmup: int,
           measured: int) -> dict[str, Any]:
    """A contender's rank, or ("alone") the whole model on the whole batch in this process: its
    window after the warm-up (`netcluster.since`)."""
    from pipedream_fast.pipeline import Pipeline
    from pipedream_fast.runtime.cpu_cache import CpuCacheHold
    from pipedream_fast.tuning import Tuning

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = MODELS[model_name](), fixed_batch()
    if contender in ("ddp", "alone"):
        # The same memory behaviour as the pipelines' (the CPU block cache a Pipeline holds),
        # so that the ratios measure the parallelism, not the allocator.
        hold = CpuCacheHold(torch.device("cpu"), Tuning().cpu_cache_bytes)
        try:
            train = netcluster.trainer(model, contender == "ddp",
                                       lambda ps: torch.optim.SGD(ps, lr=LR))
            train([batch] * warmup)
            start = netcluster.snapshot()
            train([batch] * measured)
            return netcluster.since(start)
        finally:
            hold.release()
    schedule = "pipedream" if contender == "pipedream-balanced" else contender
    pipe = Pipeline(model, nn.functional.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=LR),
                    plan=two_stage_plan(model_name, split, len(model), schedule), timeout=600.0,
                    schedule=schedule, chunks=2 if contender in ("2bw", "1f1b") else 1)
    for step, _ in enumerate(pipe.train([batch] * (warmup + measured), warmup + measured)):
        if step == warmup - 1:
            start = netcluster.snapshot()
    window = netcluster.since(start)
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
    # Both ranks each train the whole model at once, without a message: what two ranks of this
    # machine compute while both are busy (they share its memory bandwidth and caches).
    together: list[dict[str, Any]] = []
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
                "other_cores": harness.other_cores(ranks, sum(r["seconds"] for r in ranks) / WORLD)}

    def each(cluster: netcluster.Cluster, rate: str) -> None:
        for model in models:
            alone.append({"model": model, "rate": rate, "samples_per_s": BATCH * 8 / worker(
                "alone", model, 0, 3, 8)["seconds"]})
            harness.say(f"[{rate}] {model} one rank alone: {alone[-1]['samples_per_s']:.1f}/s")
            ranks = netcluster.run_workers(cluster, __file__, ["alone", model, 0, 3, 8], 600.0)
            together.append({"model": model, "rate": rate, "samples_per_s": sum(
                BATCH * 8 / r["seconds"] for r in ranks)})
            harness.say(f"[{rate}] {model} both ranks alone at once: "
                        f"{together[-1]['samples_per_s']:.1f}/s")
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
            "ranks_alone_together": together, "planner": views}


# ---- the report ----------------------------------------------------------------------------
def markdown(got: dict[str, Any], total_s: float) -> str:
    rows = got["rows"]
    ddp = {r["rate"]: f"{r['warmup']}+{r['measured']}" for r in rows if r["contender"] == "ddp"}
    lines = [*netcluster.header("pipedream_fast vs DistributedDataParallel on an emulated "
                                "2-machine cluster", got["links_mb_s"], total_s),
             "- A batch of 32 a step, SGD lr 0.01, one fixed synthetic batch. DDP: 16 per rank; "
             "`pipedream`: one microbatch; `2bw` and `1f1b`: two of 16, one update a step. "
             "DDP and the ranks alone (the limit) run with the CPU block cache a Pipeline holds "
             "(`Tuning.cpu_cache_mb`), so the ratios measure the parallelism, not the allocator.",
             "- Samples/s: after the warm-up (a pipeline: its last rank's clock); steps, warm-up "
             "+ measured: DDP " + ", ".join(f"{k} {v}" for k, v in ddp.items()) + "; pipelines "
             + next(f"{r['warmup']}+{r['measured']}" for r in rows if r["contender"] != "ddp")
             + ". MB/sample: both ranks' veth tx_bytes then (frames, headers, ACKs). Others: "
             f"cores other processes took; over {harness.DISTURBED}, rerun and the less disturbed "
             f"kept ({sum(r['tries'] > 1 for r in rows)} of {len(rows)} runs were).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += model_section(model, got, list(got["links_mb_s"]))
    return "\n".join(lines) + "\n"


def model_section(model: str, got: dict[str, Any], rates: list[str]) -> list[str]:
    built, split, balanced = MODELS[model](), got["splits"][model], got["splits"].get(
        f"{model} balanced")
    names, params = list(dict(built.named_children())), list(built.parameters())
    views = {v["rate"]: v for v in got["planner"] if v["model"] == model}
    doubled = {a["rate"]: WORLD * a["samples_per_s"] for a in got["one_rank_alone"]
               if a["model"] == model}
    limit = {a["rate"]: a["samples_per_s"] for a in got["ranks_alone_together"]
             if a["model"] == model}
    work_ms, profiled, cut = (views[rates[0]]["limit_ms"] * WORLD,
                              *(BATCH / views[rates[0]][k] * 1e3
                                for k in ("limit_ms", "split_limit_ms")))
    measured = []
    for rate in rates:
        view, here = views[rate], [r for r in got["rows"] if r["model"] == model
                                   and r["rate"] == rate]
        ddp, predicted = here[0], {"ddp": view["ddp_ms"], "pipedream": view["pipeline_ms"]}
        for index, row in enumerate(here):
            speed, size, who = row["samples_per_s"], row["bytes_per_sample"], row["contender"]
            measured.append([rate if index == 0 else "", LABELS[who], f"{speed:.1f}",
                             f"{speed / ddp['samples_per_s']:.2f}x", f"{size / 1e6:.3f}",
                             f"{size / ddp['bytes_per_sample']:.3f}x", f"{row['other_cores']:.2f}",
                             f"{BATCH / predicted[who] * 1e3:.1f}" if who in predicted else "",
                             f"{speed / limit[rate]:.2f}" if who.startswith("pipedream")
                             else "",
                             f"{speed / doubled[rate]:.2f} ({speed / profiled:.2f})"
                             if who.startswith("pipedream") else "",
                             view["choice"] if index == 0 else ""])
    return [f"## {MODEL_TITLES[model]}", "",
            f"{sum(p.numel() for p in params) / 1e6:.2f} M parameters "
            f"({sum(p.numel() * p.element_size() for p in params) / 1e6:.1f} MB); pipelines: "
            f"2 stages, stage 1 starts at block {split} ({names[split]})."
            + (f" The balanced cut of this profile starts stage 1 at block {balanced} "
               f"({names[balanced]}): `pipedream, balanced cut`." if balanced is not None
               else ""), "",
            "Predicted: the planner (PipeDream's dynamic program, topology `2x<rate/8 bytes/s>`, "
            "this machine's profile with 1 thread) for DDP (profiled at its per-rank batch of 16) "
            "and the measured 2-stage `pipedream`; its own plan: the planner's choice. Of the "
            "limit: of the balanced-pipeline limit, what a perfect 2-stage pipeline reaches "
            "with both ranks busy: both ranks training the whole model at once, without a "
            "message, measured just before each rate's contenders ("
            + ", ".join(f"{r} {v:.1f}" for r, v in limit.items()) + " samples/s together). "
            f"Of {WORLD} x alone: of twice one rank alone, the other rank idle ("
            + ", ".join(f"{r} {v:.1f}" for r, v in doubled.items()) + " samples/s): the two "
            "ranks of this one machine share its memory bandwidth and caches, which two "
            "machines would not, so that ratio counts the machine's slowdown under load as "
            f"the runtime's. In parentheses of the profile's: its work per batch ({work_ms:.0f}"
            f" ms) split evenly gives {profiled:.1f} samples/s, its best 2-stage cut {cut:.1f} "
            f"({cut / profiled:.2f} of it). Goal: `pipedream` at {LIMIT_GOAL} or more of the "
            "limit.", "",
            *harness.markdown_table(["link", "contender", "samples/s", "vs DDP", "MB/sample",
                                     "bytes vs DDP", "others (cores)", "predicted samples/s",
                                     "of the limit", f"of {WORLD} x alone (profile's)",
                                     "planner's choice"], measured, left=2), ""]


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
