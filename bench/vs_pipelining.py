"""pipedream_fast against torch.distributed.pipelining on model A, the same stages and microbatches.

Model A (`build_cnn`, 9 blocks), batch 32, SGD lr 0.01, one fixed synthetic batch, 2 ranks (gloo
on loopback, one intra-op thread each); samples/s in steady state (`harness.window`). Sets:

  pairs (default)  each of our schedules against torch's on the very same stages (2 stages
                   [0, 6) | [6, 9); 4 stages [0, 3) | [3, 6) | [6, 7) | [7, 9), looped or in a V),
                   both sides in interleaved rounds in one pair of processes (`harness.alternate`),
                   each run from a fresh model; first/last-step losses compared as a guard
  model_a          one run each: single process (1 and 2 threads), torch Schedule1F1B, ours
                   pipedream and 1f1b (bench/results/model_a.md)
  interleaved      one run each on the planner's straight and looped plans, 4 microbatches:
                   torch 1F1B, Interleaved1F1B, InterleavedZeroBubble against ours 1f1b,
                   interleaved-1f1b, zb-h1, with the simulator's prediction (interleaved.md)

    python bench/vs_pipelining.py [--set pairs|model_a|interleaved] [--steps 12] [--warmup 3]
                                  [--repeats 5] [--quick] [--out bench/results/vs_pipelining.md]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn

import harness  # noqa: E402 - a sibling

BATCH, WORLD, LR = 32, 2, 0.01
BOUNDS = {2: [(0, 6), (6, 9)], 4: [(0, 3), (3, 6), (6, 7), (7, 9)]}  # blocks [start, stop)
# ours, torch's class, stages, microbatch counts per step, placement of the stages on the ranks
PAIRS = (("gpipe", "ScheduleGPipe", 2, (2, 4), "looped"),
         ("1f1b", "Schedule1F1B", 2, (2, 4), "looped"),
         ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, (4,), "looped"),
         ("zb-v", "ScheduleZBVZeroBubble", 4, (4, 8), "v"),
         ("dualpipe-v", "ScheduleDualPipeV", 4, (4, 8), "v"),
         ("interleaved-zb", "ScheduleInterleavedZeroBubble", 4, (4, 8), "looped"),
         ("looped-bfs", "ScheduleLoopedBFS", 4, (4, 8), "looped"))
DEFAULT = {"warmup": 3, "steps": 12, "repeats": 5}
QUICK = {"warmup": 2, "steps": 3, "repeats": 1}
FIRST_LOSS_TOL = 1e-4  # float32, mean of a few microbatch losses near 2.3
LAST_LOSS_TOL = 1e-3  # the same after a few SGD updates, accumulated in other orders
GOAL = 1.2  # 1f1b against Schedule1F1B
NEW_GOAL = 1.05  # issue 31: each of these against torch's, on the same stages and microbatches
NEW = ("zb-v", "dualpipe-v", "interleaved-zb", "looped-bfs")


def stage_rank(k: int, num_stages: int, placement: str) -> int:
    """Looped: stage k on rank k mod WORLD; "v": rank r holds stages r and 2 WORLD - 1 - r."""
    if placement == "v" and num_stages == 2 * WORLD:
        return k if k < WORLD else num_stages - 1 - k
    return k % WORLD


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch as bench/vs_ddp.py."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def torch_rank(rank: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
               warmup: int, steps: int, placement: str) -> dict[str, Any]:
    """torch.distributed.pipelining: this rank's stages of build_cnn(), `schedule`."""
    from torch.distributed import pipelining

    torch.manual_seed(0)
    children = list(build_cnn().children())
    mine = [k for k in range(len(stages)) if stage_rank(k, len(stages), placement) == rank]
    parts = [pipelining.PipelineStage(nn.Sequential(*children[stages[k][0]:stages[k][1]]), k,
                                      len(stages), torch.device("cpu")) for k in mine]
    opt = torch.optim.SGD([p for s in parts for p in s.submod.parameters()], lr=LR)
    sched = getattr(pipelining, schedule)(parts if len(parts) > 1 else parts[0], chunks,
                                          loss_fn=nn.functional.cross_entropy)
    first, last = 0 in mine, len(stages) - 1 in mine
    x, y = fixed_batch()
    clock, losses = harness.Clock(), []
    for step in range(warmup + steps):
        opt.zero_grad()
        mb_losses: list[torch.Tensor] = []
        sched.step(*((x,) if first else ()),
                   **({"target": y, "losses": mb_losses} if last else {}))
        opt.step()
        if last:
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        if step == warmup - 1:
            clock.warmed_up()
    return {**clock.done(), "losses": losses if last else None}


def ours_rank(rank: int, schedule: str, stages: list[tuple[int, int]], chunks: int,
              warmup: int, steps: int, placement: str) -> dict[str, Any]:
    """pipedream_fast's Pipeline on the same stages."""
    from pipedream_fast.pipeline import Pipeline

    torch.manual_seed(0)
    n = len(stages)
    plan = Plan("cnn", BATCH, WORLD, schedule,
                [StagePlan(a, b, 1, (stage_rank(k, n, placement),), 0.0)
                 for k, (a, b) in enumerate(stages)], 1.0, 1.0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=LR), plan=plan, schedule=schedule,
                    chunks=chunks)
    last = stage_rank(n - 1, n, placement) == rank
    clock, losses = harness.Clock(), []
    total = warmup + steps
    for step, loss in enumerate(pipe.train([fixed_batch()] * total, total)):
        if last and loss is not None:
            losses.append(float(loss))
        if step == warmup - 1:
            clock.warmed_up()
    stamps = clock.done()
    pipe.close()
    return {**stamps, "losses": losses if last else None}


SIDES = {"ours": ours_rank, "torch": torch_rank}


def row_rank(rank: int, world: int, ours: str, theirs: str, stages: list[tuple[int, int]],
             chunks: int, warmup: int, steps: int, repeats: int,
             placement: str) -> dict[str, list[Any]]:
    """Both sides in interleaved rounds in this rank process, each run from a fresh model."""
    def side(name: str, schedule: str) -> Any:
        def one() -> dict[str, Any]:
            gc.collect()  # the last side's stages and optimizer go before the next is built
            return SIDES[name](rank, schedule, stages, chunks, warmup, steps, placement)
        return one

    return harness.alternate({"ours": side("ours", ours), "torch": side("torch", theirs)},
                             repeats, warmup=False)


def measure(ours: str, theirs: str, stages: list[tuple[int, int]], chunks: int,
            sz: dict[str, int], placement: str) -> dict[str, Any]:
    by_rank = launch(row_rank, WORLD, ours, theirs, stages, chunks, sz["warmup"], sz["steps"],
                     sz["repeats"], placement, threads_per_rank=1)
    runs = {side: [{**harness.window(ranks, BATCH * sz["steps"]),
                    "losses": next(r["losses"] for r in ranks if r["losses"] is not None)}
                   for ranks in zip(*(r[side] for r in by_rank))] for side in ("ours", "torch")}
    med = {side: statistics.median(r["samples_per_s"] for r in rs) for side, rs in runs.items()}
    pairs = list(zip(runs["ours"], runs["torch"]))
    first = max(abs(a["losses"][0] - b["losses"][0]) for a, b in pairs)
    last = max(abs(a["losses"][-1] - b["losses"][-1]) for a, b in pairs)
    return {"schedule": ours, "torch_schedule": theirs, "stages": len(stages), "bounds": stages,
            "placement": placement if len(stages) > WORLD else "plain",
            "ranks": [stage_rank(k, len(stages), placement) for k in range(len(stages))],
            "microbatches": chunks, "ours_samples_per_s": med["ours"],
            "torch_samples_per_s": med["torch"], "ratio": med["ours"] / med["torch"],
            "pair_ratios": [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs],
            "first_loss": runs["torch"][0]["losses"][0], "first_loss_diff": first,
            "last_loss_diff": last,
            "losses_agree": first <= FIRST_LOSS_TOL and last <= LAST_LOSS_TOL,
            "other_cores_max": max(r["other_cores"] for rs in runs.values() for r in rs),
            "runs": runs}


def run(sz: dict[str, int]) -> dict[str, Any]:
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    for ours, theirs, stages, counts, placement in PAIRS:
        for chunks in counts:
            try:
                r = measure(ours, theirs, BOUNDS[stages], chunks, sz, placement)
            except Exception as error:  # noqa: BLE001 - a side that cannot run is a result
                rows.append({"schedule": ours, "torch_schedule": theirs, "stages": stages,
                             "bounds": BOUNDS[stages], "placement": placement,
                             "microbatches": chunks, "error": harness.shorten(error, 600)})
                harness.say(f"{ours:17s} {stages} stages {chunks} mb: FAILED {rows[-1]['error']}")
                continue
            rows.append(r)
            harness.say(f"{ours:17s} {stages} stages {chunks} mb: ours "
                        f"{r['ours_samples_per_s']:6.1f}  torch {r['torch_samples_per_s']:6.1f}  "
                        f"ratio {r['ratio']:.2f}x  loss diff first {r['first_loss_diff']:.1e} "
                        f"last {r['last_loss_diff']:.1e}")
    one = [r for r in rows if r["schedule"] == "1f1b" and "error" not in r]
    worst = min((r["ratio"] for r in one), default=0.0)
    new = [r for r in rows if r["schedule"] in NEW]
    new_ok = [r for r in new if "error" not in r]
    return {"settings": {**sz, "batch": BATCH, "lr": LR, "ranks": WORLD,
                         "threads_per_rank": 1, "stages2": BOUNDS[2], "stages4": BOUNDS[4]},
            "machine": harness.machine_info(), "rows": rows,
            "goal": {"text": f"1f1b at least {GOAL}x Schedule1F1B on the same stages and "
                             f"microbatches", "met": worst >= GOAL, "worst_ratio": worst,
                     "ratios": {str(r["microbatches"]): r["ratio"] for r in one}},
            "new_goal": {"text": f"{', '.join(NEW)} each at least {NEW_GOAL}x torch's "
                                 f"{', '.join(t for o, t, *_ in PAIRS if o in NEW)} on the "
                                 f"same stages and microbatches, losses agreeing",
                         "met": len(new_ok) == len(new) and all(
                             r["ratio"] >= NEW_GOAL and r["losses_agree"] for r in new_ok),
                         "worst_ratio": min((r["ratio"] for r in new_ok), default=0.0),
                         "ratios": {f"{r['schedule']} {r['microbatches']}": r.get("ratio")
                                    for r in new},
                         "failed": [f"{r['schedule']} {r['microbatches']}" for r in new
                                    if "error" in r]},
            "losses_agree": all(r.get("losses_agree", False) for r in rows),
            "wall_s": time.monotonic() - began}


def markdown(result: dict[str, Any]) -> str:
    s, goal, new = result["settings"], result["goal"], result["new_goal"]
    measured = ", ".join(f"{ratio:.2f}x at {mb} microbatches"
                         for mb, ratio in goal["ratios"].items())
    new_measured = ", ".join(f"{name}: " + ("failed" if ratio is None else f"{ratio:.2f}x")
                             for name, ratio in new["ratios"].items())
    bounds = {k: " | ".join(f"[{a}, {b})" for a, b in s[f"stages{k}"]) for k in (2, 4)}
    lines = ["# pipedream_fast vs torch.distributed.pipelining, model A, 2 ranks, CPU", "",
             f"Command: `{harness.command()}`", "",
             harness.machine_line(result["machine"], result["wall_s"]), "",
             f"- Model A (`build_cnn`), batch {s['batch']}, SGD lr {s['lr']}, one fixed synthetic "
             f"batch; {s['ranks']} ranks, gloo on loopback, 1 intra-op thread per rank.",
             f"- Stages, blocks [start, stop): 2 stages {bounds[2]}; 4 stages {bounds[4]} (the "
             f"planner's looped plan, `--set interleaved`), placed looped (ranks 0, 1, 0, 1) or "
             f"in a V (ranks 0, 1, 1, 0), column \"ranks\"; the same on both sides.",
             f"- Samples/s: {s['steps']} steps after {s['warmup']} warm-up steps, from the latest "
             f"rank's end of warm-up to the latest end; {s['repeats']} repeat(s) in interleaved "
             f"rounds (ours, torch, then torch, ours, ...) in one pair of processes, each from a "
             f"fresh model; medians and the ratio of the medians. Per round: the lowest and "
             f"highest round-by-round ratio (a verdict inside it is within the noise).",
             f"- Losses: the first and last step's mean microbatch loss, ours against torch, "
             f"largest difference over the repeats; agreed within {FIRST_LOSS_TOL:g} and "
             f"{LAST_LOSS_TOL:g}. Others (cores): the most CPU other processes took during a "
             f"measured window (of {result['machine']['cores']} cores).", ""]
    table, errors = [], []
    for r in result["rows"]:
        head = [f"{r['schedule']} / {r['torch_schedule']}", r["stages"],
                ", ".join(map(str, r.get("ranks", []))) or "-", r["microbatches"]]
        if "error" in r:
            table.append(head + ["failed", "failed"] + ["-"] * 6)
            errors.append(f"- {head[0]}, {r['microbatches']} microbatches: `{r['error']}`")
            continue
        table.append(head + [f"{r['torch_samples_per_s']:.1f}", f"{r['ours_samples_per_s']:.1f}",
                             f"{r['ratio']:.2f}x",
                             f"{min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f}",
                             f"{r['first_loss_diff']:.1e}", f"{r['last_loss_diff']:.1e}",
                             "yes" if r["losses_agree"] else "**NO**",
                             f"{r['other_cores_max']:.2f}"])
    lines += harness.markdown_table(
        ["schedule (ours / torch)", "stages", "ranks", "microbatches", "torch samples/s",
         "ours samples/s", "ours/torch", "per round", "first-step loss diff", "last-step loss diff",
         "losses agree", "others (cores)"], table)
    if errors:
        lines += ["", "Failed rows (the error, as raised):", "", *errors]
    lines += ["", f"Goal: {goal['text']}: **{'met' if goal['met'] else 'missed'}** "
                  f"(measured {measured}).", "",
              f"Goal (issue 31): {new['text']}: **{'met' if new['met'] else 'missed'}** "
              f"(measured {new_measured}).", "",
              "Losses: " + ("ours and torch agree on every pair." if result["losses_agree"] else
                            "**ours and torch DISAGREE (or a side failed) on at least one pair: "
                            "those throughput figures may compare different computations.**")]
    return "\n".join(lines) + "\n"


# ---- sets of single runs: model_a, interleaved ----------------------------------------------

def single_process(threads: int, sz: dict[str, int]) -> float:
    """Samples/s of plain training in this process on `threads` intra-op threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch()
    for step in range(sz["warmup"] + sz["steps"]):
        if step == sz["warmup"]:
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.set_num_threads(1)
    return BATCH * sz["steps"] / (time.perf_counter() - start)


def solo_rank(rank: int, world: int, side: str, *args: Any) -> dict[str, Any]:
    return SIDES[side](rank, *args)


def solo(side: str, schedule: str, stages: list[tuple[int, int]], chunks: int,
         sz: dict[str, int]) -> float:
    """Samples/s of one run of one side on 2 ranks, the stages looped."""
    ranks = launch(solo_rank, WORLD, side, schedule, stages, chunks, sz["warmup"], sz["steps"],
                   "looped", threads_per_rank=1)
    return harness.window(ranks, BATCH * sz["steps"])["samples_per_s"]


def planned(chunks: int) -> tuple[Any, Plan, Plan]:
    """The profile at the microbatch size, the planner's straight 2-stage and 4-stage looped
    plans (2 stages per rank) for 2 ranks."""
    from pipedream_fast.planner import make_plan
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.topology import Topology

    torch.manual_seed(0)
    micro = fixed_batch()[0][: BATCH // chunks]
    profile = profile_model(build_cnn(), micro, BATCH // chunks, progress=False, model_name="cnn")
    topology = Topology.parse("2x1.25e9")
    return (profile, make_plan(profile, topology, schedule="1f1b", straight=True),
            make_plan(profile, topology, schedule="1f1b", stages_per_rank=2))


def predicted(profile: Any, plan: Plan, schedule: str, chunks: int, steps: int) -> float:
    """Samples/s the simulator predicts from the microbatch-size profile."""
    from pipedream_fast.schedules import make_schedule
    from pipedream_fast.sim import ProfileCosts, simulate

    sched = make_schedule(schedule, len(plan.stages), chunks * steps, chunks=chunks,
                          stage_ranks=[list(s.ranks) for s in plan.stages])
    result = simulate(sched, ProfileCosts.from_plan(profile, plan, bandwidth=1.25e9))
    return BATCH * steps / result.makespan * 1e3


def run_set(name: str, sz: dict[str, int], out: str | None) -> None:
    rows: list[tuple[str, float, str]] = []

    def record(label: str, value: float, note: str = "") -> None:
        rows.append((label, value, note))
        harness.say(f"{label:72s} {value:7.1f} samples/s {note}")

    if name == "model_a":
        record("single process, 1 thread", single_process(1, sz))
        record("single process, 2 threads", single_process(2, sz))
        for chunks in (2, 4):
            record(f"torch.distributed.pipelining 1F1B, 2 ranks, {chunks} microbatches",
                   solo("torch", "Schedule1F1B", BOUNDS[2], chunks, sz))
        record("pipedream_fast pipedream, 2 ranks (minibatch = microbatch)",
               solo("ours", "pipedream", BOUNDS[2], 1, sz))
        record("pipedream_fast 1f1b, 2 ranks, 4 microbatches",
               solo("ours", "1f1b", BOUNDS[2], 4, sz))
        if out:
            harness.write_results(out, "Model A, batch 32, CPU", [],
                                  ["contender", "samples/s", "vs 1-thread single process"],
                                  [(n, f"{v:.1f}", f"{v / rows[0][1]:.2f}x") for n, v, _ in rows])
        return
    chunks = 4
    profile, *plans = planned(chunks)
    bounds = [[(s.start, s.stop) for s in p.stages] for p in plans]  # straight, looped
    harness.say(f"2 stages: {bounds[0]} | 4 looped stages: {bounds[1]}")
    for k, theirs, label in ((0, "Schedule1F1B", "Schedule1F1B, 2 stages"),
                             (1, "ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B, 2 x 2 stages"),
                             (1, "ScheduleInterleavedZeroBubble",
                              "ScheduleInterleavedZeroBubble, 2 x 2 stages")):
        record(f"torch.distributed.pipelining {label}", solo("torch", theirs, bounds[k], chunks, sz))
    for k, ours in ((0, "1f1b"), (1, "interleaved-1f1b"), (0, "zb-h1")):
        guess = predicted(profile, plans[k], ours, chunks, sz["steps"])
        record(f"pipedream_fast {ours}, {len(bounds[k])} stages",
               solo("ours", ours, bounds[k], chunks, sz), f"(simulator: {guess:.1f})")
    if out:
        v = [value for _, value, _ in rows]
        harness.write_results(
            out, "Interleaved 1F1B, model A, batch 32, 2 ranks, CPU",
            [f"Stages: 2-stage {bounds[0]}; looped {bounds[1]} (blocks [start, stop), "
             f"stage k on rank k mod 2), from a profile at the microbatch size; {chunks} "
             f"microbatches."],
            ["contender", "samples/s", "note"], [(n, f"{x:.1f}", note) for n, x, note in rows],
            [f"pipedream_fast interleaved-1f1b / torch ScheduleInterleaved1F1B: "
             f"**{v[4] / v[1]:.2f}x**; pipedream_fast zb-h1 / torch "
             f"ScheduleInterleavedZeroBubble: **{v[5] / v[2]:.2f}x**."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default="pairs", choices=("pairs", "model_a", "interleaved"),
                        help="what to compare (see the docstring; default pairs)")
    parser.add_argument("--quick", action="store_true", help="2+3 steps, 1 repeat")
    for name, what in (("steps", "measured steps after the warm-up"), ("warmup", "warm-up steps"),
                       ("repeats", "runs of each side per pair (pairs only)")):
        parser.add_argument(f"--{name}", type=harness.positive,
                            help=f"{what} (default {DEFAULT[name]})")
    parser.add_argument("--out", help="write the markdown here (pairs: the JSON beside it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sz = harness.sizes(args, DEFAULT, QUICK, args.quick)
    if args.set != "pairs":
        run_set(args.set, sz, args.out)
        return 0
    result = run(sz)
    harness.emit(args.out, markdown(result), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
