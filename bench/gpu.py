"""The GPU benchmarks of bench/gpu_check.sh, one `--set` per step; each checks what it measures.

pipeline: model A cut at block 6, 1f1b, 4 microbatches, both rank threads on one device: the
  weights equal single-process training with the same gradient accumulation; then samples/s.
memory: each rank's peak as counted at the tensors, as `sim_memory` predicts it (within 10%)
  and as the CUDA caching allocator saw it (not below the count).
micro (CUDA only): WeightRing offload against plain host copies; the ActivationQueue's stream
  hand-off against wait_stream + copy_ and wait_stream alone.
zoo: tests/zoo's transformers through Pipeline (NCCL): each step's loss equals the one-process
  loop's, and the tied embedding and head stay one weight.

Exit status: 0 passed; 1 a check failed; 2 no CUDA GPU (or no CUDA build of _C, no NCCL).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/gpu.py` from anywhere
    sys.path.insert(0, str(ROOT))

from pipedream_fast import Tuning, _C  # noqa: E402
from pipedream_fast.data_feed import to_device  # noqa: E402
from pipedream_fast.formats import Plan, StagePlan  # noqa: E402
from pipedream_fast.launch import launch  # noqa: E402
from pipedream_fast.models import build_cnn  # noqa: E402
from pipedream_fast.training import model_loss, split_microbatches  # noqa: E402

import harness  # noqa: E402 - a sibling

TIMEOUT = 60.0  # s, the pipelines' and collectives' timeout on any one wait
LR = 0.01


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def numerics(device: torch.device, deterministic: bool = False, cudnn_tf32: bool = False) -> None:
    """cuDNN's settings and no matmul TF32 on a GPU (torch's defaults: cudnn_tf32=True)."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.backends.cuda.matmul.allow_tf32 = False


def report_head(title: str, machine: str) -> list[str]:
    return [f"## {title}", "", f"Command: `{harness.command()}`", "", f"Machine: {machine}.", ""]


# ==== pipeline: model A, 2-stage 1f1b on one device, against a single process ==================
SPLIT, BLOCKS = 6, 9  # model A's blocks: 6 convolutions | 3 linear layers
SCHEDULE, CHUNKS = "1f1b", 4
# minibatch, minibatches checked, minibatches timed (warm-up included), warm-up; by --quick
SIZES = {False: (64, 4, 40, 5), True: (8, 2, 3, 1)}
ATOL, RTOL = 2e-5, 1e-4  # as tests/test_runtime.py
loss_fn = nn.functional.cross_entropy
sgd = functools.partial(torch.optim.SGD, lr=LR)


def model_a() -> nn.Module:
    torch.manual_seed(0)  # built on the CPU: the same initial weights in every contender
    return build_cnn()


def check_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def single_process(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   chunks: int, device: torch.device) -> Iterator[None]:
    """Training with gradient accumulation (tests/runtime_reference.py's), yielding per step."""
    opt = sgd(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        for xs, ys in zip(x.to(device).chunk(chunks), y.to(device).chunk(chunks)):
            (loss_fn(model(xs), ys) / chunks).backward()
        opt.step()
        yield


def timed(steps_done: Iterator[Any], batch: int, steps: int, warmup: int,
          device: torch.device) -> float:
    """Samples/s over the steps after `warmup`, from an iterator yielding once per step."""
    start, count = None, 0
    for i, _ in enumerate(steps_done):
        count = i + 1
        if i == warmup - 1:
            sync(device)
            start = time.perf_counter()
    sync(device)
    if start is None or count != steps:
        raise RuntimeError(f"the pipeline yielded {count} of {steps} steps")
    return batch * (steps - warmup) / (time.perf_counter() - start)


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, float, str]:
    """Whether every tensor is within ATOL + RTOL |ref|; the largest difference and its key."""
    if set(got) != set(want):
        return False, float("inf"), f"keys differ: {sorted(set(want) ^ set(got))[:4]}"
    worst, worst_key, ok = 0.0, "", True
    for key, ref in want.items():
        value, ref = got[key].double(), ref.double()
        if value.shape != ref.shape or not torch.isfinite(value).all():
            return False, float("inf"), f"{key}: shape {tuple(value.shape)} or not finite"
        diff = (value - ref).abs()
        ok = ok and bool((diff <= ATOL + RTOL * ref.abs()).all())
        largest = float(diff.max()) if diff.numel() else 0.0
        if largest >= worst:
            worst, worst_key = largest, key
    return ok, worst, worst_key


def pipeline_main(args: argparse.Namespace, device: torch.device) -> int:
    t0 = time.perf_counter()
    numerics(device, deterministic=True)
    model = model_a().to(device)
    list(single_process(model, check_batches(args.batch, args.check_steps), CHUNKS, device))
    want = cpu_state(model.state_dict())
    initial = cpu_state(model_a().state_dict())
    moved = max(float((want[k].double() - initial[k].double()).abs().max()) for k in want)
    print(f"reference: the weights moved by up to {moved:.3g} in {args.check_steps} steps "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    # LocalPipeline, both rank threads on `device`: a check run (strict numerics), a timed one
    from pipedream_fast.local_pipeline import LocalPipeline

    plan = Plan(model="cnn", batch_size=args.batch, workers=2, schedule=SCHEDULE,
                stages=[StagePlan(0, SPLIT, 1, (0,), 1.0), StagePlan(SPLIT, BLOCKS, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)

    def make() -> LocalPipeline:
        return LocalPipeline(model_a().to(device), loss_fn, sgd, plan, schedule=SCHEDULE,
                             chunks=CHUNKS, timeout=TIMEOUT, device=str(device))

    t0 = time.perf_counter()
    what = (f"LocalPipeline: 2 ranks as threads of one process, activation queues, both "
            f"stages on {device}")
    rate = max_abs = None
    try:
        pipe = make()
        list(pipe.train(check_batches(args.batch, args.check_steps), steps=args.check_steps))
        ok, max_abs, key = compare(cpu_state(pipe.state_dict()), want)
        status, note = "match" if ok else "differs", f"largest difference in {key}"
        numerics(device, cudnn_tf32=True)
        timing = check_batches(args.batch, 1) * args.steps  # one batch, read again: data is free
        pipe = make()  # the check run's pipeline released first
        rate = timed(pipe.train(timing, steps=args.steps), args.batch, args.steps, args.warmup,
                     device)
    except Exception as err:  # noqa: BLE001 - reported
        status, note, max_abs = "failed", f"{type(err).__name__}: {err}", None
    print(f"threads: {status}" + ("" if max_abs is None else f", max |w - w_ref| = {max_abs:.3g}")
          + f"; {note}" + ("" if rate is None else f"; {rate:.1f} samples/s")
          + f" ({time.perf_counter() - t0:.1f} s)", flush=True)

    numerics(device, cudnn_tf32=True)
    rates = [(f"single process, {kind}", timed(single_process(
        model_a().to(device), check_batches(args.batch, 1) * args.steps, chunks, device),
        args.batch, args.steps, args.warmup, device))
        for kind, chunks in (("whole minibatch", 1),
                             (f"{CHUNKS}-way gradient accumulation", CHUNKS))]
    rates += [(f"pipedream_fast {SCHEDULE}, threads: {what}", rate)] if rate is not None else []
    passed = status == "match" and moved > 10 * ATOL
    teeth = "." if moved > 10 * ATOL else " (too little: the check has no teeth)."
    lines = report_head(f"Model A, 2-stage {SCHEDULE} on one device: weights and samples/s",
                        harness.device_line(device))
    lines += [f"Weights after {args.check_steps} minibatches of {args.batch} samples ({CHUNKS} "
              f"microbatches each), SGD lr {LR}, against single-process training with the same "
              f"gradient accumulation (deterministic cuDNN, no TF32); pass: every tensor within "
              f"atol {ATOL:g} + rtol {RTOL:g}. The reference weights moved by up to {moved:.3g} "
              f"from their start{teeth}", "",
              "| transport | what | outcome | max abs difference | note |",
              "| --- | --- | --- | ---: | --- |",
              f"| threads | {what} | {status} | {harness.fmt(max_abs, '.3g', '')} | "
              f"{note.replace('|', '/')} |", "",
              f"Throughput: {args.steps - args.warmup} minibatches of {args.batch} after "
              f"{args.warmup} warm-up ones, torch's default numerics.", ""]
    lines += harness.markdown_table(["contender", "samples/s", "vs single process"],
                                    [(name, f"{r:.1f}", f"{r / rates[0][1]:.2f}x")
                                     for name, r in rates])
    print()
    harness.emit(args.out, "\n".join([*lines, "", f"Result: {'PASS' if passed else 'FAIL'}"])
                 + "\n")
    return 0 if passed else 1


# ==== memory: counted at the tensors, predicted, and by the CUDA caching allocator =============
MEMORY_CASES = (("cnn", "1f1b", 4), ("cnn", "gpipe", 4), ("cnn", "pipedream", 1),
                ("charlm", "1f1b", 4), ("charlm", "pipedream", 1))


def memory_main(args: argparse.Namespace, device: torch.device) -> int:
    import memory as mem  # a sibling: bench/memory.py's models, batches, plans and prediction
    from pipedream_fast.pipeline import Pipeline

    on_cuda = args.device.startswith("cuda")
    rows, failures = [], []
    for name, schedule, chunks in MEMORY_CASES:
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(args.device)
        pipe = Pipeline(mem.model(name), mem.loss_for(name),
                        lambda ps: torch.optim.Adam(ps, lr=1e-4),
                        plan=mem.plan_for(name, schedule, 2, chunks), schedule=schedule,
                        chunks=chunks, ranks="threads", workers=2, device=args.device,
                        measure_memory=True, timeout=120)
        try:
            list(pipe.train(mem.batches(name), steps=mem.STEPS))
            memory = pipe.memory
        finally:
            pipe.close()
        allocator = torch.cuda.max_memory_allocated(args.device) if on_cuda else 0
        prediction = mem.predicted(name, schedule, chunks, mem.plan_for(name, schedule, 2, chunks))
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
        harness.write_results(
            args.out, "Memory on the GPU: counted, predicted, allocated",
            [f"Minibatch {mem.BATCH}, {mem.STEPS} steps, Adam, 2 stages cut evenly, two rank "
             f"threads on {args.device}. Counted: `measure_memory` (the storages each rank's "
             f"stages hold). Predicted: `sim_memory` from a profile at the microbatch. "
             f"Allocator: `max_memory_allocated` of the device, both ranks."],
            ["model", "schedule", "counted peak per rank (MiB)", "predicted error per rank",
             "allocator peak, device (MiB)", "allocator / counted"], rows,
            failures or ["Every rank's prediction within 10% of the tensors counted."])
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


# ==== micro: weight-version offload and the queue's stream hand-off ============================
WIDTH, MB = 1024, 1 << 20
STAGE_MB, REPS, ROUNDS = 256.0, 5, 4  # (a): the stage's weights; calls per round; rounds
SIZES_KIB, HANDOFFS, REPEATS = (512, 65536), 200, 5  # (b): activations; rounds per run; runs
Variants = dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]


def timed_calls(variants: Variants, device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each variant: (call, untimed set-up run before each call or None)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for call, setup in variants.values():
        for _ in range(2):  # warm-up
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


def stage(device: torch.device, megabytes: float) -> tuple[nn.Module, int]:
    layers = max(1, round(megabytes * MB / (4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def weight_versions(device: torch.device, megabytes: float) -> tuple[str, bool]:
    """(a): the report's section, and whether the offloaded version held its snapshot."""
    offload_stage, nbytes = stage(device, megabytes)
    device_stage, _ = stage(device, megabytes)
    flat = torch.randn(nbytes // 4, device=device)
    flat_dst = torch.empty_like(flat)
    pageable = torch.empty(flat.shape, dtype=flat.dtype)
    device_ring = _C.WeightRing(list(device_stage.parameters()), 2, offload=False)
    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    ring = _C.WeightRing(list(offload_stage.parameters()), 2, offload=True)
    held: list[int] = []

    def take_version() -> None:
        for v in held:
            ring.release(v)
        held.clear()
        held.append(ring.snapshot())

    variants: Variants = {
        "WeightRing(offload=False).snapshot(): on the device": (
            lambda: device_ring.release(device_ring.snapshot()), None),
        "flat device dst.copy_(src), same bytes": (lambda: flat_dst.copy_(flat), None),
        "host pageable .copy_(device)": (lambda: pageable.copy_(flat), None),
        "WeightRing(offload=True).snapshot(): device -> pinned host": (
            lambda: ring.release(ring.snapshot()), None),
        "WeightRing(offload=True).tensors(v): pinned host -> device": (
            lambda: ring.tensors(held[0]), take_version),
        "host pinned .copy_(device)": (lambda: pinned.copy_(flat), None),
        "device .copy_(pinned host)": (lambda: flat_dst.copy_(pinned), None)}

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

    times = timed_calls(variants, device)
    base = statistics.median(times["host pageable .copy_(device)"])
    rows = [(name, f"{median * 1e3:.3f}", f"{nbytes / median / 1e9:.1f}", f"{base / median:.2f}x")
            for name, median in ((n, statistics.median(s)) for n, s in times.items())]
    layers = len(list(offload_stage.children()))
    text = "\n".join([
        f"### (a) Weight versions of a {nbytes / MB:.0f} MiB stage ({layers} x Linear({WIDTH}, "
        f"{WIDTH}), float32)", "",
        f"Median of {ROUNDS} rounds x {REPS} calls per variant, each call synchronized alone.",
        "", *harness.markdown_table(["variant", "median ms", "GB/s", "vs pageable copy_"], rows),
        "", f"Offloaded version equals its snapshot after the live weights changed: "
        f"{'yes' if ok else 'NO'}"])
    return text, ok


def handoff(device: torch.device, kib: int) -> tuple[list[tuple[str, float]], bool]:
    """(b) at one size: microseconds per hand-off of each variant; whether every run was right."""
    src = torch.randn(max(1, kib * 1024 // 4), device=device)
    producer, consumer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    queue = _C.ActivationQueue(4, "gpu_micro")
    buffer = torch.empty_like(src)

    # Each variant ends with record_stream: else the allocator could hand `out` (made on the
    # producer stream, dropped after the round) to the next round while the consumer reads it.
    def via_queue(out: torch.Tensor) -> torch.Tensor:
        queue.push([out], microbatch=0)
        with torch.cuda.stream(consumer):
            received = queue.pop(timeout=10).tensors[0]
            received.record_stream(consumer)
            return received

    def via_copy(out: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(consumer):
            consumer.wait_stream(producer)
            buffer.copy_(out)
            out.record_stream(consumer)
            return buffer

    def via_wait(out: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(consumer):
            consumer.wait_stream(producer)
            out.record_stream(consumer)
            return out

    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ActivationQueue push/pop (event, no copy)": via_queue,
        "wait_stream + copy_ into a consumer buffer": via_copy,
        "wait_stream + record_stream, no copy (floor)": via_wait}

    def run(hand: Callable[[torch.Tensor], torch.Tensor], count: int) -> tuple[float, bool]:
        with torch.cuda.stream(consumer):
            acc = torch.zeros_like(src)
        sync(device)
        start = time.perf_counter()
        for i in range(count):
            with torch.cuda.stream(producer):
                out = src * float(i + 1)  # a new value each round: a stale read shows in acc
                # A hand-off sees the producer stream as current, as a stage's thread does.
                received = hand(out)
            with torch.cuda.stream(consumer):
                acc.add_(received)
        sync(device)
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


def stream_handoff(device: torch.device, sizes_kib: tuple[int, ...]) -> tuple[str, bool]:
    rows, ok = [], True
    for kib in sizes_kib:
        results, right = handoff(device, kib)
        ok = ok and right
        copy_us = results[1][1]
        size = f"{kib} KiB" if kib < 1024 else f"{kib / 1024:g} MiB"
        rows += [(size, name, f"{us:.1f}", f"{copy_us / us:.2f}x") for name, us in results]
    text = "\n".join([
        "### (b) Hand-off from a producer stream to a consumer stream", "",
        f"Per round: producer `out = src * k`, the hand-off, consumer `acc += received` (each "
        f"variant ends with `record_stream`); {HANDOFFS} rounds per run, one thread, host clock "
        f"with a synchronize at both ends; median of {REPEATS} runs.", "",
        "| size | variant | us per hand-off | vs wait_stream + copy_ |",
        "| ---: | --- | ---: | ---: |", *("| " + " | ".join(row) + " |" for row in rows), "",
        f"Every run's result checked: {'right' if ok else 'WRONG'}"])
    return text, ok


def micro_main(args: argparse.Namespace, device: torch.device) -> int:
    if device.type != "cuda" or not _C.cuda_enabled:
        print("gpu_micro: needs a CUDA GPU and pipedream_fast._C built with CUDA (FORCE_CUDA=1: "
              "see bench/gpu_check.sh)", file=sys.stderr)
        return 2
    machine = f"{harness.device_line(device)}; pipedream_fast._C.cuda_enabled = {_C.cuda_enabled}"
    print(f"gpu_micro: {machine}", flush=True)
    weights, weights_ok = weight_versions(device, STAGE_MB)
    streams, streams_ok = stream_handoff(device, SIZES_KIB)
    print()
    harness.emit(args.out, "\n".join([*report_head("Core microbenchmarks on the GPU", machine),
                                      weights, "", streams]) + "\n")
    return 0 if weights_ok and streams_ok else 1


# ==== zoo: the zoo's transformers through Pipeline (NCCL) against a one-process loop ===========
MODELS = ("nanogpt", "llama", "gpt2", "bert")
ZOO_STEPS = 3  # minibatches per model: the first step and the later ones are checked
ZOO_SPLIT = {"nanogpt": "transformer.h.1", "llama": "model.layers.1", "gpt2": "transformer.h.1",
             "bert": "bert.encoder.layer.1"}
TIED = {"nanogpt": "transformer.wte.weight", "llama": "model.embed_tokens.weight",
        "gpt2": "transformer.wte.weight"}  # the embedding, one parameter with the head
ZOO_CHUNKS, MOMENTUM = 2, 0.9
ZOO_RTOL = {"cuda": 1e-4, "cpu": 1e-5}  # losses, relative; CUDA: other kernels' summation orders
TIED_TOL = 1e-6  # relative: the embedding and the head must be one weight on both ranks
sgd_momentum = functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM)


def load_zoo(models: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """The zoo's entries (.build(), .batches(steps, seed)) for `models`; those skipped, why."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    try:
        import zoo  # needs torchvision (the image's 'cuda' has it)
    except ImportError as err:
        return {}, {m: f"the zoo cannot be imported here ({err})" for m in models}
    transformers = importlib.util.find_spec("transformers") is not None
    why = "transformers is not installed (GPU_CHECK_WHEELS)"
    return ({m: zoo.ZOO[m] for m in models if m == "nanogpt" or transformers},
            {m: why for m in models if m != "nanogpt" and not transformers})


def reference(entry: Any, steps: int, device: torch.device) -> list[float]:
    """The one-process loop's losses, with 1f1b's gradient accumulation; no TF32, as the ranks."""
    from zoo import call  # the model on one microbatch, as a user's loop calls it

    numerics(device)
    model = entry.build().to(device).train()
    opt, losses = sgd_momentum(model.parameters()), []
    for item in entry.batches(steps, 1):
        opt.zero_grad()
        total = 0.0
        for mb in split_microbatches(to_device(item, device), ZOO_CHUNKS):
            loss = model_loss(call(model, mb))
            (loss / ZOO_CHUNKS).backward()
            total += float(loss.detach()) / ZOO_CHUNKS
        opt.step()
        losses.append(total)
    return losses


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    device: str  # "cpu", "cuda:0", or "default" (Pipeline's choice: cuda:LOCAL_RANK)
    one_stage: bool = False
    what: str = ""
    split_channels: bool = False  # Tuning.split_channels: the gradients on a group of their own


def layout_for(device: torch.device) -> Layout:
    """gloo on the CPU; one rank per GPU; on one GPU (NCCL refuses two ranks), 1 rank, 1 stage."""
    if device.type == "cpu":
        return Layout("pipeline", 2, "cpu", what="2 rank processes, gloo, CPU")
    if torch.cuda.device_count() >= 2:
        return Layout("pipeline", 2, "default",
                      what="2 rank processes, NCCL, one GPU each (Pipeline's default device)")
    return Layout("one-rank", 1, "cuda:0", one_stage=True,
                  what="1 rank, NCCL, cuda:0, stages=1 (no cut: what one GPU allows)")


def zoo_rank(rank: int, world: int, layout: Layout, models: list[str], steps: int,
             timeout: float) -> dict[str, Any]:
    """Each model on a fresh process group: a Pipeline trained for `steps` minibatches; its
    losses, set-up and step times, and this rank's copy of the tied weight (or its error)."""
    from pipedream_fast.pipeline import Pipeline

    entries, _ = load_zoo(tuple(models))
    cuda = layout.device != "cpu"
    device = None if layout.device == "default" else torch.device(layout.device)
    if cuda:
        # NCCL works on the current device. Pipeline's default is cuda:LOCAL_RANK: set it where
        # it exists, and leave a missing one for Pipeline to meet itself.
        index = device.index if device is not None else int(os.environ.get("LOCAL_RANK", rank))
        if index is not None and index < torch.cuda.device_count():
            torch.cuda.set_device(index)
    else:
        torch.set_num_threads(1)
    numerics(torch.device("cuda" if cuda else "cpu"))
    out: dict[str, Any] = {}
    for number, name in enumerate(models):
        began = time.perf_counter()
        try:
            harness.fresh_group(rank, world, number, "nccl" if cuda else "gloo", timeout)
            split: dict[str, Any] = ({"stages": 1} if layout.one_stage
                                     else {"split_points": [ZOO_SPLIT[name]]})
            model = entries[name].build()
            tied = dict(model.named_parameters(remove_duplicate=False)).get(TIED.get(name, ""))
            pipe = Pipeline(model, loss_fn=None, optimizer=sgd_momentum, schedule="1f1b",
                            chunks=ZOO_CHUNKS, timeout=timeout, device=device,
                            tuning=Tuning(split_channels=layout.split_channels), **split)
            losses, first = [], time.perf_counter()
            for step, loss in enumerate(pipe.train(entries[name].batches(steps, 1), steps=steps)):
                losses.append(float(loss) if loss is not None else None)
                if step == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    first = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
            held = {id(p) for m in pipe.stage_modules.values() for p in m.parameters()}
            result: dict[str, Any] = {
                "losses": losses, "device": str(pipe.device), "backend": dist.get_backend(),
                "setup_s": first - began,
                "step_s": (time.perf_counter() - first) / max(1, steps - 1)}
            if tied is not None and id(tied) in held:
                result["tied"] = tied.detach().to("cpu", copy=True)
            pipe.close()
            out[name] = result
        except Exception as err:  # noqa: BLE001 - reported in the table
            traceback.print_exc()  # into the log; the table gets the error
            out[name] = {"error": harness.shorten(err, 300)}
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


@dataclass
class Row:
    layout: str
    model: str
    outcome: str  # match | differs | failed | skipped
    loss_rel_diff: float | None = None
    tied_rel_diff: float | None = None
    note: str = ""
    timing: str = ""


def run_layout(layout: Layout, models: list[str], want: dict[str, list[float]],
               rtol: float) -> list[Row]:
    """The layout's job (every wait bounded by TIMEOUT) and a row per model."""
    began = time.perf_counter()
    try:
        by_rank = launch(zoo_rank, layout.world, layout, models, ZOO_STEPS, TIMEOUT,
                         timeout=TIMEOUT, threads_per_rank=None if layout.device != "cpu" else 1)
    except Exception as err:  # noqa: BLE001 - a rank died: the whole layout failed
        harness.unless_stopped(err)
        return [Row(layout.name, m, "failed", note=harness.shorten(err, 500)) for m in models]
    print(f"  {layout.name}: {time.perf_counter() - began:.1f} s", flush=True)
    rows = []
    for name in models:
        results = [r[name] for r in by_rank]
        errors = [f"rank {k}: {r['error']}" for k, r in enumerate(results) if "error" in r]
        if errors:
            rows.append(Row(layout.name, name, "failed", note="; ".join(errors)))
            continue
        note = f"{results[-1]['backend']} on {', '.join(r['device'] for r in results)}"
        losses = results[-1]["losses"]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want[name]))
        ok = len(losses) == len(want[name]) and diff <= rtol
        tied_diff = None
        if name in TIED and layout.world > 1:
            first, last = results[0].get("tied"), results[-1].get("tied")
            if first is None or last is None:
                ok = False
                note += "; the tied weight was not found on both ranks"
            else:
                tied_diff = float((first - last).abs().max()) / max(float(last.abs().max()), 1e-12)
                ok = ok and tied_diff <= TIED_TOL
        timing = (f"set-up {max(r['setup_s'] for r in results):.1f} s, "
                  f"{max(r['step_s'] for r in results) * 1e3:.0f} ms/step")
        rows.append(Row(layout.name, name, "match" if ok else "differs", diff, tied_diff, note,
                        timing))
    return rows


def zoo_report(out: str | None, device: torch.device, layouts: list[Layout], rows: list[Row],
               rtol: float, final: bool) -> bool:
    """The markdown report (to --out, and printed when `final`); whether the check passed."""
    checked = [r for r in rows if r.outcome != "skipped"]
    passed = bool(checked) and all(r.outcome == "match" for r in checked)
    lines = report_head("The zoo's transformers through Pipeline, 1f1b, 2 stages: losses against "
                        "the one-process loop", harness.device_line(device))
    lines += [f"{ZOO_STEPS} minibatches of 8 per model, {ZOO_CHUNKS} microbatches, SGD lr {LR} "
              f"momentum {MOMENTUM}, split before the second layer; pass: every step's loss "
              f"within {rtol:g} (relative) of the loop on {device} with the same gradient "
              f"accumulation (no TF32), and the tied embedding and head identical on both ranks "
              f"(within {TIED_TOL:g}).", "",
              "Layouts: " + "; ".join(f"'{x.name}' = {x.what}" for x in layouts) + ".", "",
              "| layout | model | outcome | max loss rel diff | tied drift | time | note |",
              "| --- | --- | --- | ---: | ---: | --- | --- |"]
    lines += [f"| {r.layout} | {r.model} | {r.outcome} | {harness.fmt(r.loss_rel_diff, '.1e', '')}"
              f" | {harness.fmt(r.tied_rel_diff, '.1e', '')} | {r.timing} | "
              f"{r.note.replace('|', '/')} |" for r in rows]
    lines += ["", f"Result: {'PASS' if passed else 'FAIL'}" if final else
              "Result: (incomplete: the run did not finish)"]
    report = "\n".join(lines) + "\n"
    if final:
        print("\n" + report, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report)
    return passed


def zoo_main(args: argparse.Namespace, device: torch.device) -> int:
    if device.type == "cuda" and not dist.is_nccl_available():
        print("gpu_zoo: this torch has no NCCL", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    print(f"gpu_zoo: {harness.device_line(device)}; {gpus} GPU(s)", flush=True)
    t0 = time.perf_counter()
    entries, skipped = load_zoo(MODELS)
    ran = [m for m in MODELS if m in entries]
    want = {m: reference(entries[m], ZOO_STEPS, device) for m in ran}
    print(f"reference: the one-process loop for {', '.join(ran) or 'no model'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    rtol = ZOO_RTOL[device.type]
    rows = [Row("-", m, "skipped", note=why) for m, why in skipped.items()]
    layout = layout_for(device)
    layouts = [layout]
    if layout.world > 1:  # and once more with the gradients on a group of their own
        layouts.append(dataclasses.replace(
            layout, name=f"{layout.name}, split channels", split_channels=True,
            what=f"{layout.what}; Tuning(split_channels=True)"))
    zoo_report(args.out, device, layouts, rows, rtol, final=False)  # kept if the job is killed
    for each in layouts if ran else []:
        print(f"\n-- layout {each.name}: {each.what}", flush=True)
        for row in run_layout(each, ran, want, rtol):  # the table comes at the end
            print(f"  {row.model:8s} {row.outcome} {row.timing}", flush=True)
            rows.append(row)
    return 0 if zoo_report(args.out, device, layouts, rows, rtol, final=True) else 1


# ==== the command line ==========================================================================
SETS = {"pipeline": pipeline_main, "memory": memory_main, "micro": micro_main, "zoo": zoo_main}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", required=True, choices=SETS, help="which benchmark")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    parser.add_argument("--quick", action="store_true", help="pipeline: smoke-test sizes")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    args.batch, args.check_steps, args.steps, args.warmup = SIZES[args.quick]
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"gpu_{args.set}: no CUDA GPU (torch.cuda.is_available() is False); use "
                  "--device cpu for a smoke test", file=sys.stderr)
            return 2
        device = torch.device("cuda", device.index or 0)  # a bare "cuda": cuda:0
    return SETS[args.set](args, device)


if __name__ == "__main__":
    sys.exit(main())
