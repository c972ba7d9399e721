"""Model A as a 2-stage pipeline on one device, against a single-process reference.

Step 'pipeline' of bench/gpu_check.sh; `--device cpu` (tiny sizes) tries it anywhere. Model A
(`build_cnn`) cut at block 6, SGD lr 0.01, `--schedule` 1f1b, `--chunks` microbatches, over two
transports (`--transports`): `threads` (LocalPipeline: both ranks as threads, activation queues)
and `procs` (`pipedream-fast run --nproc 2`: NCCL on cuda, gloo on cpu; NCCL refusing two ranks
on one GPU is reported 'refused', not a failure).

Correctness: after `--check-steps` minibatches the weights must equal single-process training
with the same gradient accumulation (atol 2e-5, rtol 1e-4; deterministic cuDNN, no TF32), and
must have moved by far more than that. Throughput: samples/s after `--warmup` of `--steps`
minibatches (host-side data), single process whole and accumulated, and each transport.

    python bench/gpu_pipeline.py [--device cuda] [--transports threads,procs] [--out FILE.md]
    python bench/gpu_pipeline.py --device cpu --batch 8 --check-steps 2 --steps 3 --warmup 1

Exit status: 0 when every transport that ran matched and one ran; 1 otherwise; 2: no device.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/gpu_pipeline.py` from anywhere
    sys.path.insert(0, str(ROOT))

from pipedream_fast.formats import Plan, StagePlan  # noqa: E402
from pipedream_fast.models import build_cnn  # noqa: E402

import harness  # noqa: E402 - a sibling

SPLIT, BLOCKS = 6, 9  # model A's blocks: 6 convolutions | 3 linear layers
LR = 0.01
ATOL, RTOL = 2e-5, 1e-4  # as tests/test_runtime.py
NCCL_REFUSAL = re.compile(r"Duplicate GPU detected|ncclInvalidUsage|invalid usage", re.IGNORECASE)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def model_a() -> nn.Module:
    torch.manual_seed(0)  # built on the CPU: the same initial weights in every contender
    return build_cnn()


def plan_for(batch: int, schedule: str) -> Plan:
    return Plan(model="cnn", batch_size=batch, workers=2, schedule=schedule,
                stages=[StagePlan(0, SPLIT, 1, (0,), 1.0), StagePlan(SPLIT, BLOCKS, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)


def check_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def timing_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return check_batches(batch, 1) * steps  # one batch, read again: data costs nothing


def numerics(device: torch.device, strict: bool) -> None:
    """strict: deterministic cuDNN, no TF32 (for the weight comparison); else torch's defaults."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.deterministic = strict
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not strict  # torch's default: True
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default: False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


# ---- single process -------------------------------------------------------------------------

def train_reference(batches: list[tuple[torch.Tensor, torch.Tensor]], chunks: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Plain training with gradient accumulation: what a synchronous schedule must equal
    (tests/runtime_reference.py's train_reference, on `device`)."""
    model = model_a().to(device)
    opt = sgd(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        for xs, ys in zip(x.to(device).chunk(chunks), y.to(device).chunk(chunks)):
            (loss_fn(model(xs), ys) / chunks).backward()
        opt.step()
    return cpu_state(model.state_dict())


def single_process_rate(batch: int, steps: int, warmup: int, chunks: int,
                        device: torch.device) -> float:
    """Samples/s of plain training on `device` (`chunks` > 1: with gradient accumulation)."""
    model = model_a().to(device)
    opt = sgd(model.parameters())
    x, y = timing_batches(batch, 1)[0]
    start = 0.0
    for i in range(steps):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        opt.zero_grad()
        for xs, ys in zip(x.to(device).chunk(chunks), y.to(device).chunk(chunks)):
            (loss_fn(model(xs), ys) / chunks).backward()
        opt.step()
    sync(device)
    return batch * (steps - warmup) / (time.perf_counter() - start)


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

def check_then_time(make: Callable[[], Any], args: argparse.Namespace, device: torch.device,
                    close: bool) -> dict[str, Any]:
    """The check run (strict numerics: losses, weights) and the timed run, each on a fresh
    pipeline from `make`."""
    numerics(device, strict=True)
    pipe = make()
    out: dict[str, Any] = {"losses": [
        float(loss) for loss in pipe.train(check_batches(args.batch, args.check_steps),
                                           steps=args.check_steps) if loss is not None]}
    state = pipe.state_dict()  # Pipeline: collective, the whole model on rank 0
    if state is not None:
        out["state"] = cpu_state(state)
    if close:
        pipe.close()
    numerics(device, strict=False)
    pipe = make()
    out["rate"] = timed(pipe.train(timing_batches(args.batch, args.steps), steps=args.steps),
                        args.batch, args.steps, args.warmup, device)
    if close:
        pipe.close()
    return out


def run_threads(args: argparse.Namespace, device: torch.device) -> Outcome:
    """LocalPipeline, both rank threads on `device` (PipelineOptions.device)."""
    from pipedream_fast.local_pipeline import LocalPipeline

    outcome = Outcome("threads", "LocalPipeline: 2 ranks as threads of one process, "
                                 "activation queues, both stages on " + str(device))
    got = check_then_time(lambda: LocalPipeline(
        model_a().to(device), loss_fn, sgd, plan_for(args.batch, args.schedule),
        schedule=args.schedule, chunks=args.chunks, timeout=args.timeout, device=str(device)),
        args, device, close=False)
    outcome.losses, outcome.state, outcome.rate = got["losses"], got.get("state"), got["rate"]
    outcome.status = "ran"
    return outcome


def rank_main(args: argparse.Namespace) -> int:
    """One rank under `pipedream-fast run`: the check and timed runs, its results written to
    --result-dir/rank<N>.pt."""
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
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        result = check_then_time(lambda: Pipeline(
            model_a(), loss_fn, sgd, plan=plan_for(args.batch, args.schedule),
            schedule=args.schedule, chunks=args.chunks, timeout=args.timeout, device=device),
            args, device, close=True)
        torch.save({"backend": backend, **result}, Path(args.result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    return 0


def run_procs(args: argparse.Namespace, device: torch.device) -> Outcome:
    backend = "nccl" if device.type == "cuda" else "gloo"
    outcome = Outcome("procs", f"2 rank processes ({backend}), both stages' ranks on {device}")
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline.") as tmp:
        cmd = [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2",
               str(Path(__file__).resolve()), "--role", "rank", "--result-dir", tmp,
               *forwarded(args)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"),
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [
                       os.environ.get("PYTHONPATH")] if p]))
        print("$ " + " ".join(cmd), flush=True)
        # On our timeout, SIGTERM: the launcher forwards it to the ranks (PR_SET_PDEATHSIG).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT)
        try:
            text, _ = proc.communicate(timeout=args.procs_timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                text, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                text, _ = proc.communicate()
            text += f"\n(stopped after {args.procs_timeout:g} s)"
        lines = text.rstrip().splitlines()
        shown = lines[-40:]
        if len(lines) > len(shown):
            print(f"    ... {len(lines) - len(shown)} earlier lines of the ranks' output left out")
        for line in shown:
            print("    " + line)
        if proc.returncode != 0:
            if device.type == "cuda" and NCCL_REFUSAL.search(text):
                outcome.status = "refused"
                said = re.search(r"Duplicate GPU detected[^\n]*", text) or NCCL_REFUSAL.search(text)
                outcome.note = "NCCL refused two ranks on one GPU: " + (said.group(0) if said else "")
            else:
                outcome.status = "failed"
                outcome.note = f"exit status {proc.returncode}: " + (shown[-1] if shown else "")
            return outcome
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    outcome.state = ranks[0].get("state")
    outcome.losses = ranks[-1].get("losses", [])
    outcome.rate = ranks[-1]["rate"]  # the last stage's clock
    outcome.status = "ran"
    return outcome


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--batch", str(args.batch), "--chunks", str(args.chunks),
            "--check-steps", str(args.check_steps), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--schedule", args.schedule,
            "--timeout", str(args.timeout)]


# ---- comparison and report -------------------------------------------------------------------

@dataclass
class Outcome:
    transport: str
    what: str
    status: str = "not run"  # ran | refused | failed, then match | differs
    note: str = ""
    state: dict[str, torch.Tensor] | None = None
    losses: list[float] = field(default_factory=list)
    rate: float | None = None
    max_abs: float | None = None


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, float, str]:
    """Whether every tensor is close (atol ATOL, rtol RTOL); the largest absolute difference
    and its key, or the first key that is missing or misshapen."""
    if set(got) != set(want):
        missing = sorted(set(want) ^ set(got))
        return False, float("inf"), f"keys differ: {missing[:4]}"
    worst, worst_key, ok = 0.0, "", True
    for key, ref in want.items():
        value = got[key]
        if value.shape != ref.shape:
            return False, float("inf"), f"{key}: shape {tuple(value.shape)} vs {tuple(ref.shape)}"
        value, ref = value.double(), ref.double()
        diff = (value - ref).abs()
        if not torch.isfinite(value).all():
            return False, float("inf"), f"{key}: not finite"
        ok = ok and bool((diff <= ATOL + RTOL * ref.abs()).all())
        largest = float(diff.max()) if diff.numel() else 0.0
        if largest >= worst:
            worst, worst_key = largest, key
    return ok, worst, worst_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--transports", default="threads,procs",
                        help="comma-separated, run in this order: threads, procs (default both)")
    parser.add_argument("--schedule", default="1f1b",
                        help="a synchronous schedule (the reference is minibatch SGD)")
    parser.add_argument("--batch", type=int, default=64, help="minibatch size (default 64)")
    parser.add_argument("--chunks", type=int, default=4, help="microbatches per minibatch")
    parser.add_argument("--check-steps", type=int, default=4,
                        help="minibatches of the weight comparison (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="minibatches timed, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first minibatches")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="the pipelines' own timeout on any one wait, s (default 60)")
    parser.add_argument("--procs-timeout", type=float, default=90.0,
                        help="the whole 'procs' transport, s (default 90)")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--role", default="main", choices=("main", "rank"), help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "rank":
        return rank_main(args)
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps")
    if args.batch % args.chunks:
        parser.error("--batch must be a multiple of --chunks")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in transports if t not in ("procs", "threads")]
    if unknown or not transports:
        parser.error(f"--transports: unknown {unknown}; choose from procs, threads")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_pipeline: no CUDA GPU (torch.cuda.is_available() is False); "
              "use --device cpu for a smoke test", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
        args.device = str(device)
    print(f"gpu_pipeline: {harness.device_line(device)}", flush=True)

    t0 = time.perf_counter()
    numerics(device, strict=True)
    batches = check_batches(args.batch, args.check_steps)
    want = train_reference(batches, args.chunks, device)
    initial = cpu_state(model_a().state_dict())
    moved = max(float((want[k].double() - initial[k].double()).abs().max()) for k in want)
    print(f"reference: {args.check_steps} steps of single-process training with {args.chunks}-way "
          f"gradient accumulation; the weights moved by up to {moved:.3g} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    teeth = moved > 10 * ATOL

    outcomes: list[Outcome] = []
    runners: dict[str, Callable[[argparse.Namespace, torch.device], Outcome]] = {
        "procs": run_procs, "threads": run_threads}
    for name in transports:
        t0 = time.perf_counter()
        print(f"\n-- transport {name}", flush=True)
        try:
            outcome = runners[name](args, device)
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
              + (f", max |w - w_ref| = {outcome.max_abs:.3g}" if outcome.max_abs is not None else "")
              + (f"; {outcome.note}" if outcome.note else "")
              + (f"; {outcome.rate:.1f} samples/s" if outcome.rate is not None else "")
              + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
        outcomes.append(outcome)

    numerics(device, strict=False)
    rates = [("single process, whole minibatch",
              single_process_rate(args.batch, args.steps, args.warmup, 1, device)),
             (f"single process, {args.chunks}-way gradient accumulation",
              single_process_rate(args.batch, args.steps, args.warmup, args.chunks, device))]
    rates += [(f"pipedream_fast {args.schedule}, {o.transport}: {o.what}", o.rate)
              for o in outcomes if o.rate is not None]

    matched = [o for o in outcomes if o.status == "match"]
    bad = [o for o in outcomes if o.status in ("differs", "failed")]
    passed = bool(matched) and not bad and teeth
    lines = [f"## Model A, 2-stage {args.schedule} on one device: weights and samples/s", "",
             f"Command: `{harness.command()}`", "", f"Machine: {harness.device_line(device)}.",
             "",
             f"Weights after {args.check_steps} minibatches of {args.batch} samples "
             f"({args.chunks} microbatches each), SGD lr {LR}, against single-process training "
             f"with the same gradient accumulation (deterministic cuDNN, no TF32); pass: every "
             f"tensor within atol {ATOL:g} + rtol {RTOL:g}. The reference weights moved by up "
             f"to {moved:.3g} from their start" + ("." if teeth else
                                                   " (too little: the check has no teeth)."), "",
             "| transport | what | outcome | max abs difference | note |",
             "| --- | --- | --- | ---: | --- |"]
    lines += [f"| {o.transport} | {o.what} | {o.status} | "
              f"{'' if o.max_abs is None else f'{o.max_abs:.3g}'} | {o.note.replace('|', '/')} |"
              for o in outcomes]
    lines += ["", f"Throughput: {args.steps - args.warmup} minibatches of {args.batch} after "
                  f"{args.warmup} warm-up ones, torch's default numerics.", "",
              "| contender | samples/s | vs single process |", "| --- | ---: | ---: |"]
    base = rates[0][1]
    lines += [f"| {name} | {rate:.1f} | {rate / base:.2f}x |" for name, rate in rates]
    lines += ["", f"Result: {'PASS' if passed else 'FAIL'}"]
    report = "\n".join(lines) + "\n"
    print()
    harness.emit(args.out, report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
