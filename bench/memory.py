"""Memory, predicted against measured, per rank, for every schedule (issue 28, items 1-2, 5).

For each model, schedule and pipeline depth, one run on rank processes (gloo, 1 thread each)
measures what every rank holds (`measure_memory=True`: weights, stashed versions, gradients,
optimizer state, and the activations of microbatches in flight, counted at their tensors;
`runtime/memory.py`), and the simulator predicts it from a profile of the model at the
microbatch size and the schedule alone (`sim_memory.predict_memory`). The table gives each
rank's measured peak and the prediction's error, for the whole peak and for the activations.

    python bench/memory.py [--models cnn,charlm] [--ranks 2,4] [--out bench/results/memory.md]
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_model, loss_fn
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.profiler import profile_model
from pipedream_fast.sim import ProfileCosts, simulate
from pipedream_fast.sim_memory import predict_memory
from pipedream_fast.tracing import trace
from pipedream_fast.training import build_schedule

from harness import write_results  # noqa: E402 - a sibling

BATCH, STEPS = 32, 3
SCHEDULES = (("gpipe", 4), ("1f1b", 4), ("interleaved-1f1b", 4), ("zb-h1", 4), ("2bw", 4),
             ("pipedream", 1), ("pipedream-vsync", 1))


def model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, BATCH)[0]


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS minibatches of the model's own input kind and matching targets."""
    _, example = build_model(name, BATCH)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = (torch.randn(example.shape, generator=g) if example.is_floating_point()
             else torch.randint(0, int(example.max()) + 1, example.shape, generator=g))
        with torch.no_grad():
            classes = model(name)(x[:1]).shape
        out.append((x, torch.randint(0, classes[-1], (BATCH, *classes[1:-1]), generator=g)))
    return out


def plan_for(name: str, schedule: str, ranks: int, chunks: int) -> Plan:
    """Stages cut evenly by blocks; stage i on rank i mod ranks (interleaved: two a rank)."""
    n = len(trace(model(name)))
    count = stages_for(schedule, ranks)
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return Plan(type(model(name)).__name__, BATCH // chunks, ranks, schedule,
                [StagePlan(start, start + size, 1, (i % ranks,), 0.0)
                 for i, (start, size) in enumerate(zip(starts, sizes))], 0.0, 0.0)


def stages_for(schedule: str, ranks: int) -> int:
    return 2 * ranks if schedule == "interleaved-1f1b" else ranks


def measure_job(rank: int, world: int, name: str, schedule: str, chunks: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipe = Pipeline(model(name), loss_fn, lambda ps: torch.optim.Adam(ps, lr=1e-4),
                    plan=plan_for(name, schedule, world, chunks), schedule=schedule,
                    chunks=chunks, measure_memory=True, timeout=120)
    try:
        list(pipe.train(batches(name), steps=STEPS))
        return {"memory": pipe.memory, "plan": copy.deepcopy(pipe.plan)}
    finally:
        pipe.close()


def predicted(name: str, schedule: str, chunks: int, plan: Any) -> dict[int, Any]:
    micro = BATCH // chunks
    profile = profile_model(model(name), batches(name)[0][0][:micro], micro, optimizer="adam",
                            warmup=0, repeat=1, progress=False)
    plan.model = profile.model
    result = simulate(build_schedule(plan, schedule, STEPS, chunks),
                      ProfileCosts.from_plan(profile, plan))
    return predict_memory(result, profile, plan, micro, chunks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,charlm")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    rows, data, worst = [], [], 0.0
    for name in args.models.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for schedule, chunks in SCHEDULES:
                if len(trace(model(name))) < stages_for(schedule, ranks):
                    continue
                results = launch(measure_job, ranks, name, schedule, chunks, timeout=600,
                                 threads_per_rank=1)
                prediction = predicted(name, schedule, chunks, results[0]["plan"])
                for rank, result in enumerate(results):
                    got = result["memory"]["rank"]
                    want = prediction[rank]
                    total = want.total_peak / got["total_peak"] - 1
                    act = want.activations_peak / max(1, got["activations_peak"]) - 1
                    worst = max(worst, abs(total))
                    rows.append((name, ranks, schedule, rank,
                                 f"{got['total_peak'] / 2**20:.2f}",
                                 f"{got['activations_peak'] / 2**20:.2f}",
                                 f"{total:+.1%}", f"{act:+.1%}"))
                    data.append({"model": name, "ranks": ranks, "schedule": schedule,
                                 "rank": rank, "measured": got,
                                 "predicted": want.to_dict()})
                print(f"{name} {ranks} ranks {schedule}: " + "; ".join(
                    f"rank {r[3]} {r[6]} (activations {r[7]})" for r in rows[-ranks:]),
                    flush=True)
    print(f"worst error of a rank's predicted peak: {worst:.1%}")
    if args.out:
        write_results(
            args.out, "Memory per rank: predicted against measured",
            [f"Minibatch {BATCH}, {STEPS} steps, Adam; gpipe, 1f1b, interleaved-1f1b (2 "
             f"stages per rank), zb-h1 and 2bw with 4 microbatches, pipedream and "
             f"pipedream-vsync with 1; stages cut evenly by blocks. Measured: "
             f"`measure_memory=True` on rank processes (every storage a rank's stages hold, "
             f"`runtime/memory.py`). Predicted: the simulator from a profile at the "
             f"microbatch size (`sim_memory.py`). Errors are predicted / measured - 1."],
            ["model", "ranks", "schedule", "rank", "measured peak (MiB)",
             "of it activations (MiB)", "predicted peak error", "activations error"],
            rows, [f"Worst error of a rank's predicted peak: {worst:.1%}."],
            {"batch": BATCH, "steps": STEPS, "rows": data, "worst_total_error": worst})
    return 0


if __name__ == "__main__":
    sys.exit(main())
