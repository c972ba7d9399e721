"""Memory on the GPU, counted at the tensors, predicted, and by the CUDA caching allocator.

Step 'memory' of bench/gpu_check.sh (issue 28, item 5). Model A and the char LM, 2 stages cut
evenly, two rank threads on one device: every rank's peak as `measure_memory` counts it, the
simulator's prediction (`sim_memory`), and the device's `max_memory_allocated` (both ranks, with
temporaries and workspaces). Fails when a prediction is over 10% off the count, or the
allocator's peak is below the tensors counted.

    python bench/gpu_memory.py [--device cuda] [--out gpu_memory.md]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from pipedream_fast.pipeline import Pipeline

from harness import write_results  # noqa: E402 - a sibling
from memory import BATCH, STEPS, batches, loss_for, model, plan_for, predicted  # noqa: E402

CASES = (("cnn", "1f1b", 4), ("cnn", "gpipe", 4), ("cnn", "pipedream", 1),
         ("charlm", "1f1b", 4), ("charlm", "pipedream", 1))


def measure(name: str, schedule: str, chunks: int, device: str) -> tuple[dict[int, Any], int]:
    """Every rank's memory as counted, and the device allocator's peak over the run."""
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    pipe = Pipeline(model(name), loss_for(name), lambda ps: torch.optim.Adam(ps, lr=1e-4),
                    plan=plan_for(name, schedule, 2, chunks), schedule=schedule, chunks=chunks,
                    ranks="threads", workers=2, device=device, measure_memory=True,
                    timeout=120)
    try:
        list(pipe.train(batches(name), steps=STEPS))
        memory = pipe.memory
    finally:
        pipe.close()
    return memory, torch.cuda.max_memory_allocated(device) if on_cuda else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    rows, failures = [], []
    for name, schedule, chunks in CASES:
        memory, allocator = measure(name, schedule, chunks, args.device)
        prediction = predicted(name, schedule, chunks, plan_for(name, schedule, 2, chunks))
        counted = [memory[r]["rank"]["total_peak"] for r in (0, 1)]
        errors = [prediction[r].total_peak / counted[r] - 1 for r in (0, 1)]
        rows.append((name, schedule, " / ".join(f"{c / 2**20:.2f}" for c in counted),
                     " / ".join(f"{e:+.1%}" for e in errors),
                     f"{allocator / 2**20:.2f}" if allocator else "-",
                     f"{allocator / sum(counted):.2f}" if allocator else "-"))
        print(f"{name} {schedule}: {rows[-1]}", flush=True)
        if max(abs(e) for e in errors) > 0.10:
            failures.append(f"{name} {schedule}: prediction off by {errors}")
        if allocator and allocator < sum(counted):
            failures.append(f"{name} {schedule}: the allocator's peak {allocator} is below "
                            f"the {sum(counted)} bytes of tensors counted")
    if args.out:
        write_results(
            args.out, "Memory on the GPU: counted, predicted, allocated",
            [f"Minibatch {BATCH}, {STEPS} steps, Adam, 2 stages cut evenly, two rank threads "
             f"on {args.device}. Counted: `measure_memory` (the storages each rank's stages "
             f"hold). Predicted: `sim_memory` from a profile at the microbatch. Allocator: "
             f"`max_memory_allocated` of the device, both ranks."],
            ["model", "schedule", "counted peak per rank (MiB)", "predicted error per rank",
             "allocator peak, device (MiB)", "allocator / counted"], rows,
            failures or ["Every rank's prediction within 10% of the tensors counted."])
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
