"""What the CPU block cache (`Tuning.cpu_cache_mb`, csrc/cpu_cache.h) is worth: model A on 2
ranks, ours with it (the default), ours without it (`Tuning(cpu_cache_mb=0)`: malloc's own
behaviour) and torch.distributed.pipelining (malloc's as well), in interleaved rounds in one
pair of processes, each run from a fresh model. Besides samples/s, two measurements the
cache does not make itself: the page faults each rank's process took over the timed steps
(getrusage: fresh memory faulted in and zeroed) and its resident memory at their end.

    python bench/cpu_cache.py --out bench/results/cpu_cache.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import harness
import vs_pipelining as pairs
from pipedream_fast.launch import launch

SIDES = ("ours", pairs.NO_CACHE, "torch")
# ours, torch's class, stages (placed as ours places them), microbatches per step
CASES = (("1f1b", "Schedule1F1B", pairs.A2, 4),
         ("zb-v", "ScheduleZBVZeroBubble", pairs.A4, 4))
DEFAULT = {"warmup": 3, "steps": 8, "repeats": 3}
QUICK = {"warmup": 1, "steps": 2, "repeats": 1}


def case_rank(rank: int, world: int, ours: str, theirs: str, stages: list[tuple[int, int]],
              chunks: int, where: list[int], sz: dict[str, int]) -> dict[str, list[Any]]:
    """The three sides in interleaved rounds in this rank process. Torch keeps gloo's I/O
    threads at our priority (`pairs.OUR_IO`): this bench isolates the cache."""
    def side(name: str) -> Any:
        how = pairs.OUR_IO if name == "torch" else name
        return lambda: pairs.side_rank(rank, world, how, theirs if name == "torch" else ours,
                                       "cnn", stages, chunks, sz["warmup"], sz["steps"], where)
    return pairs.rounds({name: side(name) for name in SIDES}, sz["repeats"])


def measure(case: tuple[Any, ...], sz: dict[str, int]) -> dict[str, Any]:
    ours, theirs, stages, chunks = case
    by_rank = launch(case_rank, pairs.WORLD, ours, theirs, stages, chunks,
                     pairs.stage_ranks(ours, len(stages)), sz, threads_per_rank=1)
    runs = {name: [pairs.one_run(list(ranks), pairs.BATCH * sz["steps"])
                   for ranks in zip(*(r[name] for r in by_rank))] for name in SIDES}
    failed = {name: r["error"] for name, rs in runs.items() for r in rs if "error" in r}
    if failed:
        return {"schedule": ours, "torch_schedule": theirs, "error": failed}
    rate = {name: [r["samples_per_s"] for r in rs] for name, rs in runs.items()}
    row: dict[str, Any] = {"schedule": ours, "torch_schedule": theirs, "stages": len(stages),
                           "microbatches": chunks, "sides": {}}
    for name in SIDES:
        rs = runs[name]
        row["sides"][name] = {
            "samples_per_s": statistics.median(rate[name]),
            "vs_torch": harness.paired_ratio(rate, name, "torch").median,
            "vs_no_cache": harness.paired_ratio(rate, name, pairs.NO_CACHE).median,
            "vs_torch_rounds": [a / b for a, b in zip(rate[name], rate["torch"])],
            # per timed step, each rank's process
            "faults_per_step": [statistics.median(r["page_faults"][k] for r in rs) / sz["steps"]
                                for k in range(pairs.WORLD)],
            "rss_mb": [statistics.median(r["rss_mb"][k] for r in rs) for k in range(pairs.WORLD)],
            "other_cores": max(r["other_cores"] for r in rs)}
    return row


def markdown_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    table = []
    for row in rows:
        label = f"{row['schedule']} / {row['torch_schedule']}"
        if "error" in row:
            table.append([label, "failed: " + "; ".join(f"{k}: {v}" for k, v in row["error"].items())]
                         + ["-"] * 5)
            continue
        for name in SIDES:
            s = row["sides"][name]
            rounds = s["vs_torch_rounds"]
            table.append([label, name, f"{s['samples_per_s']:.1f}",
                          f"{s['vs_torch']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})",
                          f"{s['vs_no_cache']:.2f}x",
                          " / ".join(f"{f:,.0f}" for f in s["faults_per_step"]),
                          " / ".join(f"{m:.0f}" for m in s["rss_mb"])])
            label = ""
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewest steps, 1 round: does it run?")
    parser.add_argument("--out", help="write the markdown here (and the JSON beside it)")
    args = parser.parse_args()
    sz = QUICK if args.quick else DEFAULT
    began = time.monotonic()
    rows = []
    for case in CASES:
        rows.append(measure(case, sz))
        harness.say(f"{case[0]}: " + ", ".join(
            f"{name} {harness.fmt(rows[-1].get('sides', {}).get(name, {}).get('samples_per_s'))}"
            for name in SIDES))
    wall = time.monotonic() - began
    header = ["schedule (ours / torch)", "side", "samples/s", "vs torch (rounds)",
              "vs ours without the cache", "page faults per step (rank 0 / 1)",
              "resident MiB after the run (rank 0 / 1)"]
    intro = [f"Model A (`build_cnn`), batch {pairs.BATCH}, 2 ranks, gloo on loopback, 1 thread "
             f"per rank; {sz['steps']} steps after {sz['warmup']} warm-up, {sz['repeats']} "
             f"interleaved rounds of the three sides in one pair of processes, each run from a "
             f"fresh model; medians. Stages as in `bench/vs_pipelining.py` (2 for 1f1b, 4 in a "
             f"V for zb-v); torch with gloo's I/O threads at our priority (the default "
             f"group's, which ours sets), so that only the cache differs. Page faults: minor "
             f"faults of each rank's process over the timed "
             f"steps (getrusage), an independent count of memory faulted in; resident memory "
             f"from /proc at the end of the timed steps. Whole run {wall / 60:.1f} min."]
    outro = ["Ours without the cache against torch is the runtime alone; ours against ours "
             "without it is the cache's own worth. torch runs with malloc's behaviour, as a "
             "script of its own would; given the same cache (or malloc told to keep its "
             "memory: MALLOC_MMAP_MAX_=0 and a large MALLOC_TRIM_THRESHOLD_), its steps lose "
             "their page faults as well."]
    if args.out:
        harness.write_results(args.out, "The CPU block cache: page faults and speed, model A",
                              intro, header, markdown_rows(rows), outro,
                              {"settings": sz, "machine": harness.machine_info(), "rows": rows,
                               "wall_s": wall})
    else:
        print("\n".join(harness.markdown_table(header, markdown_rows(rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
