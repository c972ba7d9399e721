"""pipedream_fast against DistributedDataParallel on an emulated 2-machine cluster.

Two ranks in network namespaces (bench/netcluster.py), the link shaped to 10gbit, 1gbit or
100mbit each way; one torch thread per rank, gloo. Per model and rate, one after the other: DDP
(16 samples per rank), and Pipeline on 2 stages with `pipedream` (one 32-sample microbatch),
`2bw` and `1f1b` (chunks=2); all on a global batch of 32 per step, SGD lr 0.01, a fixed
synthetic batch. Models: `a` (build_cnn, 35 M parameters; cut at conv | fc, block 6, where
512 KiB cross per step) and `convs` (5 convolutions, 0.13 M parameters but 4-8 MiB across any
cut; cut where the profile balances: data parallelism should win). Measured: steady-state
samples/s (the last rank's clock after the warm-up) and both veths' tx_bytes per sample; the
planner's choice and predictions for the topology "2x<rate in bytes/s>"; the CPU other
processes took (a run disturbed beyond DISTURBED cores runs again, --retries).

    python bench/vs_ddp.py [--rates 10gbit,1gbit,100mbit] [--models a,convs] [--scale 1]
                           [--retries 1] [--out bench/results/vs_ddp.md]

The reading under the tables in bench/results/vs_ddp.md is written by hand after a run.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, Profile, StagePlan
from pipedream_fast.models import build_cnn

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
import netcluster
from harness import DISTURBED

BATCH = 32
WORLD = 2
LR = 0.01
DEFAULT_RATES = ("10gbit", "1gbit", "100mbit")
CONTENDERS = ("ddp", "pipedream", "2bw", "1f1b")
# `pipedream` on the cut the profile balances best, where that is not the fixed conv | fc cut:
# how close the runtime gets to the balanced-pipeline limit with the split the planner picks.
BALANCED = "pipedream-balanced"
CHUNKS = {"pipedream": 1, "2bw": 2, "1f1b": 2, BALANCED: 1}

# (warm-up, measured) steps. DDP's step time grows with a slower link (140 MB a step for
# model A): its count shrinks with the rate; pipelines' hardly depends on it.
DDP_STEPS = {"10gbit": (3, 15), "1gbit": (2, 8), "100mbit": (1, 3)}
DDP_STEPS_OTHER_RATES = (2, 5)
PIPELINE_STEPS = (3, 15)
TIMEOUT_S = {"10gbit": 240.0, "1gbit": 300.0, "100mbit": 600.0}


# ---- models --------------------------------------------------------------------------------

def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())


def build_convs() -> nn.Sequential:
    """Conv-only model with few parameters: 5 convolutions at 32x32, average pool, tiny head."""
    widths = [(3, 32), (32, 64), (64, 64), (64, 64), (64, 64)]
    blocks: dict[str, nn.Module] = {f"conv{i + 1}": _conv(cin, cout)
                                    for i, (cin, cout) in enumerate(widths)}
    blocks["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return nn.Sequential(OrderedDict(blocks))


MODELS = {"a": build_cnn, "convs": build_convs}
MODEL_TITLES = {"a": "model A (build_cnn)", "convs": "convs (conv-only, few parameters)"}
MODEL_A_SPLIT = 6  # conv | fc, as bench/vs_pipelining.py --set model_a


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---- ranks (run inside the namespaces) -----------------------------------------------------

def own_tx_bytes() -> int:
    """Bytes this rank's veth has sent (0 outside an emulated cluster)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return 0
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


@dataclass
class Snapshot:
    time_s: float
    tx_bytes: int
    busy_s: float
    cpu_s: float

    @classmethod
    def now(cls) -> Snapshot:
        return cls(time.perf_counter(), own_tx_bytes(), harness.machine_busy_s(),
                   time.process_time())


@dataclass
class Window:
    """What one rank measured between the end of the warm-up and the end of the run: its
    seconds, samples and bytes sent, the machine's busy CPU seconds and its own CPU seconds
    (the difference is what other processes took)."""

    seconds: float
    samples: int
    tx_bytes: int
    busy_s: float
    cpu_s: float
    breakdown: dict[str, float] | None = None  # a pipeline rank's ms per batch (see below)

    @classmethod
    def since(cls, start: Snapshot, samples: int) -> Window:
        end = Snapshot.now()
        return cls(end.time_s - start.time_s, samples, end.tx_bytes - start.tx_bytes,
                   end.busy_s - start.busy_s, end.cpu_s - start.cpu_s)


# Where a pipeline rank's time goes, from its trace: the action kinds of each part.
PARTS = {"compute": ("forward", "backward", "backward_input", "backward_weight"),
         "update": ("optimizer_step", "allreduce", "average"),
         "copies": ("snapshot", "release"),
         "sends": ("send_act", "send_grad"),
         "receives": ("recv_act", "recv_grad")}


def breakdown(events: list[Any], begin_s: float, end_s: float, batches: int) -> dict[str, float]:
    """ms per batch of the window [begin_s, end_s) (perf_counter seconds, the clock of the
    runtime's trace) in each part of PARTS; `waiting` is a forward or backward's wait for its
    message, `other` what no action covers (the data feed, Python between actions)."""
    parts = dict.fromkeys([*PARTS, "waiting", "other"], 0.0)
    part_of = {kind: part for part, kinds in PARTS.items() for kind in kinds}
    for event in events:
        if not begin_s * 1e3 <= event.start_ms < end_s * 1e3:
            continue
        waited = float(event.args.get("waited_ms", 0.0))
        parts[part_of.get(event.kind, "other")] += event.duration_ms - waited
        parts["waiting"] += waited
    parts["other"] += (end_s - begin_s) * 1e3 - sum(parts.values())
    return {part: ms / batches for part, ms in parts.items()}


def one_rank_rate(model_name: str, warmup: int = 3, measured: int = 8) -> float:
    """Samples/s of the whole model trained in this process with one thread, the same batch
    and SGD step as every contender: twice it is the balanced-pipeline limit of 2 ranks.
    Measured next to the contenders, since this machine's speed drifts between runs."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch()
    start = 0.0
    for step in range(warmup + measured):
        if step == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return BATCH * measured / (time.perf_counter() - start)


def ddp_rank(model_name: str, warmup: int, measured: int) -> Window:
    """DistributedDataParallel, this rank's half of the global batch of 32 per step."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    model = DistributedDataParallel(MODELS[model_name]())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch()
    share = BATCH // WORLD
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    start = Snapshot.now()
    for step in range(warmup + measured):
        if step == warmup:
            dist.barrier()
            start = Snapshot.now()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    window = Window.since(start, BATCH * measured)
    dist.destroy_process_group()
    return window


def two_stage_plan(model_name: str, split: int, blocks: int, schedule: str) -> Plan:
    return Plan(model_name, BATCH, WORLD, schedule,
                [StagePlan(0, split, 1, (0,), 0.0), StagePlan(split, blocks, 1, (1,), 0.0)],
                1.0, 1.0)


def pipeline_rank(model_name: str, schedule: str, split: int, warmup: int,
                  measured: int) -> Window:
    """pipedream_fast's Pipeline on two stages cut before block `split`."""
    from pipedream_fast.pipeline import Pipeline

    model = MODELS[model_name]()
    plan = two_stage_plan(model_name, split, len(model), schedule)
    pipe = Pipeline(model, nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=LR), plan=plan, schedule=schedule,
                    chunks=CHUNKS[schedule], timeout=600.0, trace=True)
    steps = warmup + measured
    start = Snapshot.now()
    for step, _ in enumerate(pipe.train([fixed_batch()] * steps, steps)):
        if step == warmup - 1:
            start = Snapshot.now()
    window = Window.since(start, BATCH * measured)
    window.breakdown = breakdown(pipe.last_events, start.time_s, start.time_s + window.seconds,
                                 measured)
    pipe.close()
    return window


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.worker == "ddp":
        window = ddp_rank(args.model, args.warmup, args.measured)
    else:
        schedule = "pipedream" if args.worker == BALANCED else args.worker
        window = pipeline_rank(args.model, schedule, args.split, args.warmup, args.measured)
    harness.print_result(window.__dict__)
    return 0


# ---- the planner's view --------------------------------------------------------------------

@dataclass
class PlannerView:
    choice: str           # "data parallel" or "pipeline: ..."
    chosen_ms: float      # its predicted time per batch of 32
    ddp_ms: float         # DDP at 16 per rank, from a profile at that batch
    pipeline_ms: float    # the 2-stage pipeline the bench runs
    pipeline_split: int
    limit_ms: float       # the balanced-pipeline limit: all the work split evenly, free links
    split_limit_ms: float  # the best 2-stage cut's slower stage, free links


def profile(model_name: str, batch: int = BATCH) -> Profile:
    from pipedream_fast.profiler import profile_model

    torch.set_num_threads(1)  # as each rank runs
    torch.manual_seed(0)
    x, _ = fixed_batch()
    return profile_model(MODELS[model_name](), x[:batch], batch, progress=False,
                         model_name=model_name)


def balanced_split(prof: Profile) -> int:
    """First block of stage 1 when 2 stages are balanced by profiled compute."""
    from pipedream_fast.planner.baselines import balanced_partition

    return balanced_partition([b.forward_ms + b.backward_ms for b in prof.blocks], 2)[1]


def describe_plan(plan: Plan) -> str:
    if len(plan.stages) == 1:
        return "data parallel" if plan.stages[0].replicas > 1 else "one worker"
    parts = [f"{s.start}-{s.stop - 1}" + (f" x{s.replicas}" if s.replicas > 1 else "")
             for s in plan.stages]
    return f"pipeline, blocks {' / '.join(parts)}"


def planner_view(prof: Profile, per_replica: Profile, rate_bits: int, split: int) -> PlannerView:
    """The dynamic program's plan for 2 workers at this rate, the predicted time of the 2-stage
    pipeline the bench runs (cut before block `split`), and of DDP: the data-parallel plan
    costed from a profile at DDP's per-rank batch (its microbatch), 16 samples per replica."""
    from pipedream_fast.planner import evaluate_plan, make_plan
    from pipedream_fast.topology import Topology

    topology = Topology.parse(f"{WORLD}x{rate_bits / 8:g}")
    chosen = make_plan(prof, topology, schedule="pipedream")
    ours = evaluate_plan(two_stage_plan(prof.model, split, len(prof.blocks), "pipedream"), prof,
                         topology)
    ddp = make_plan(per_replica, topology, schedule="1f1b", strategy="data-parallel",
                    chunks=WORLD)  # one microbatch per replica per step, as DDP runs
    batches = BATCH // per_replica.batch_size  # microbatches of the profile per batch of 32
    free = Topology.parse(f"{WORLD}x1e18")  # links that cost nothing: compute and updates only
    work = make_plan(prof, Topology.parse("1x1e18"), schedule="pipedream").bottleneck_ms
    best_cut = make_plan(prof, free, schedule="pipedream", straight=True).bottleneck_ms
    return PlannerView(describe_plan(chosen), chosen.bottleneck_ms, ddp.bottleneck_ms * batches,
                       ours.bottleneck_ms, split, work / WORLD, best_cut)


# ---- the harness ---------------------------------------------------------------------------

@dataclass
class Measurement:
    model: str
    rate: str
    contender: str
    samples_per_s: float
    bytes_per_sample: float
    warmup: int
    measured: int
    wall_s: float
    other_cores: float     # CPU other processes took during the window, in cores
    tries: int = 1
    breakdowns: list[dict[str, float]] = field(default_factory=list)  # per rank, pipelines


def contender_label(name: str) -> str:
    if name == "ddp":
        return "DDP (gloo), 16 per rank"
    if name == BALANCED:
        return "pipedream_fast pipedream, balanced cut"
    chunks = CHUNKS[name]
    return f"pipedream_fast {name}" + (f", chunks={chunks}" if chunks > 1 else "")


def steps_for(contender: str, rate: str, scale: float) -> tuple[int, int]:
    warmup, measured = (DDP_STEPS.get(rate, DDP_STEPS_OTHER_RATES) if contender == "ddp"
                        else PIPELINE_STEPS)
    return warmup, max(1, round(measured * scale))


def run_contender(cluster: netcluster.Cluster, model: str, contender: str, split: int,
                  rate: str, scale: float) -> Measurement:
    warmup, measured = steps_for(contender, rate, scale)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--model", model,
            "--split", str(split), "--warmup", str(warmup), "--measured", str(measured)]
    began = time.monotonic()
    windows = [Window(**w) for w in harness.cluster_results(cluster, argv,
                                                             TIMEOUT_S.get(rate, 600.0))]
    last = windows[-1]
    return Measurement(model, rate, contender, last.samples / last.seconds,
                       sum(w.tx_bytes for w in windows) / last.samples,
                       warmup, measured, time.monotonic() - began,
                       harness.other_cores([w.__dict__ for w in windows],
                                           sum(w.seconds for w in windows) / len(windows)),
                       breakdowns=[w.breakdown for w in windows if w.breakdown is not None])


def measure(cluster: netcluster.Cluster, model: str, contender: str, split: int, rate: str,
            scale: float, retries: int, deadline: float) -> Measurement:
    """A contender's least disturbed run (`harness.least_disturbed`, no retry past
    `deadline`)."""
    best, rest = harness.least_disturbed(
        lambda: run_contender(cluster, model, contender, split, rate, scale),
        lambda m: m.other_cores, retries, harness.say, deadline)
    best.tries = 1 + len(rest)
    return best


def link_check(cluster: netcluster.Cluster) -> float:
    """Payload MB/s of one TCP stream rank 1 -> rank 0, to show what the link really carries."""
    nbytes = 8 << 20 if (cluster.rate_bits or 10**10) <= 10**8 else 64 << 20
    return netcluster.measure_throughput(cluster, nbytes).payload_bytes_per_s / 1e6


def run_all(models: list[str], rates: list[str], scale: float, retries: int, budget_s: float
            ) -> tuple[list[Measurement], dict[tuple[str, str], PlannerView], dict[str, int],
                       dict[str, float], dict[tuple[str, str], float]]:
    profiles = {m: profile(m) for m in models}
    per_replica = {m: profile(m, BATCH // WORLD) for m in models}
    balanced = {m: balanced_split(profiles[m]) for m in models}
    splits = {m: MODEL_A_SPLIT if m == "a" else balanced[m] for m in models}
    views = {(m, r): planner_view(profiles[m], per_replica[m], netcluster.parse_rate(r) or 10**12,
                                  splits[m])
             for m in models for r in rates}
    rows: list[Measurement] = []
    links: dict[str, float] = {}
    alone: dict[tuple[str, str], float] = {}  # one rank's samples/s, measured per rate
    deadline = time.monotonic() + budget_s  # no more retries after it
    for rate in rates:
        with netcluster.Cluster(world=WORLD, rate=rate) as cluster:
            links[rate] = link_check(cluster)
            print(f"[{rate}] link check: one TCP stream carries {links[rate]:.1f} MB/s",
                  flush=True)
            for model in models:
                alone[(model, rate)] = one_rank_rate(model)
                print(f"[{rate}] {model:5s} one rank alone, 1 thread: "
                      f"{alone[(model, rate)]:.1f} samples/s", flush=True)
                extra = (BALANCED,) if balanced[model] != splits[model] else ()
                for contender in CONTENDERS + extra:
                    split = balanced[model] if contender == BALANCED else splits[model]
                    row = measure(cluster, model, contender, split, rate, scale, retries,
                                  deadline)
                    rows.append(row)
                    print(f"[{rate}] {model:5s} {contender_label(contender):40s} "
                          f"{row.samples_per_s:7.1f} samples/s "
                          f"{row.bytes_per_sample / 1e6:8.3f} MB/sample "
                          f"({row.warmup}+{row.measured} steps, {row.wall_s:.0f} s, others took "
                          f"{row.other_cores:.2f} cores)", flush=True)
    splits.update({f"{m} balanced": balanced[m] for m in models if balanced[m] != splits[m]})
    return rows, views, splits, links, alone


# ---- the report ----------------------------------------------------------------------------

def markdown(rows: list[Measurement], views: dict[tuple[str, str], PlannerView],
             splits: dict[str, int], links: dict[str, float],
             alone: dict[tuple[str, str], float], command: str, total_s: float) -> str:
    rates = list(dict.fromkeys(r.rate for r in rows))
    lines = ["# pipedream_fast vs DistributedDataParallel on an emulated 2-machine cluster", "",
             f"Command: `{command}`", "",
             harness.machine_line(harness.machine_info(), total_s), "",
             "- Cluster: 2 ranks, each in a network namespace, joined through a bridge by veth "
             "links shaped with `tc tbf` both ways (bench/netcluster.py); one torch thread per "
             "rank, gloo. Link check, one TCP stream's payload rate: "
             + ", ".join(f"{rate} {links[rate]:.1f} MB/s" for rate in rates) + ".",
             "- Same work for every contender: a global batch of 32 samples per step, SGD lr "
             "0.01, one fixed synthetic batch. DDP: 16 samples per rank. `pipedream`: one "
             "32-sample microbatch per step. `2bw` and `1f1b`: chunks=2 (two 16-sample "
             "microbatches, one update per step).",
             "- Samples/s: steady state, the clock starts after the warm-up steps (for a "
             "pipeline, its last rank's clock). Steps, warm-up + measured: DDP "
             + ", ".join(f"{r} {steps_text(rows, r, 'ddp')}" for r in rates)
             + f"; pipelines {steps_text(rows, rates[0], 'pipedream')} at every rate.",
             "- MB/sample: both ranks' veth tx_bytes over that window, per sample (frames as "
             "the kernel counts them, headers and ACKs included).",
             "- Others: the CPU that processes other than the two ranks took during the window, "
             f"in cores (the machine has {os.cpu_count()}). A run where others took more than "
             f"{DISTURBED} cores was run again and the less disturbed run kept "
             f"({sum(r.tries > 1 for r in rows)} of {len(rows)} runs were).", ""]
    for model in dict.fromkeys(r.model for r in rows):
        lines += model_section(model, rows, views, splits, rates, alone)
    return "\n".join(lines) + "\n"


def steps_text(rows: list[Measurement], rate: str, contender: str) -> str:
    found = sorted({(r.warmup, r.measured) for r in rows
                    if r.rate == rate and r.contender == contender})
    return "/".join(f"{w}+{m}" for w, m in found) or "-"


def model_section(model: str, rows: list[Measurement], views: dict[tuple[str, str], PlannerView],
                  splits: dict[str, int], rates: list[str],
                  alone: dict[tuple[str, str], float]) -> list[str]:
    built = MODELS[model]()
    names = list(dict(built.named_children()))
    balanced = splits.get(f"{model} balanced")
    also = (f" The balanced cut of this profile starts stage 1 at block {balanced} "
            f"({names[balanced]}): `pipedream, balanced cut`." if balanced is not None else "")
    mine = [r for r in rows if r.model == model]
    measured, planned = [], []
    for rate in rates:
        here = [r for r in mine if r.rate == rate]
        ddp = next((r for r in here if r.contender == "ddp"), None)
        view = views[(model, rate)]
        for index, row in enumerate(here):
            measured.append([
                rate if index == 0 else "", contender_label(row.contender),
                f"{row.samples_per_s:.1f}",
                f"{row.samples_per_s / ddp.samples_per_s:.2f}x" if ddp else "-",
                f"{row.bytes_per_sample / 1e6:.3f}",
                f"{row.bytes_per_sample / ddp.bytes_per_sample:.3f}x" if ddp else "-",
                f"{row.other_cores:.2f}", view.choice if index == 0 else ""])
        pipes = [r for r in here if r.contender != "ddp"]
        best = max(pipes, key=lambda r: r.samples_per_s) if pipes else None
        planned.append([rate, view.choice, f"{view.ddp_ms:.0f}",
                        ms_per_batch(ddp) if ddp else "-",
                        f"{view.pipeline_ms:.0f} ({view.pipeline_split})",
                        f"{ms_per_batch(best)} ({best.contender})" if best else "-"])
    return [f"## {MODEL_TITLES[model]}", "",
            f"{sum(p.numel() for p in built.parameters()) / 1e6:.2f} M parameters "
            f"({parameter_bytes(built) / 1e6:.1f} MB); pipelines: 2 stages, stage 1 starts at "
            f"block {splits[model]} ({names[splits[model]]}).{also}", "",
            *harness.markdown_table(["link", "contender", "samples/s", "vs DDP", "MB/sample",
                                     "bytes vs DDP", "others (cores)", "planner's choice"],
                                    measured, left=2), "",
            "The planner (PipeDream's dynamic program, schedule pipedream, topology "
            "`2x<rate/8 bytes/s>`, profile of this machine with 1 thread) against the "
            "measurements, in ms per batch of 32. DDP is predicted as the planner's data-"
            "parallel plan from a profile at its per-rank batch of 16; the planner's own "
            "choice is made at the pipeline's microbatch of 32:", "",
            *harness.markdown_table(["link", "planner picks", "predicted: DDP, 16 per rank",
                                     "measured: DDP", "predicted: the measured 2-stage pipeline "
                                     "(split)", "measured: best pipeline"], planned, left=2), "",
            *limit_section(model, mine, views[(model, rates[0])], alone)]


LIMIT_GOAL = 0.9  # of the balanced-pipeline limit, at every bandwidth


def limit_section(model: str, rows: list[Measurement], view: PlannerView,
                  alone: dict[tuple[str, str], float]) -> list[str]:
    """`pipedream` against the machine's limit, and where each rank's time went."""
    profiled, cut = BATCH / view.limit_ms * 1e3, BATCH / view.split_limit_ms * 1e3
    runs = [r for r in rows if r.contender in ("pipedream", BALANCED)]
    shares = []
    for row in runs:
        limit = WORLD * alone[(model, row.rate)]
        share = row.samples_per_s / limit
        shares.append([row.rate, contender_label(row.contender), f"{row.samples_per_s:.1f}",
                       f"{limit:.1f}", f"{share:.2f}", f"{row.samples_per_s / profiled:.2f}",
                       "met" if share >= LIMIT_GOAL else "missed"])
    parts = ("compute", "waiting", "receives", "sends", "update", "copies", "other")
    where = [[row.rate if rank == 0 else "", contender_label(row.contender) if rank == 0 else "",
              rank, *(f"{p[k]:.0f}" for k in parts)]
             for row in runs for rank, p in enumerate(row.breakdowns)]
    return [f"Against the machine's limit. Measured: {WORLD} x what one rank does alone with "
            f"one thread (the whole model, same batch and SGD step), measured at each rate "
            f"just before its contenders: the balanced-pipeline limit, every rank busy all the "
            f"time on free links. From the profile: all its work per batch of 32 "
            f"({view.limit_ms * WORLD:.0f} ms) split evenly gives {profiled:.1f} samples/s, "
            f"and its best 2-stage cut caps a real pipeline at {cut:.1f} "
            f"({cut / profiled:.2f} of it). Goal: `pipedream` at least {LIMIT_GOAL} of the "
            f"measured limit at every bandwidth.", "",
            *harness.markdown_table(["link", "contender", "samples/s", "limit (measured)",
                                     "of it", "of the profile's", "goal"], shares, left=2), "",
            "Where each rank's time goes under `pipedream`, ms per batch, from the runtime's "
            "trace over the measured window: compute (less its waits), waiting (for a "
            "message), receives and sends (posting them), update (optimizer step), copies "
            "(weight versions), other (the data feed, Python between actions).", "",
            *harness.markdown_table(["link", "contender", "rank", *parts], where, left=2), ""]


def ms_per_batch(row: Measurement) -> str:
    return f"{BATCH / row.samples_per_s * 1e3:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(DEFAULT_RATES),
                        help="comma-separated link rates (default 10gbit,1gbit,100mbit)")
    parser.add_argument("--models", default="a,convs",
                        help=f"comma-separated models among {', '.join(MODELS)} (default a,convs)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every measured step count (default 1)")
    parser.add_argument("--retries", type=int, default=1, choices=range(0, 100), metavar="N",
                        help=f"runs again a contender disturbed by other processes (more than "
                             f"{DISTURBED} cores taken) up to this many times (default 1)")
    parser.add_argument("--retry-budget-min", type=float, default=11.0,
                        help="no retries once this many minutes have passed (default 11)")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--worker", choices=CONTENDERS + (BALANCED,), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--split", type=int, default=MODEL_A_SPLIT, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--measured", type=int, default=10, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for rate in rates:
        try:
            if netcluster.parse_rate(rate) is None:
                parser.error("every rate must be finite here (the planner needs a bandwidth)")
        except ValueError as err:
            parser.error(str(err))
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"unknown model(s) {unknown}; choose among {', '.join(MODELS)}")
    if not (args.scale > 0 and math.isfinite(args.scale)):
        parser.error(f"--scale must be a positive number, got {args.scale}")
    ok, why = netcluster.available()
    if not ok:
        print(f"vs_ddp: cannot emulate a cluster here: {why}", file=sys.stderr)
        return 2
    began = time.monotonic()
    rows, views, splits, links, alone = run_all(models, rates, args.scale, args.retries,
                                                args.retry_budget_min * 60)
    text = markdown(rows, views, splits, links, alone, harness.command(),
                    time.monotonic() - began)
    harness.emit(args.out, text, {
        "rows": [row.__dict__ for row in rows], "links_mb_s": links, "splits": splits,
        "one_rank_alone": [{"model": m, "rate": r, "samples_per_s": v}
                           for (m, r), v in alone.items()],
        "planner": [{"model": m, "rate": r, **view.__dict__} for (m, r), view in views.items()]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
