"""`pipedream-fast train`: train a model with a schedule on synthetic data, end to end.

    pipedream-fast train --model cnn --schedule pipedream --nproc 2 --steps 20
    pipedream-fast train --model cnn --plan plan.json --schedule 2bw --chunks 4 --trace run.json
    pipedream-fast train --model mlp --threads 3 --schedule 1f1b

Without `--plan`, the model is profiled and planned for the requested worker count first.
`--nproc N` starts N processes (gloo on CPU); `--threads N` runs the N ranks as threads of this
process. The data are a fixed, seeded stream of random inputs and class labels, identical on
every rank, so runs are reproducible and comparable across schedules.
"""

from __future__ import annotations

import argparse
import time
from typing import Any
from collections.abc import Iterator

import torch
from torch import nn

from pipedream_fast.cli import UsageError
from pipedream_fast.formats import Plan
from pipedream_fast.models import BUILTIN_MODELS, build_model
from pipedream_fast.schedules import TRAINABLE, kind
from pipedream_fast.training import resolve_schedule


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model with a pipeline schedule (synthetic data)",
        description="Profile and plan (or load a plan), then train with a schedule across "
                    "processes or threads, printing the loss and the throughput.")
    parser.add_argument("--model", default="cnn", metavar="NAME_OR_MODULE:FACTORY",
                        help=f"built-in ({', '.join(BUILTIN_MODELS)}) or package.module:factory "
                             f"(default: cnn)")
    parser.add_argument("--schedule", default="pipedream", choices=TRAINABLE + ("auto",),
                        help="default pipedream; auto: the planner compares every trainable "
                             "schedule in the simulator and keeps the fastest (with --plan: the "
                             "plan's schedule)")
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument("--nproc", type=int, default=None, help="ranks as processes (default 2)")
    workers.add_argument("--threads", type=int, default=None, help="ranks as threads of one process")
    parser.add_argument("--plan", default=None, help="plan JSON (default: profile and plan now)")
    parser.add_argument("--straight", action="store_true",
                        help="when planning: one rank per stage, no replicas")
    parser.add_argument("--stages-per-rank", type=int, default=None, metavar="V",
                        help="when planning: workers x V stages, looped over the ranks "
                             "(default: the schedule's, 2 for interleaved-1f1b, else 1)")
    parser.add_argument("--bandwidth", type=float, default=1e9,
                        help="link bandwidth in bytes/s assumed when planning (default 1e9)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per minibatch")
    parser.add_argument("--chunks", type=int, default=None,
                        help="microbatches per minibatch (default: the worker count for "
                             "schedules that update once per minibatch, else 1)")
    parser.add_argument("--steps", type=int, default=10, help="minibatches to train (default 10)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="print the loss every N steps, after the first ten (default: every "
                             "step up to 100 steps, else about 100 lines in all)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any transfer may take before the run fails (default 300)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads per rank (default 1: ranks share the cores)")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the run")
    parser.set_defaults(func=run)


def synthetic_batches(example: torch.Tensor, classes: int, batch_size: int, steps: int,
                      seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        yield (torch.randn(batch_size, *example.shape[1:], generator=generator),
               torch.randint(0, classes, (batch_size,), generator=generator))


def _model(config: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, int]:
    torch.manual_seed(config["seed"])  # every rank builds the same initial weights
    module, example = build_model(config["model"], config["batch_size"])
    if not isinstance(example, torch.Tensor):
        raise UsageError(f"train uses synthetic data and needs a model with one tensor input; "
                         f"{config['model']!r} takes {type(example).__name__}")
    with torch.no_grad():
        classes = int(module(example[:1]).shape[-1])
    return module, example, classes


def _optimizer(config: dict[str, Any]) -> Any:
    lr = config["lr"]
    if config["optimizer"] == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def _rank_job(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(config["torch_threads"])
    module, example, classes = _model(config)
    pipe = Pipeline(module, nn.functional.cross_entropy, _optimizer(config),
                    plan=Plan.from_dict(config["plan"]), schedule=config["schedule"],
                    chunks=config["chunks"], timeout=config["timeout"],
                    trace=config["trace"] is not None)
    data = synthetic_batches(example, classes, config["batch_size"], config["steps"], config["seed"])
    clock = StepClock()
    last_loss = None
    for step, loss in enumerate(pipe.train(data, config["steps"])):
        clock.tick()
        if loss is not None:
            last_loss = float(loss)
            if _log_now(step, config):
                print(f"step {step + 1:4d}/{config['steps']}  loss {last_loss:.4f}", flush=True)
    pipe.close()
    return {"rank": rank, "last_loss": last_loss, "times": clock.summary(),
            "stats": pipe.last_stats, "events": pipe.last_events}


class StepClock:
    """When steps ended: the first, the last and how many (constant memory for any run)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def tick(self) -> None:
        now = time.perf_counter()
        self.first = now if self.first is None else self.first
        self.last = now
        self.count += 1

    def summary(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "count": self.count}


def _log_now(step: int, config: dict[str, Any]) -> bool:
    """Every step of short runs; of long ones the first ten, then about 100 lines in all."""
    every = config["log_every"] or (1 if config["steps"] <= 100 else config["steps"] // 100)
    first = step < 10
    return first or (step + 1) % every == 0 or step + 1 == config["steps"]


def _plan(args: argparse.Namespace, workers: int) -> Plan:
    if args.plan:
        plan = Plan.load(args.plan)
        if plan.workers != workers:
            raise UsageError(f"{args.plan} is a plan for {plan.workers} workers but the run asks "
                             f"for {workers}; drop --nproc/--threads or make a new plan")
        return plan
    from pipedream_fast.planner.choose import choose_schedule, plan_for
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.topology import Topology

    module, example = build_model(args.model, args.batch_size)
    print(f"profiling {args.model} at batch size {args.batch_size} ...", flush=True)
    profile = profile_model(module, example, args.batch_size, warmup=1, repeat=3, progress=False,
                            model_name=args.model)
    topology = Topology.parse(f"{workers}x{args.bandwidth}")
    if args.schedule == "auto":
        plan = choose_schedule(profile, topology, straight=args.straight)
        print(f"schedule: {plan.schedule} (fastest predicted of "
              f"{len(plan.extra['schedule_choice'])} compared)", flush=True)
    else:
        overrides = {"stages_per_rank": args.stages_per_rank} if args.stages_per_rank else {}
        plan = plan_for(args.schedule, profile, topology, straight=args.straight, **overrides)
    if plan.workers != workers:
        raise UsageError(f"the best plan for {args.model} uses {plan.workers} of {workers} "
                         f"workers; run with --nproc {plan.workers} or give a --plan")
    layout = ", ".join(f"blocks {s.start}-{s.stop - 1} on ranks {list(s.ranks)}" for s in plan.stages)
    print(f"plan: {layout} (predicted {plan.bottleneck_ms:.1f} ms per minibatch)", flush=True)
    return plan


def run(args: argparse.Namespace) -> int:
    from pipedream_fast.launch import launch
    from pipedream_fast.local_pipeline import LocalPipeline
    from pipedream_fast.trace import write_chrome_trace

    for name in ("batch_size", "steps", "chunks", "nproc", "threads", "torch_threads",
                 "log_every", "stages_per_rank"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive seconds, got {args.timeout}")
    workers = args.nproc or args.threads or (Plan.load(args.plan).workers if args.plan else 2)
    plan = _plan(args, workers)
    if args.schedule == "auto":
        args.schedule = resolve_schedule("auto", plan)
    chunks = args.chunks or (workers if kind(args.schedule).chunked_steps else 1)
    config = {"model": args.model, "batch_size": args.batch_size, "steps": args.steps,
              "log_every": args.log_every,
              "schedule": args.schedule, "chunks": chunks, "optimizer": args.optimizer,
              "lr": args.lr, "seed": args.seed, "timeout": args.timeout, "trace": args.trace,
              "torch_threads": args.torch_threads, "plan": plan.to_dict()}
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.torch_threads)
        module, example, classes = _model(config)
        pipe = LocalPipeline(module, nn.functional.cross_entropy, _optimizer(config), plan,
                             schedule=args.schedule, chunks=chunks, timeout=args.timeout,
                             trace=args.trace is not None)
        data = synthetic_batches(example, classes, args.batch_size, args.steps, args.seed)
        clock = StepClock()
        for step, loss in enumerate(pipe.train(data, args.steps)):
            clock.tick()
            if _log_now(step, config):
                print(f"step {step + 1:4d}/{args.steps}  loss {float(loss):.4f}", flush=True)
        results: list[dict[str, Any]] = [
            {"rank": r, "times": clock.summary() if r == 0 else StepClock().summary(),
             "stats": s, "events": []} for r, s in pipe.last_stats.items()]
        results[0]["events"] = pipe.last_events
    else:
        results = launch(_rank_job, workers, config, timeout=args.timeout)
    elapsed = time.perf_counter() - started
    times = max((r["times"] for r in results), key=lambda t: t["count"])
    if times["count"] > 2:  # steady state: from the end of the first step on
        rate = args.batch_size * (times["count"] - 1) / (times["last"] - times["first"])
        print(f"throughput {rate:.1f} samples/s (steps 2-{times['count']}), "
              f"{elapsed:.1f} s in all with start-up")
    for r in sorted(results, key=lambda r: r["rank"]):
        s = r["stats"]
        print(f"rank {r['rank']}: compute {s.get('compute_s', 0):.2f} s, waiting "
              f"{s.get('wait_s', 0):.2f} s, optimizer {s.get('update_s', 0):.2f} s, sent "
              f"{s.get('bytes_sent', 0) / 1e6:.1f} MB")
    if args.trace:
        events = [e for r in results for e in r["events"]]
        origin = min((e.start_ms for e in events), default=0.0)
        events = [type(e)(e.rank, e.kind, e.start_ms - origin, e.duration_ms, e.stage,
                          e.microbatch, e.version, e.args) for e in events]
        write_chrome_trace(events, args.trace, process=f"pipedream-fast train {args.schedule}",
                           rank_stages={r: plan.stages_of_rank(r) for r in range(workers)})
        print(f"wrote {args.trace}")
    return 0
