"""GPU microbenchmarks of the C++ core: weight-version offload and the queue's stream hand-off.

Step 'micro' of bench/gpu_check.sh (needs a CUDA build: `_C.cuda_enabled`).
(a) A `--stage-mb` stage: WeightRing(offload=True) snapshot (to pinned host) and tensors(v)
    (back) against plain copies to pageable and pinned host memory and back, an on-device ring
    and a flat device copy; each call timed alone between synchronizes; medians.
(b) Producer stream to consumer stream: ActivationQueue push/pop (an event, no copy) against
    wait_stream + copy_ and wait_stream alone (the floor), all ending with record_stream.

    python bench/gpu_micro.py [--out FILE.md]
    python bench/gpu_micro.py --device cpu --stage-mb 8 --sizes-kib 64   # smoke test, no GPU

Exit status: 0, 1 when a check failed, 2 when the device is not there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpu_pipeline import cuda_device, sync  # a sibling: also puts the repository on sys.path

import harness  # noqa: E402 - a sibling
from pipedream_fast import _C  # noqa: E402

WIDTH = 1024
MB = 1 << 20
REPS, ROUNDS = 5, 4  # (a): timed calls per round, interleaved rounds
HANDOFFS, REPEATS = 200, 5  # (b): rounds per run, runs per variant
Variants = dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]


class Device:
    """The CUDA calls the benchmarks make, as no-ops on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device) if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, consumer: Any, producer: Any) -> None:
        if self.cuda:
            consumer.wait_stream(producer)

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        if self.cuda:
            tensor.record_stream(stream)


def timed_calls(variants: Variants, device: torch.device,
                warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each variant: (call, untimed set-up run before each call or None)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for call, setup in variants.values():
        for _ in range(warmup):
            if setup:
                setup()
            call()
        sync(device)
    for _ in range(ROUNDS):
        for name, (call, setup) in variants.items():
            for _ in range(REPS):
                if setup:
                    setup()
                sync(device)
                start = time.perf_counter()
                call()
                sync(device)
                times[name].append(time.perf_counter() - start)
    return times


def stage(dev: Device, megabytes: float) -> tuple[nn.Module, int]:
    layers = max(1, round(megabytes * MB / (4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(dev.device)
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def weight_versions(dev: Device, megabytes: float) -> tuple[str, bool]:
    """(a): the report's section, and whether the offloaded version held its snapshot."""
    offload_stage, nbytes = stage(dev, megabytes)
    device_stage, _ = stage(dev, megabytes)
    flat = torch.randn(nbytes // 4, device=dev.device)
    flat_dst = torch.empty_like(flat)
    pageable = torch.empty(flat.shape, dtype=flat.dtype)
    ok = True
    device_ring = _C.WeightRing(list(device_stage.parameters()), 2, offload=False)
    variants: Variants = {
        "WeightRing(offload=False).snapshot(): on the device": (
            lambda: device_ring.release(device_ring.snapshot()), None),
        "flat device dst.copy_(src), same bytes": (lambda: flat_dst.copy_(flat), None),
        "host pageable .copy_(device)": (lambda: pageable.copy_(flat), None)}
    if dev.cuda:
        pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        ring = _C.WeightRing(list(offload_stage.parameters()), 2, offload=True)
        held: list[int] = []

        def take_version() -> None:
            for v in held:
                ring.release(v)
            held.clear()
            held.append(ring.snapshot())

        variants["WeightRing(offload=True).snapshot(): device -> pinned host"] = (
            lambda: ring.release(ring.snapshot()), None)
        variants["WeightRing(offload=True).tensors(v): pinned host -> device"] = (
            lambda: ring.tensors(held[0]), take_version)
        variants["host pinned .copy_(device)"] = (lambda: pinned.copy_(flat), None)
        variants["device .copy_(pinned host)"] = (lambda: flat_dst.copy_(pinned), None)

        # The offloaded version must hold the weights of its snapshot, not later ones.
        params = list(offload_stage.parameters())
        expected = [p.detach().clone() for p in params]
        for v in held:
            ring.release(v)
        held.clear()
        version = ring.snapshot()
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
        ok = all(torch.equal(g, e) for g, e in zip(ring.tensors(version), expected))
        ring.release(version)
        print(f"offloaded version equals its snapshot: {ok}", flush=True)

    times = timed_calls(variants, dev.device)
    base = statistics.median(times["host pageable .copy_(device)"])
    rows = [(name, f"{median * 1e3:.3f}", f"{nbytes / median / 1e9:.1f}", f"{base / median:.2f}x")
            for name, median in ((n, statistics.median(s)) for n, s in times.items())]
    layers = len(list(offload_stage.children()))
    text = "\n".join([
        f"### (a) Weight versions of a {nbytes / MB:.0f} MiB stage ({layers} x Linear({WIDTH}, "
        f"{WIDTH}), float32)", "",
        f"Median of {ROUNDS} rounds x {REPS} calls per variant, each call synchronized alone."
        + ("" if dev.cuda else " CPU smoke run: the pinned-memory and offload rows need CUDA."),
        "", *harness.markdown_table(["variant", "median ms", "GB/s", "vs pageable copy_"], rows)])
    if dev.cuda:
        text += (f"\n\nOffloaded version equals its snapshot after the live weights changed: "
                 f"{'yes' if ok else 'NO'}")
    return text, ok


def handoff(dev: Device, kib: int) -> tuple[list[tuple[str, float]], bool]:
    """(b) at one size: microseconds per hand-off of each variant; whether every run was right."""
    src = torch.randn(max(1, kib * 1024 // 4), device=dev.device)
    producer, consumer = dev.stream(), dev.stream()
    queue = _C.ActivationQueue(4, "gpu_micro")
    buffer = torch.empty_like(src)

    # Each variant ends with record_stream: `out` was allocated on the producer stream and is
    # dropped after the round, so without it the allocator could hand its memory to the next
    # round's producer kernel while the consumer still reads it.
    def via_queue(out: torch.Tensor) -> torch.Tensor:
        queue.push([out], microbatch=0)
        with dev.on(consumer):
            received = queue.pop(timeout=10).tensors[0]
            dev.record(received, consumer)
            return received

    def via_copy(out: torch.Tensor) -> torch.Tensor:
        with dev.on(consumer):
            dev.wait(consumer, producer)
            buffer.copy_(out)
            dev.record(out, consumer)
            return buffer

    def via_wait(out: torch.Tensor) -> torch.Tensor:
        with dev.on(consumer):
            dev.wait(consumer, producer)
            dev.record(out, consumer)
            return out

    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ActivationQueue push/pop (event, no copy)": via_queue,
        "wait_stream + copy_ into a consumer buffer": via_copy,
        "wait_stream + record_stream, no copy (floor)": via_wait}

    def run(hand: Callable[[torch.Tensor], torch.Tensor], count: int) -> tuple[float, bool]:
        with dev.on(consumer):
            acc = torch.zeros_like(src)
        sync(dev.device)
        start = time.perf_counter()
        for i in range(count):
            with dev.on(producer):
                out = src * float(i + 1)  # a new value each round: a stale read shows in acc
                # A hand-off sees the producer stream as current, as a stage's thread does.
                received = hand(out)
            with dev.on(consumer):
                acc.add_(received)
        sync(dev.device)
        elapsed = time.perf_counter() - start
        right = torch.allclose(acc, src * float(count * (count + 1) // 2), rtol=1e-4, atol=1e-3)
        return elapsed / count * 1e6, right

    for hand in variants.values():  # warm-up: allocations, stream and event creation
        run(hand, 10)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    ok = True
    for _ in range(REPEATS):
        for name, hand in variants.items():
            us, right = run(hand, HANDOFFS)
            samples[name].append(us)
            ok = ok and right
    return [(name, statistics.median(s)) for name, s in samples.items()], ok


def stream_handoff(dev: Device, sizes_kib: list[int]) -> tuple[str, bool]:
    rows, ok = [], True
    for kib in sizes_kib:
        results, right = handoff(dev, kib)
        ok = ok and right
        copy_us = results[1][1]
        size = f"{kib} KiB" if kib < 1024 else f"{kib / 1024:g} MiB"
        rows += [(size, name, f"{us:.1f}", f"{copy_us / us:.2f}x") for name, us in results]
        print(f"hand-off {size}: " + ", ".join(f"{name}: {us:.1f} us" for name, us in results)
              + ("" if right else "  WRONG RESULT"), flush=True)
    text = "\n".join([
        "### (b) Hand-off from a producer stream to a consumer stream", "",
        f"Per round: producer `out = src * k`, the hand-off, consumer `acc += received` (each "
        f"variant ends with `record_stream`); {HANDOFFS} rounds per run, one thread, host clock "
        f"with a synchronize at both ends; median of {REPEATS} runs."
        + ("" if dev.cuda else " CPU smoke run: no streams."), "",
        "| size | variant | us per hand-off | vs wait_stream + copy_ |",
        "| ---: | --- | ---: | ---: |", *("| " + " | ".join(row) + " |" for row in rows), "",
        f"Every run's result checked: {'right' if ok else 'WRONG'}"])
    return text, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--stage-mb", type=float, default=256.0,
                        help="weight bytes of the stage in (a), MiB (default 256)")
    parser.add_argument("--sizes-kib", default="512,65536",
                        help="(b): activation sizes, KiB, comma-separated (default 512,65536)")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    device = cuda_device("gpu_micro", args.device)
    if device is None:
        return 2
    if device.type == "cuda" and not _C.cuda_enabled:
        print("gpu_micro: pipedream_fast._C was built without CUDA; rebuild with FORCE_CUDA=1 "
              "(see bench/gpu_check.sh)", file=sys.stderr)
        return 2
    dev = Device(device)
    machine = f"{harness.device_line(device)}; pipedream_fast._C.cuda_enabled = {_C.cuda_enabled}"
    print(f"gpu_micro: {machine}", flush=True)
    sections, ok = [], True
    for name, part in (("(a) weight versions", lambda: weight_versions(dev, args.stage_mb)),
                       ("(b) stream hand-off", lambda: stream_handoff(
                           dev, [int(s) for s in args.sizes_kib.split(",") if s.strip()]))):
        start = time.perf_counter()
        print(f"-- {name}", flush=True)
        text, right = part()
        print(f"-- {name}: {time.perf_counter() - start:.1f} s", flush=True)
        sections.append(text)
        ok = ok and right
    print()
    harness.emit(args.out, "\n\n".join([
        "## Core microbenchmarks on the GPU", f"Command: `{harness.command()}`",
        f"Machine: {machine}.", *sections]) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
