"""Model A as a 2-stage 1f1b pipeline on one device, against a single-process reference.

Step 'pipeline' of bench/gpu_check.sh. Model A (`build_cnn`) cut at block 6, SGD lr 0.01, 4
microbatches, over two transports: 'threads' (LocalPipeline, both ranks as threads) and 'procs'
(`pipedream-fast run --nproc 2`: NCCL on cuda, gloo on cpu; NCCL refusing two ranks on one GPU
is reported 'refused', not a failure). Check: after --check-steps minibatches the weights equal
single-process training with the same gradient accumulation (atol 2e-5, rtol 1e-4;
deterministic cuDNN, no TF32) and moved by far more. Then samples/s after --warmup of --steps.
Also holds what the GPU scripts share (`cuda_device`, `sync`, `NCCL_REFUSAL`).

    python bench/gpu_pipeline.py [--device cuda] [--out FILE.md]
    python bench/gpu_pipeline.py --device cpu --batch 8 --check-steps 2 --steps 3 --warmup 1

Exit status: 0 when every transport that ran matched and one ran; 1 otherwise; 2: no device.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/gpu_*.py` from anywhere
    sys.path.insert(0, str(ROOT))

from pipedream_fast.formats import Plan, StagePlan  # noqa: E402
from pipedream_fast.models import build_cnn  # noqa: E402

import harness  # noqa: E402 - a sibling

SPLIT, BLOCKS = 6, 9  # model A's blocks: 6 convolutions | 3 linear layers
SCHEDULE, CHUNKS, LR = "1f1b", 4, 0.01
ATOL, RTOL = 2e-5, 1e-4  # as tests/test_runtime.py
TIMEOUT = 60.0  # s, the pipelines' own timeout on any one wait
PROCS_TIMEOUT = 90.0  # s, the whole 'procs' transport
NCCL_REFUSAL = re.compile(r"Duplicate GPU detected|ncclInvalidUsage|invalid usage", re.IGNORECASE)
loss_fn = nn.functional.cross_entropy
sgd = functools.partial(torch.optim.SGD, lr=LR)


def cuda_device(script: str, name: str) -> torch.device | None:
    """`name` as a device, a bare "cuda" as cuda:0; None (said why) without a CUDA GPU."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA GPU (torch.cuda.is_available() is False); use --device cpu "
              "for a smoke test", file=sys.stderr)
        return None
    return device if device.index is not None else torch.device("cuda", 0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_a() -> nn.Module:
    torch.manual_seed(0)  # built on the CPU: the same initial weights in every contender
    return build_cnn()


def plan_for(batch: int) -> Plan:
    return Plan(model="cnn", batch_size=batch, workers=2, schedule=SCHEDULE,
                stages=[StagePlan(0, SPLIT, 1, (0,), 1.0), StagePlan(SPLIT, BLOCKS, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)


def check_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]


def numerics(device: torch.device, strict: bool) -> None:
    """strict: deterministic cuDNN, no TF32 (for the weight comparison); else torch's defaults."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.deterministic = strict
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not strict  # torch's default: True
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default: False


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def single_process(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   chunks: int, device: torch.device) -> Iterator[None]:
    """Plain training with gradient accumulation, yielding after each step: what a synchronous
    schedule must equal (tests/runtime_reference.py's train_reference, on `device`)."""
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
    start = None
    count = 0
    for i, _ in enumerate(steps_done):
        count = i + 1
        if i == warmup - 1:
            sync(device)
            start = time.perf_counter()
    sync(device)
    if start is None or count != steps:
        raise RuntimeError(f"the pipeline yielded {count} of {steps} steps")
    return batch * (steps - warmup) / (time.perf_counter() - start)


# ---- the transports ----------------------------------------------------------------------------

@dataclass
class Outcome:
    transport: str
    what: str
    status: str = "not run"  # ran | refused | failed, then match | differs
    note: str = ""
    state: dict[str, torch.Tensor] | None = None
    rate: float | None = None
    max_abs: float | None = None


def check_then_time(make: Callable[[], Any], args: argparse.Namespace, device: torch.device,
                    close: bool) -> dict[str, Any]:
    """The check run (strict numerics: weights) and the timed run, each on a fresh pipeline."""
    numerics(device, strict=True)
    pipe = make()
    list(pipe.train(check_batches(args.batch, args.check_steps), steps=args.check_steps))
    state = pipe.state_dict()  # Pipeline: collective, the whole model on rank 0
    out: dict[str, Any] = {"state": None if state is None else cpu_state(state)}
    if close:
        pipe.close()
    numerics(device, strict=False)
    pipe = make()
    timing = check_batches(args.batch, 1) * args.steps  # one batch, read again: data is free
    out["rate"] = timed(pipe.train(timing, steps=args.steps), args.batch, args.steps,
                        args.warmup, device)
    if close:
        pipe.close()
    return out


def run_threads(args: argparse.Namespace, device: torch.device) -> Outcome:
    """LocalPipeline, both rank threads on `device` (PipelineOptions.device)."""
    from pipedream_fast.local_pipeline import LocalPipeline

    got = check_then_time(lambda: LocalPipeline(
        model_a().to(device), loss_fn, sgd, plan_for(args.batch), schedule=SCHEDULE,
        chunks=CHUNKS, timeout=TIMEOUT, device=str(device)), args, device, close=False)
    return Outcome("threads", "LocalPipeline: 2 ranks as threads of one process, activation "
                   f"queues, both stages on {device}", "ran", state=got["state"], rate=got["rate"])


def rank_main(args: argparse.Namespace) -> int:
    """One rank under `pipedream-fast run`: the check and timed runs, into --result-dir."""
    import torch.distributed as dist

    from pipedream_fast.pipeline import Pipeline

    rank = int(os.environ["RANK"])
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    print(f"rank {rank}: {backend} on {device}", flush=True)
    dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT))
    try:
        result = check_then_time(lambda: Pipeline(
            model_a(), loss_fn, sgd, plan=plan_for(args.batch), schedule=SCHEDULE,
            chunks=CHUNKS, timeout=TIMEOUT, device=device), args, device, close=True)
        torch.save(result, Path(args.result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    return 0


def run_procs(args: argparse.Namespace, device: torch.device) -> Outcome:
    backend = "nccl" if device.type == "cuda" else "gloo"
    outcome = Outcome("procs", f"2 rank processes ({backend}), both stages' ranks on {device}")
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline.") as tmp:
        cmd = [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2",
               str(Path(__file__).resolve()), "--role", "rank", "--result-dir", tmp,
               "--device", args.device, "--batch", str(args.batch),
               "--check-steps", str(args.check_steps), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"),
                   PYTHONPATH=os.pathsep.join(p for p in path if p))
        print("$ " + " ".join(cmd), flush=True)
        # On our timeout, SIGTERM: the launcher forwards it to the ranks (PR_SET_PDEATHSIG).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT)
        try:
            text, _ = proc.communicate(timeout=PROCS_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                text, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                text, _ = proc.communicate()
            text += f"\n(stopped after {PROCS_TIMEOUT:g} s)"
        shown = text.rstrip().splitlines()[-40:]  # the end of the ranks' output
        print(textwrap.indent("\n".join(shown), "    "), flush=True)
        if proc.returncode != 0:
            refusal = NCCL_REFUSAL.search(text) if device.type == "cuda" else None
            if refusal:
                said = re.search(r"Duplicate GPU detected[^\n]*", text) or refusal
                outcome.status = "refused"
                outcome.note = "NCCL refused two ranks on one GPU: " + said.group(0)
            else:
                outcome.status = "failed"
                outcome.note = f"exit status {proc.returncode}: " + (shown[-1] if shown else "")
            return outcome
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    outcome.state = ranks[0].get("state")
    outcome.rate = ranks[-1]["rate"]  # the last stage's clock
    outcome.status = "ran"
    return outcome


# ---- comparison and report -------------------------------------------------------------------

def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, float, str]:
    """Whether every tensor is within ATOL + RTOL |ref|; the largest absolute difference and
    its key, or the first key that is missing, misshapen or not finite."""
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


def report(args: argparse.Namespace, device: torch.device, moved: float,
           outcomes: list[Outcome], rates: list[tuple[str, float]], passed: bool) -> str:
    teeth = "." if moved > 10 * ATOL else " (too little: the check has no teeth)."
    lines = [f"## Model A, 2-stage {SCHEDULE} on one device: weights and samples/s", "",
             f"Command: `{harness.command()}`", "", f"Machine: {harness.device_line(device)}.", "",
             f"Weights after {args.check_steps} minibatches of {args.batch} samples ({CHUNKS} "
             f"microbatches each), SGD lr {LR}, against single-process training with the same "
             f"gradient accumulation (deterministic cuDNN, no TF32); pass: every tensor within "
             f"atol {ATOL:g} + rtol {RTOL:g}. The reference weights moved by up to {moved:.3g} "
             f"from their start{teeth}", "",
             "| transport | what | outcome | max abs difference | note |",
             "| --- | --- | --- | ---: | --- |"]
    lines += [f"| {o.transport} | {o.what} | {o.status} | {harness.fmt(o.max_abs, '.3g', '')} | "
              f"{o.note.replace('|', '/')} |" for o in outcomes]
    lines += ["", f"Throughput: {args.steps - args.warmup} minibatches of {args.batch} after "
                  f"{args.warmup} warm-up ones, torch's default numerics.", "",
              "| contender | samples/s | vs single process |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {rate:.1f} | {rate / rates[0][1]:.2f}x |" for name, rate in rates]
    lines += ["", f"Result: {'PASS' if passed else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--batch", type=int, default=64, help="minibatch size (default 64)")
    parser.add_argument("--check-steps", type=int, default=4,
                        help="minibatches of the weight comparison (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="minibatches timed, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first minibatches")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--role", default="main", choices=("main", "rank"), help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "rank":
        return rank_main(args)
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps")
    if args.batch % CHUNKS:
        parser.error(f"--batch must be a multiple of {CHUNKS}")
    device = cuda_device("gpu_pipeline", args.device)
    if device is None:
        return 2
    args.device = str(device)
    print(f"gpu_pipeline: {harness.device_line(device)}", flush=True)

    t0 = time.perf_counter()
    numerics(device, strict=True)
    model = model_a().to(device)
    for _ in single_process(model, check_batches(args.batch, args.check_steps), CHUNKS, device):
        pass
    want = cpu_state(model.state_dict())
    initial = cpu_state(model_a().state_dict())
    moved = max(float((want[k].double() - initial[k].double()).abs().max()) for k in want)
    print(f"reference: {args.check_steps} steps of single-process training with {CHUNKS}-way "
          f"gradient accumulation; the weights moved by up to {moved:.3g} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)

    outcomes: list[Outcome] = []
    for name, runner in (("threads", run_threads), ("procs", run_procs)):
        t0 = time.perf_counter()
        print(f"\n-- transport {name}", flush=True)
        try:
            outcome = runner(args, device)
        except Exception as err:  # noqa: BLE001 - reported, and the next transport still runs
            outcome = Outcome(name, name, status="failed", note=f"{type(err).__name__}: {err}")
        if outcome.status == "ran":
            if outcome.state is None:
                outcome.status, outcome.note = "failed", "no weights came back"
            else:
                ok, outcome.max_abs, key = compare(outcome.state, want)
                outcome.status = "match" if ok else "differs"
                outcome.note = f"largest difference in {key}"
        print(f"transport {name}: {outcome.status}"
              + ("" if outcome.max_abs is None else f", max |w - w_ref| = {outcome.max_abs:.3g}")
              + (f"; {outcome.note}" if outcome.note else "")
              + (f"; {outcome.rate:.1f} samples/s" if outcome.rate is not None else "")
              + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
        outcomes.append(outcome)

    numerics(device, strict=False)
    rates = [(f"single process, {what}", timed(single_process(
        model_a().to(device), check_batches(args.batch, 1) * args.steps, chunks, device),
        args.batch, args.steps, args.warmup, device))
        for what, chunks in (("whole minibatch", 1),
                             (f"{CHUNKS}-way gradient accumulation", CHUNKS))]
    rates += [(f"pipedream_fast {SCHEDULE}, {o.transport}: {o.what}", o.rate)
              for o in outcomes if o.rate is not None]
    passed = (any(o.status == "match" for o in outcomes) and moved > 10 * ATOL
              and not any(o.status in ("differs", "failed") for o in outcomes))
    print()
    harness.emit(args.out, report(args, device, moved, outcomes, rates, passed))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
