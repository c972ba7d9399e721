"""pipedream_fast against DistributedDataParallel on an emulated 2-machine cluster.

Per link rate (bench/netcluster.py) and model: DDP (16 samples per rank), and Pipeline on 2
stages with `pipedream` (one 32-sample microbatch), `2bw` and `1f1b` (chunks=2); a global batch
of 32, SGD lr 0.01, one fixed synthetic batch. Models: `a` (build_cnn, cut at conv | fc) and
`convs` (few parameters, MiBs across any cut: data parallelism should win). Measured:
samples/s after the warm-up, veth bytes per sample, against the planner's predictions and the
balanced-pipeline limit. The reading under the tables in the results is written by hand.

    python bench/vs_ddp.py [--rates 10gbit,1gbit,100mbit] [--models a,convs] [--scale 1]
                           [--retries 1] [--out bench/results/vs_ddp.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, Profile, StagePlan
from pipedream_fast.models import build_cnn

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
import netcluster
from netcluster import WORLD

BATCH = 32
LR = 0.01
CONTENDERS = ("ddp", "pipedream", "2bw", "1f1b")
# `pipedream` on the profile's balanced cut, where that is not the fixed one: how close the
# runtime gets to the balanced-pipeline limit with the split the planner picks.
BALANCED = "pipedream-balanced"
CHUNKS = {"pipedream": 1, "2bw": 2, "1f1b": 2, BALANCED: 1}
LABELS = {"ddp": "DDP (gloo), 16 per rank", "pipedream": "pipedream_fast pipedream",
          "2bw": "pipedream_fast 2bw, chunks=2", "1f1b": "pipedream_fast 1f1b, chunks=2",
          BALANCED: "pipedream_fast pipedream, balanced cut"}
# (warm-up, measured) steps. DDP's step time grows with a slower link (140 MB a step for
# model A): its count shrinks with the rate; pipelines' hardly depends on it.
DDP_STEPS = {"10gbit": (3, 15), "1gbit": (2, 8), "100mbit": (1, 3)}
PIPELINE_STEPS = (3, 15)
RETRY_BUDGET_S = 11 * 60  # no retries after this
LIMIT_GOAL = 0.9  # of the balanced-pipeline limit, at every bandwidth
PARTS = {"compute": ("forward", "backward", "backward_input", "backward_weight"),
         "update": ("optimizer_step", "allreduce", "average"),
         "copies": ("snapshot", "release"),
         "sends": ("send_act", "send_grad"),
         "receives": ("recv_act", "recv_grad")}


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


def two_stage_plan(model_name: str, split: int, blocks: int, schedule: str) -> Plan:
    return Plan(model_name, BATCH, WORLD, schedule,
                [StagePlan(0, split, 1, (0,), 0.0), StagePlan(split, blocks, 1, (1,), 0.0)],
                1.0, 1.0)


# ---- ranks (run inside the namespaces) -----------------------------------------------------

def breakdown(events: list[Any], begin_s: float, end_s: float, batches: int) -> dict[str, float]:
    """ms per batch of [begin_s, end_s) (the trace's perf_counter clock) in each part of PARTS;
    `waiting`: a forward or backward's wait for its message, `other`: what no action covers."""
    parts = dict.fromkeys([*PARTS, "waiting", "other"], 0.0)
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
    """A contender's rank, or ("alone") the whole model in this process on the whole batch:
    its window after the warm-up (`netcluster.since`)."""
    from pipedream_fast.pipeline import Pipeline
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, steps, start = MODELS[model_name](), warmup + measured, netcluster.snapshot()
    if contender in ("ddp", "alone"):
        net, barrier = model, lambda: None
        x, y = fixed_batch()
        if contender == "ddp":  # this rank's half of the global batch
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
            net, barrier = DistributedDataParallel(model), dist.barrier
            mine = slice(dist.get_rank() * BATCH // WORLD, (dist.get_rank() + 1) * BATCH // WORLD)
            x, y = x[mine], y[mine]
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(steps):
            if step == warmup:
                barrier()
                start = netcluster.snapshot()
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        barrier()
        window = netcluster.since(start)
        if contender == "ddp":
            dist.destroy_process_group()
        return window
    schedule = "pipedream" if contender == BALANCED else contender
    pipe = Pipeline(model, nn.functional.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=LR),
                    plan=two_stage_plan(model_name, split, len(model), schedule),
                    schedule=schedule, chunks=CHUNKS[contender], timeout=600.0, trace=True)
    for step, _ in enumerate(pipe.train([fixed_batch()] * steps, steps)):
        if step == warmup - 1:
            start = netcluster.snapshot()
    window = netcluster.since(start)
    window["breakdown"] = breakdown(pipe.last_events, start["seconds"],
                                    start["seconds"] + window["seconds"], measured)
    pipe.close()
    return window


# ---- the planner's view --------------------------------------------------------------------

def profile(model_name: str, batch: int = BATCH) -> Profile:
    from pipedream_fast.profiler import profile_model

    torch.set_num_threads(1)  # as each rank runs
    torch.manual_seed(0)
    return profile_model(MODELS[model_name](), fixed_batch()[0][:batch], batch, progress=False,
                         model_name=model_name)


def planner_view(prof: Profile, per_replica: Profile, rate_bits: int,
                 split: int) -> dict[str, Any]:
    """The dynamic program's plan for 2 workers at this rate and its time per batch; the
    predicted time of the bench's 2-stage pipeline (cut before `split`) and of DDP (the
    data-parallel plan from a profile at its per-rank batch); with free links, the
    balanced-pipeline limit (all the work split evenly) and the best 2-stage cut's slower
    stage."""
    from pipedream_fast.planner import evaluate_plan, make_plan
    from pipedream_fast.topology import Topology

    topology = Topology.parse(f"{WORLD}x{rate_bits / 8:g}")
    free = Topology.parse(f"{WORLD}x1e18")  # links that cost nothing
    chosen = make_plan(prof, topology, schedule="pipedream")
    ddp = make_plan(per_replica, topology, schedule="1f1b", strategy="data-parallel",
                    chunks=WORLD)
    choice = "pipeline, blocks " + " / ".join(
        f"{s.start}-{s.stop - 1}" + (f" x{s.replicas}" if s.replicas > 1 else "")
        for s in chosen.stages)
    if len(chosen.stages) == 1:
        choice = "data parallel" if chosen.stages[0].replicas > 1 else "one worker"
    return {"choice": choice, "chosen_ms": chosen.bottleneck_ms,
            "ddp_ms": ddp.bottleneck_ms * (BATCH // per_replica.batch_size),
            "pipeline_ms": evaluate_plan(two_stage_plan(prof.model, split, len(prof.blocks),
                                                        "pipedream"), prof, topology).bottleneck_ms,
            "pipeline_split": split,
            "limit_ms": make_plan(prof, Topology.parse("1x1e18")).bottleneck_ms / WORLD,
            "split_limit_ms": make_plan(prof, free, straight=True).bottleneck_ms}


# ---- the harness ---------------------------------------------------------------------------

def run_contender(cluster: netcluster.Cluster, model: str, contender: str, split: int,
                  rate: str, scale: float) -> dict[str, Any]:
    warmup, measured = DDP_STEPS.get(rate, (2, 5)) if contender == "ddp" else PIPELINE_STEPS
    measured = max(1, round(measured * scale))
    began = time.monotonic()
    windows = netcluster.run_workers(cluster, __file__,
                                     [contender, model, split, warmup, measured], 600.0)
    samples = BATCH * measured
    return {"model": model, "rate": rate, "contender": contender,
            "samples_per_s": samples / windows[-1]["seconds"],  # the last rank's clock
            "bytes_per_sample": sum(w["tx_bytes"] for w in windows) / samples,
            "warmup": warmup, "measured": measured, "wall_s": time.monotonic() - began,
            "other_cores": harness.other_cores(windows,
                                               sum(w["seconds"] for w in windows) / WORLD),
            "tries": 1, "breakdowns": [w["breakdown"] for w in windows if "breakdown" in w]}


def run_all(models: list[str], rates: list[str], scale: float, retries: int) -> dict[str, Any]:
    """Every model and contender at every rate; the planner's views, one rank alone."""
    from pipedream_fast.planner.baselines import balanced_partition

    profiles = {m: (profile(m), profile(m, BATCH // WORLD)) for m in models}
    # the first block of stage 1 when 2 stages are balanced by profiled compute
    balanced = {m: balanced_partition([b.forward_ms + b.backward_ms
                                       for b in profiles[m][0].blocks], 2)[1] for m in models}
    splits = {m: MODEL_A_SPLIT if m == "a" else balanced[m] for m in models}
    views = {(m, r): planner_view(*profiles[m], netcluster.parse_rate(r), splits[m])
             for m in models for r in rates}
    rows: list[dict[str, Any]] = []
    alone: dict[tuple[str, str], float] = {}  # one rank's samples/s, measured next to the rest
    deadline = time.monotonic() + RETRY_BUDGET_S

    def each(cluster: netcluster.Cluster, rate: str) -> None:
        for model in models:
            alone[(model, rate)] = BATCH * 8 / worker("alone", model, 0, 3, 8)["seconds"]
            harness.say(f"[{rate}] {model:5s} one rank alone, 1 thread: "
                        f"{alone[(model, rate)]:.1f} samples/s")
            extra = (BALANCED,) if balanced[model] != splits[model] else ()
            for contender in CONTENDERS + extra:
                split = balanced[model] if contender == BALANCED else splits[model]
                row, rest = harness.least_disturbed(
                    functools.partial(run_contender, cluster, model, contender, split, rate,
                                      scale), lambda r: r["other_cores"], retries, harness.say,
                    deadline)
                rows.append({**row, "tries": 1 + len(rest)})
                harness.say(f"[{rate}] {model:5s} {LABELS[contender]:40s} "
                            f"{row['samples_per_s']:7.1f} samples/s "
                            f"{row['bytes_per_sample'] / 1e6:8.3f} MB/sample ({row['warmup']}+"
                            f"{row['measured']} steps, {row['wall_s']:.0f} s, others took "
                            f"{row['other_cores']:.2f} cores)")

    links = netcluster.sweep(rates, each)
    splits.update({f"{m} balanced": balanced[m] for m in models if balanced[m] != splits[m]})
    return {"rows": rows, "links_mb_s": links, "splits": splits,
            "one_rank_alone": [{"model": m, "rate": r, "samples_per_s": v}
                               for (m, r), v in alone.items()],
            "planner": [{"model": m, "rate": r, **v} for (m, r), v in views.items()]}


# ---- the report ----------------------------------------------------------------------------

def markdown(got: dict[str, Any], total_s: float) -> str:
    rows, rates = got["rows"], list(got["links_mb_s"])

    def steps(contender: str, rate: str) -> str:
        return "/".join(sorted({f"{r['warmup']}+{r['measured']}" for r in rows
                                if r["rate"] == rate and r["contender"] == contender})) or "-"

    lines = ["# pipedream_fast vs DistributedDataParallel on an emulated 2-machine cluster", "",
             f"Command: `{harness.command()}`", "",
             harness.machine_line(harness.machine_info(), total_s), "",
             netcluster.cluster_note(got["links_mb_s"]),
             "- Same work for every contender: a global batch of 32 per step, SGD lr 0.01, one "
             "fixed synthetic batch. DDP: 16 per rank. `pipedream`: one microbatch. `2bw` and "
             "`1f1b`: chunks=2 (two microbatches of 16, one update per step).",
             "- Samples/s: after the warm-up steps (a pipeline: its last rank's clock). Steps, "
             "warm-up + measured: DDP "
             + ", ".join(f"{r} {steps('ddp', r)}" for r in rates)
             + f"; pipelines {steps('pipedream', rates[0])} at every rate.",
             "- MB/sample: both ranks' veth tx_bytes over that window, per sample (frames, "
             "headers and ACKs included).",
             f"- Others: the cores other processes took meanwhile; over {harness.DISTURBED}, the "
             f"run was rerun and the less disturbed kept ({sum(r['tries'] > 1 for r in rows)} "
             f"of {len(rows)} runs were).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += model_section(model, got, rates)
    return "\n".join(lines) + "\n"


def model_section(model: str, got: dict[str, Any], rates: list[str]) -> list[str]:
    built, splits = MODELS[model](), got["splits"]
    names, params = list(dict(built.named_children())), list(built.parameters())
    views = {v["rate"]: v for v in got["planner"] if v["model"] == model}
    alone = {a["rate"]: a["samples_per_s"] for a in got["one_rank_alone"] if a["model"] == model}
    balanced = splits.get(f"{model} balanced")
    measured, planned, shares, where = [], [], [], []
    parts = ("compute", "waiting", "receives", "sends", "update", "copies", "other")
    view0 = views[rates[0]]
    profiled = BATCH / view0["limit_ms"] * 1e3
    cut = BATCH / view0["split_limit_ms"] * 1e3
    for rate in rates:
        here = [r for r in got["rows"] if r["model"] == model and r["rate"] == rate]
        ddp = next(r for r in here if r["contender"] == "ddp")
        best = max(here[1:], key=lambda r: r["samples_per_s"])
        for index, row in enumerate(here):
            speed, size = row["samples_per_s"], row["bytes_per_sample"]
            measured.append([rate if index == 0 else "", LABELS[row["contender"]], f"{speed:.1f}",
                             f"{speed / ddp['samples_per_s']:.2f}x", f"{size / 1e6:.3f}",
                             f"{size / ddp['bytes_per_sample']:.3f}x", f"{row['other_cores']:.2f}",
                             views[rate]["choice"] if index == 0 else ""])
            if row["contender"] in ("pipedream", BALANCED):
                limit = WORLD * alone[rate]
                shares.append([rate, LABELS[row["contender"]], f"{speed:.1f}", f"{limit:.1f}",
                               f"{speed / limit:.2f}", f"{speed / profiled:.2f}",
                               "met" if speed / limit >= LIMIT_GOAL else "missed"])
                where += [[rate if rank == 0 else "", LABELS[row["contender"]] if rank == 0
                           else "", rank, *(f"{p[k]:.0f}" for k in parts)]
                          for rank, p in enumerate(row["breakdowns"])]
        planned.append([rate, views[rate]["choice"], f"{views[rate]['ddp_ms']:.0f}",
                        f"{BATCH / ddp['samples_per_s'] * 1e3:.0f}",
                        f"{views[rate]['pipeline_ms']:.0f} ({views[rate]['pipeline_split']})",
                        f"{BATCH / best['samples_per_s'] * 1e3:.0f} ({best['contender']})"])
    return [f"## {MODEL_TITLES[model]}", "",
            f"{sum(p.numel() for p in params) / 1e6:.2f} M parameters "
            f"({sum(p.numel() * p.element_size() for p in params) / 1e6:.1f} MB); pipelines: "
            f"2 stages, stage 1 starts at block {splits[model]} ({names[splits[model]]})."
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
            f"Against the balanced-pipeline limit, measured: {WORLD} x one rank alone (the whole "
            f"model, same batch and step, just before the contenders of each rate). From the "
            f"profile: its work per batch ({view0['limit_ms'] * WORLD:.0f} ms) split evenly "
            f"gives {profiled:.1f} samples/s, its best 2-stage cut {cut:.1f} ("
            f"{cut / profiled:.2f} of it). Goal: `pipedream` at {LIMIT_GOAL} of it or more.", "",
            *harness.markdown_table(["link", "contender", "samples/s", "limit (measured)",
                                     "of it", "of the profile's", "goal"], shares, left=2), "",
            "Where each rank's time goes under `pipedream`, ms per batch, from the runtime's "
            "trace: compute (less its waits), waiting (for a message), receives and sends "
            "(posting them), update, copies (weight versions), other (data feed, Python).", "",
            *harness.markdown_table(["link", "contender", "rank", *parts], where, left=2), ""]


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:  # a rank: contender model split warmup measured
        contender, model, *numbers = sys.argv[2:]
        harness.print_result(worker(contender, model, *map(int, numbers)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=netcluster.rates_arg, default="10gbit,1gbit,100mbit",
                        help="comma-separated link rates (default 10gbit,1gbit,100mbit)")
    parser.add_argument("--models", type=lambda s: s.split(","), default="a,convs",
                        help=f"comma-separated, among {', '.join(MODELS)} (default a,convs)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every measured step count (default 1)")
    parser.add_argument("--retries", type=int, default=1, metavar="N",
                        help=f"run a contender disturbed by other processes (more than "
                             f"{harness.DISTURBED} cores taken) again up to N times (default 1)")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()
    if not set(args.models) <= set(MODELS):
        parser.error(f"unknown model in {args.models}; choose among {', '.join(MODELS)}")
    if not netcluster.available()[0]:
        print(f"vs_ddp: cannot emulate a cluster here: {netcluster.available()[1]}",
              file=sys.stderr)
        return 2
    began = time.monotonic()
    got = run_all(args.models, args.rates, args.scale, args.retries)
    harness.emit(args.out, markdown(got, time.monotonic() - began), got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
