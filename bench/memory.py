"""Each rank's memory predicted against measured, per schedule; plans under a memory cap (issue 28).

Per model, schedule and depth, one run on rank processes measures what every rank holds
(`measure_memory=True`) and the simulator predicts it from a profile at the microbatch. Cap:
the char LM's 2-rank 1f1b plan with no limit, under a cap that forces recomputation and
recomputing every stage, in interleaved rounds: peaks against the cap, samples/s, prediction.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipedream_fast.data_feed import split_microbatches
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_model, loss_fn
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.profiler import profile_model
from pipedream_fast.sim import ProfileCosts, simulate
from pipedream_fast.sim_memory import predict_memory
from pipedream_fast.tracing import trace
from pipedream_fast.training import build_schedule

import harness  # noqa: E402 - a sibling

BATCH, STEPS, ZOO_SEQ, ZOO_VOCAB = 32, 3, 16, 64  # ZOO_: BERT's sequence length, vocabulary
SCHEDULES = (("gpipe", 4), ("1f1b", 4), ("interleaved-1f1b", 4), ("zb-h1", 4), ("2bw", 4),
             ("pipedream", 1), ("pipedream-vsync", 1))


def model(name: str) -> torch.nn.Module:
    """`build_model`'s, or the test zoo's BERT classifier (small: no hub is reachable)."""
    if name != "bert":
        torch.manual_seed(0)
        return build_model(name, BATCH)[0]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zoo import import_torchvision  # declares torchvision's operators before transformers
    import_torchvision()
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=ZOO_VOCAB, hidden_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=256,
                                     max_position_embeddings=2 * ZOO_SEQ, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def batches(name: str, steps: int = STEPS) -> list[Any]:
    """`steps` minibatches of the model's own input kind and matching targets."""
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        return [{"input_ids": torch.randint(0, ZOO_VOCAB, (BATCH, ZOO_SEQ), generator=g),
                 "labels": torch.randint(0, 3, (BATCH,), generator=g)} for _ in range(steps)]
    net, example = build_model(name, BATCH)
    with torch.no_grad():
        classes = net(example[:1]).shape
    return [((torch.randn(example.shape, generator=g) if example.is_floating_point()
              else torch.randint(0, int(example.max()) + 1, example.shape, generator=g)),
             torch.randint(0, classes[-1], (BATCH, *classes[1:-1]), generator=g))
            for _ in range(steps)]


def inputs_of(name: str, batch: Any) -> Any:
    return batch if name == "bert" else batch[0]


def blocks_of(name: str) -> int:
    return len(trace(model(name), inputs_of(name, batches(name, 1)[0])))


def plan_for(name: str, schedule: str, ranks: int, chunks: int) -> Plan:
    """Stages cut evenly by blocks; stage i on rank i mod ranks (interleaved: two a rank)."""
    n, count = blocks_of(name), stages_for(schedule, ranks)
    cuts = [i * (n // count) + min(i, n % count) for i in range(count + 1)]  # first longer
    return Plan(type(model(name)).__name__, BATCH // chunks, ranks, schedule,
                [StagePlan(cuts[i], cuts[i + 1], 1, (i % ranks,), 0.0) for i in range(count)],
                0.0, 0.0)


def stages_for(schedule: str, ranks: int) -> int:
    return 2 * ranks if schedule == "interleaved-1f1b" else ranks


def pipeline(name: str, plan: Plan, schedule: str, chunks: int, timeout: float) -> Pipeline:
    """A rank's pipeline on one thread, counting its memory."""
    torch.set_num_threads(1)
    return Pipeline(model(name), None if name == "bert" else loss_fn,  # BERT's: from its labels
                    lambda ps: torch.optim.Adam(ps, lr=1e-4), plan=plan, schedule=schedule,
                    chunks=chunks, measure_memory=True, timeout=timeout)


def measure_job(rank: int, world: int, name: str, schedule: str, chunks: int) -> dict[str, Any]:
    pipe = pipeline(name, plan_for(name, schedule, world, chunks), schedule, chunks, 120)
    try:
        list(pipe.train(batches(name), steps=STEPS))
        return {"memory": pipe.memory, "plan": copy.deepcopy(pipe.plan)}
    finally:
        pipe.close()


def microbatch_profile(name: str, chunks: int, repeat: int = 1) -> Any:
    """The model profiled on one microbatch (a copy: its own storage, not the minibatch's)."""
    first = split_microbatches(inputs_of(name, batches(name, 1)[0]), chunks)[0]
    first = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, first)
    m = model(name)
    chain = trace(m, first)
    return profile_model(m, chain.flatten_inputs(first), BATCH // chunks, optimizer="adam",
                         warmup=0 if repeat == 1 else 1, repeat=repeat, progress=False, chain=chain)


def simulated(profile: Any, plan: Plan, schedule: str, steps: int, chunks: int) -> Any:
    """The simulator's run of `plan`, renamed after the profile's model (which it checks)."""
    plan.model = profile.model
    return simulate(build_schedule(plan, schedule, steps, chunks),
                    ProfileCosts.from_plan(profile, plan))


# ---- plans under a memory cap: no limit, a cap that forces recomputation, all recomputing ----
CAP_MODEL, CAP_SCHEDULE, CAP_CHUNKS, CAP_STEPS, CAP_WARM = "charlm", "1f1b", 4, 12, 2


def cap_job(rank: int, world: int, plan: Plan) -> dict[str, Any]:
    """One run of `plan`: each rank's memory, and samples/s after the first CAP_WARM steps."""
    pipe = pipeline(CAP_MODEL, plan, CAP_SCHEDULE, CAP_CHUNKS, 300)
    try:
        began = 0.0
        for step, loss in enumerate(pipe.train(batches(CAP_MODEL, CAP_STEPS), steps=CAP_STEPS)):
            float(loss)
            if step == CAP_WARM - 1:
                began = time.perf_counter()
        rate = (CAP_STEPS - CAP_WARM) * BATCH / (time.perf_counter() - began)
        return {"memory": pipe.memory, "samples_per_s": rate}
    finally:
        pipe.close()


def cap_plans(profile: Any) -> tuple[dict[str, Plan], int, int, int]:
    """The planner's straight 2-stage plans (as `pipedream-fast train` makes them) with no
    limit, under the cap, recomputing every stage; the cap; the least memory per worker any
    plan needs, recomputing where needed and not."""
    from pipedream_fast.planner import make_plan, smallest_memory
    from pipedream_fast.planner.costs import Costs, MemoryModel
    from pipedream_fast.topology import Topology

    costs, topology = Costs.from_profile(profile), Topology.parse("2x1e9")
    need = {mode: smallest_memory(costs, topology, MemoryModel(CAP_SCHEDULE, None, CAP_CHUNKS,
                                                               mode), straight=True)
            for mode in ("auto", "none")}
    assert need["auto"] is not None and need["none"] is not None
    cap = (need["auto"] + need["none"]) // 2
    setups = {"no limit": (None, "none"), "cap": (cap, "auto"), "all recompute": (None, "all")}
    plans = {name: make_plan(profile, Topology.parse("2x1e9", limit), schedule=CAP_SCHEDULE,
                             straight=True, chunks=CAP_CHUNKS, recompute=mode)
             for name, (limit, mode) in setups.items()}
    return plans, cap, need["auto"], need["none"]


def simulated_rate(profile: Any, plan: Plan) -> float:
    result = simulated(profile, copy.deepcopy(plan), CAP_SCHEDULE, 8 * CAP_CHUNKS, CAP_CHUNKS)
    return 8 * CAP_CHUNKS * profile.batch_size / result.makespan


def cap_experiment(rounds: int) -> tuple[list[str], list[tuple[Any, ...]], dict[str, Any]]:
    profile = microbatch_profile(CAP_MODEL, CAP_CHUNKS, repeat=5)
    plans, cap, recomputing, keeping = cap_plans(profile)
    last: dict[str, Any] = {}

    def run(name: str) -> float:
        last[name] = launch(cap_job, 2, plans[name], timeout=600, threads_per_rank=1)
        return min(r["samples_per_s"] for r in last[name])  # the slowest rank's view

    rates = harness.alternate({name: functools.partial(run, name) for name in plans}, rounds)
    rows, data = [], {"cap_bytes": cap, "smallest_recomputing": recomputing,
                      "smallest_keeping": keeping, "runs": {}}
    base = simulated_rate(profile, plans["no limit"])
    for name, results in last.items():
        plan = plans[name]
        peaks = [r["memory"]["rank"]["total_peak"] for r in results]
        measured = harness.paired_ratio(rates, name, "no limit")
        predicted = simulated_rate(profile, plan) / base
        stages = " / ".join(f"{s.start}-{s.stop - 1}{' R' if s.extra.get('recompute') else ''}"
                            for s in plan.stages)
        rows.append((name, stages, " / ".join(f"{p / 2**20:.2f}" for p in peaks),
                     "-" if name != "cap" else ("yes" if max(peaks) <= cap else "NO"),
                     harness.Spread.of(rates[name]).text(0), measured.text(3), f"{predicted:.3f}"))
        data["runs"][name] = {"plan": plan.to_dict(), "peaks": peaks,
                              "samples_per_s": rates[name], "predicted_ratio": predicted}
        print(f"cap: {name}: {rows[-1]}", flush=True)
    intro = [f"Plans under a memory cap: {CAP_MODEL}, {CAP_SCHEDULE} with {CAP_CHUNKS} "
             f"microbatches of {BATCH // CAP_CHUNKS} on 2 rank processes, straight 2-stage "
             f"plans as `pipedream-fast train` makes them. The cap, {cap / 2**20:.2f} MiB ({cap} "
             f"bytes) per worker, lies half-way between the least any plan needs recomputing "
             f"({recomputing} bytes) and keeping every activation ({keeping} bytes). {rounds} "
             f"interleaved rounds; samples/s over {CAP_STEPS - CAP_WARM} steps after {CAP_WARM}, "
             f"the slowest rank's; ratios to the unlimited plan round by round; predicted: the "
             f"simulator on each plan. Stages: blocks, R = recomputes."]
    return intro, rows, data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,charlm,bert")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--cap-rounds", type=int, default=3,
                        help="interleaved rounds of the cap experiment (0: skip it)")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    rows, data, worst = [], [], 0.0
    for name in [m for m in args.models.split(",") if m]:  # --models "": the cap alone
        for ranks in (int(r) for r in args.ranks.split(",")):
            for schedule, chunks in SCHEDULES:
                if blocks_of(name) < stages_for(schedule, ranks):
                    continue
                results = launch(measure_job, ranks, name, schedule, chunks, timeout=600,
                                 threads_per_rank=1)
                profile, plan = microbatch_profile(name, chunks), results[0]["plan"]
                prediction = predict_memory(simulated(profile, plan, schedule, STEPS, chunks),
                                            profile, plan, BATCH // chunks, chunks)
                for rank, result in enumerate(results):
                    got, want = result["memory"]["rank"], prediction[rank]
                    total = want.total_peak / got["total_peak"] - 1
                    act = want.activations_peak / max(1, got["activations_peak"]) - 1
                    worst = max(worst, abs(total))
                    rows.append((name, ranks, schedule, rank, f"{got['total_peak'] / 2**20:.2f}",
                                 f"{got['activations_peak'] / 2**20:.2f}", f"{total:+.1%}",
                                 f"{act:+.1%}"))
                    data.append({"model": name, "ranks": ranks, "schedule": schedule,
                                 "rank": rank, "measured": got, "predicted": want.to_dict()})
                print(f"{name} {ranks} ranks {schedule}: " + "; ".join(
                    f"rank {r[3]} {r[6]} (activations {r[7]})" for r in rows[-ranks:]), flush=True)
    print(f"worst error of a rank's predicted peak: {worst:.1%}")
    cap_intro, cap_rows, cap_data = (cap_experiment(args.cap_rounds) if args.cap_rounds
                                     else ([], [], {}))
    if args.out:
        harness.write_results(
            args.out, "Memory per rank: predicted against measured",
            [f"Minibatch {BATCH}, {STEPS} steps, Adam; 4 microbatches (pipedream and "
             f"pipedream-vsync: 1), interleaved-1f1b 2 stages per rank; stages cut evenly by "
             f"blocks. Measured: `measure_memory=True` on rank processes. Predicted: "
             f"`sim_memory.py` from a profile at the microbatch. Error: predicted / measured - 1."],
            ["model", "ranks", "schedule", "rank", "measured peak (MiB)",
             "of it activations (MiB)", "predicted peak error", "activations error"],
            rows, [f"Worst error of a rank's predicted peak: {worst:.1%}.", ""]
            + ([*cap_intro, "", *harness.markdown_table(
                ["run", "stages", "measured peak per rank (MiB)", "under the cap",
                 "samples/s (median, range)", "x the unlimited plan, measured",
                 "predicted"], cap_rows)] if cap_rows else []),
            {"batch": BATCH, "steps": STEPS, "rows": data, "worst_total_error": worst,
             "cap": cap_data})
    return 0


if __name__ == "__main__":
    sys.exit(main())
