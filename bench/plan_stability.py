"""Does planning the same job again give the same plan? (issue 32, item 3)

Plans the main job (`pipedream-fast train`'s defaults) and a small MLP in a script `--repeat`
times each and counts the distinct plans: profile noise must not flip a plan.

    python bench/plan_stability.py --repeat 10 --out bench/results/plan_stability.md
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch import nn

from harness import Spread, write_results  # noqa: E402 - a sibling


def main_job_plans(repeat: int) -> tuple[collections.Counter[str], list[float]]:
    from pipedream_fast.cli import build_parser
    from pipedream_fast.commands import train
    from pipedream_fast.commands.train_run import load_datasets
    from pipedream_fast.commands.train_settings import settings

    args = build_parser().parse_args(["train"])
    s = settings(args)
    torch.set_num_threads(args.torch_threads)
    train_data, _ = load_datasets(train._base_config(s, args))
    plans: collections.Counter[str] = collections.Counter()
    rates = []
    for i in range(repeat):
        setup = train._prepare(s, args, s.schedule, s.chunks, train_data, lambda _: None, main=True)
        plans[f"{setup.plan.schedule}: {setup.plan.describe()}"] += 1
        rates.append(setup.simulated_samples_per_s or 0.0)
        print(f"main job {i + 1}/{repeat}: {setup.plan.describe()}", flush=True)
    return plans, rates


def script_plans(repeat: int, workers: int) -> tuple[collections.Counter[str], list[float]]:
    from pipedream_fast.planner.choose import plan_for
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.topology import Topology
    from pipedream_fast.tracing import trace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    x = torch.randn(16, 64)
    chain = trace(model, (x,), (), check=False)
    plans: collections.Counter[str] = collections.Counter()
    rates = []
    for i in range(repeat):
        profile = profile_model(model, (x,), batch_size=16, progress=False, chain=chain)
        plan = plan_for("1f1b", profile, Topology.parse(f"{workers}x1e9"), chunks=2)
        plans[f"1f1b: {plan.describe()}"] += 1
        rates.append(16e3 / plan.bottleneck_ms if plan.bottleneck_ms else 0.0)
        print(f"script {i + 1}/{repeat}: {plan.describe()}", flush=True)
    return plans, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None, help="results markdown (default: print only)")
    args = parser.parse_args()
    rows = []
    for name, (plans, rates) in (("main job (`pipedream-fast train`)", main_job_plans(args.repeat)),
                                 ("MLP in a script (Pipeline's planning, 1f1b)",
                                  script_plans(args.repeat, 2))):
        spread = Spread.of(rates)
        for plan, count in plans.most_common():
            rows.append([name, plan.replace(" | ", " / "), f"{count} of {args.repeat}",
                         f"{spread.median:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"])
        print(name, dict(plans), f"median predicted {spread.median:,.0f}")
    if args.out:
        write_results(args.out, "Plan stability: the same job planned again",
                      ["Each row: a distinct plan and how many of the plannings gave it; the "
                       "predicted samples/s over all plannings (median, range) show the "
                       "profile's noise, which a plan that flips exceeds the margin by."],
                      ["job", "plan", "plannings", "predicted samples/s"], rows)


if __name__ == "__main__":
    main()
