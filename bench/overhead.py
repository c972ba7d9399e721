"""Runtime overhead per action: the executor against plain torch.distributed on one schedule.

Two ranks, each a near-empty stage (one Linear(16, 16); the last adds the loss), run the same
1f1b action stream (chunks 4) through `Pipeline.train` (executor, C++ transport, weight ring)
and through a plain loop over the very same actions (`dist.isend`/`dist.irecv` into
preallocated buffers, forward, backward, `optimizer.step()`). The arithmetic is the same, so
the difference is what the runtime adds; a third driver is the executor's reference path
(`Tuning(transfer_runs=False)`: every action in Python), and a fourth drives the executor's
parts (stage runtime, weight ring, C++ transport) by the plain loop's dispatch, so that the
overhead splits into what the parts cost and what the orchestration around them costs. Per
action: rank 0's run time over its actions. The drivers live in the same two processes and
alternate (A B C D, D C B A; a warm-up round dropped); the ratio is taken round by round.
`--profile MD`: one more run of each under cProfile.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast import _C
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.ir import ActionKind as K
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.runtime.transport import IO_PRIORITIES, set_io_priority
from pipedream_fast.tuning import Tuning
from pipedream_fast.training import build_schedule

from harness import Spread, alternate, paired_ratio, positive, write_results  # noqa: E402

WIDTH, BATCH, CHUNKS = 16, 16, 4
PYTHON_PATH = "executor, every action in Python"  # Tuning(transfer_runs=False)
COMPONENTS = "the executor's parts, no bookkeeping"  # components_driver
PLAN = Plan("tiny", BATCH // CHUNKS, 2, "1f1b",
            [StagePlan(0, 1, 1, (0,), 0.0), StagePlan(1, 2, 1, (1,), 0.0)], 1.0, 1.0)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(steps)]


def executor_driver(steps: int, io_priority: str = "auto", transfer_runs: bool = True,
                    caller_ms: float = 0.0) -> Any:
    """The Pipeline, and a run of `steps` minibatches through it returning us per action.
    `transfer_runs` False: every action in Python (the executor's reference path).
    `caller_ms`: the caller's own code after each step (a sleep: logging, a metric)."""
    pipe = Pipeline(model(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                    plan=PLAN, schedule="1f1b", chunks=CHUNKS,
                    tuning=Tuning(io_priority=io_priority, transfer_runs=transfer_runs))
    batches = data(steps)

    def run() -> float:
        for _ in pipe.train(batches, steps):
            if caller_ms:
                time.sleep(caller_ms / 1e3)
        return pipe.last_stats["total_s"] / pipe.last_stats["actions"] * 1e6

    return pipe, run


def components_driver(rank: int, world: int, steps: int, io_priority: str = "auto",
                      caller_ms: float = 0.0) -> Any:
    """The executor's own parts (a Pipeline's stage runtime, weight ring, C++ transport and
    loss scaling) driven by the plain loop's dispatch over the same precompiled actions, with
    none of the executor's bookkeeping: no program stream, calibration, step tracking, loss
    reporting, stop vote or data feed. Between the plain loop and the executor, it says how
    much of the overhead is the parts and how much the orchestration around them."""
    pipe, warm = executor_driver(1, io_priority)
    warm()  # builds the stage, its runtime and the links (the run leaves them open)
    executor = pipe._run_loop.executor
    assert executor is not None
    stage = next(iter(executor.stages.values()))
    transport = executor.transport
    stage.loss_scale = 1.0 / CHUNKS  # as the run loop sets it: the average at the root
    batches = data(steps)
    program = list(build_schedule(PLAN, "1f1b", steps, CHUNKS).program(rank))
    act, grad = _C.Channel.ACTIVATION, _C.Channel.GRADIENT
    # The sample counts travel with each target, as in the executor's messages (not read here)
    counts = torch.tensor([BATCH // CHUNKS, BATCH, CHUNKS])

    def run() -> float:
        newest = stage._copy(0).newest  # every run goes on from the weights' newest version
        actions = [a.shifted(0, newest) for a in program]  # made before the clock starts
        outputs, targets, losses = {}, {}, {}
        began = time.perf_counter()
        for a in actions:
            kind, mb = a.kind, a.microbatch
            if kind is K.RECV_ACT or kind is K.RECV_GRAD:
                transport.post_recv(a.peer, act if kind is K.RECV_ACT else grad, a.stage, mb)
            elif kind is K.FORWARD:
                if rank == 0:
                    x, y = (t.chunk(CHUNKS)[mb % CHUNKS] for t in batches[mb // CHUNKS])
                else:
                    x, y, _ = transport.wait_recv(0, act, a.stage, mb)
                outputs[mb] = stage.forward(mb, a.version, (x,), y)
                targets[mb] = y
                if rank == world - 1:
                    losses[mb] = outputs.pop(mb)[0].detach()
            elif kind is K.SEND_ACT:
                transport.send(a.peer, act, a.stage + 1, mb,
                               [outputs.pop(mb)[0].detach(), targets.pop(mb), counts])
            elif kind is K.BACKWARD:
                if rank == world - 1:
                    stage.backward(mb, None)
                else:  # the gradient, then the loss that travels with it
                    stage.backward(mb, transport.wait_recv(1, grad, a.stage, mb)[:-1])
            elif kind is K.SEND_GRAD:
                transport.send(a.peer, grad, a.stage - 1, mb,
                               [*stage.take_input_grads(mb), losses.pop(mb)])
            elif kind is K.OPTIMIZER_STEP:
                stage.step(a.version, a.microbatches)
                if caller_ms:
                    time.sleep(caller_ms / 1e3)
        transport.flush()
        elapsed = time.perf_counter() - began
        dist.barrier()
        return elapsed / len(actions) * 1e6

    return pipe, run


def plain_driver(rank: int, world: int, steps: int, caller_ms: float = 0.0) -> Any:
    """A run of the same actions by plain torch.distributed calls, returning us per action."""
    stage = model()[rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    batches = data(steps)
    # Made once, outside the timed loop: --profile then counts only the loop's own calls.
    actions = list(build_schedule(PLAN, "1f1b", steps, CHUNKS).program(rank))

    def run() -> float:
        # inputs and outputs by microbatch; pending[(kind, mb)] = (work, buffer); sends: works
        inputs, outputs, pending, sends = {}, {}, {}, []
        began = time.perf_counter()
        for a in actions:
            mb = a.microbatch
            if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD:
                assert mb is not None and a.peer is not None
                buffer = torch.empty(BATCH // CHUNKS, WIDTH)
                pending[(a.kind.value, mb)] = (dist.irecv(buffer, src=a.peer), buffer)
            elif a.kind is K.FORWARD:
                assert mb is not None
                if rank == 0:
                    x = batches[mb // CHUNKS][0].chunk(CHUNKS)[mb % CHUNKS]
                else:
                    work, x = pending.pop((K.RECV_ACT.value, mb))
                    work.wait()
                x = x.detach().requires_grad_(rank > 0)
                inputs[mb], out = x, stage(x)
                if rank == world - 1:
                    target = batches[mb // CHUNKS][1].chunk(CHUNKS)[mb % CHUNKS]
                    out = nn.functional.mse_loss(out, target) / CHUNKS
                outputs[mb] = out
            elif a.kind is K.SEND_ACT:
                assert mb is not None and a.peer is not None
                sends.append(dist.isend(outputs[mb].detach(), dst=a.peer))
            elif a.kind is K.BACKWARD:
                assert mb is not None
                out = outputs.pop(mb)
                if rank == world - 1:
                    out.backward()
                else:
                    work, grad = pending.pop((K.RECV_GRAD.value, mb))
                    work.wait()
                    out.backward(grad)
            elif a.kind is K.SEND_GRAD:
                assert mb is not None and a.peer is not None
                grad = inputs.pop(mb).grad
                assert grad is not None
                sends.append(dist.isend(grad, dst=a.peer))
            elif a.kind is K.OPTIMIZER_STEP:
                optimizer.step()
                optimizer.zero_grad()
                if caller_ms:  # the caller's code after each step
                    time.sleep(caller_ms / 1e3)
            if len(sends) > 8:
                sends.pop(0).wait()
        for work in sends:
            work.wait()
        elapsed = time.perf_counter() - began
        dist.barrier()
        return elapsed / len(actions) * 1e6

    return run


def overhead_job(rank: int, world: int, steps: int, repeat: int,
                 profile: bool = False, io_priority: str = "auto",
                 caller_ms: float = 0.0) -> dict[str, Any]:
    """Both drivers on this rank, in alternating rounds; with `profile`, one more run of each
    under cProfile. `io_priority`: every gloo I/O thread of the process (the plain loop's too)."""
    torch.set_num_threads(1)
    pipe, executor_run = executor_driver(steps, io_priority, caller_ms=caller_ms)
    executor_run()  # its transport (and its groups' I/O threads) exist from here
    reference, reference_run = executor_driver(steps, io_priority, transfer_runs=False,
                                               caller_ms=caller_ms)
    reference_run()
    parts, parts_run = components_driver(rank, world, steps, io_priority, caller_ms)
    parts_run()
    set_io_priority(io_priority)
    plain_run = plain_driver(rank, world, steps, caller_ms)
    values = alternate({"plain torch.distributed": plain_run,
                        "pipedream_fast executor": executor_run,
                        PYTHON_PATH: reference_run, COMPONENTS: parts_run}, repeat)
    actions = int(pipe.last_stats["actions"])
    where, calls = None, None
    if profile:
        import cProfile
        import pstats
        calls = {}
        for name, run in (("plain torch.distributed", plain_run),
                          ("pipedream_fast executor", executor_run)):
            profiler = cProfile.Profile()
            profiler.runcall(run)
            stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
            calls[name] = sum(v[1] for v in stats.values()) / actions
        # The executor's 25 functions with the most time of their own, per action.
        where = sorted(({"function": f"{fn} ({'/'.join(path.split('/')[-2:])}:{line})",
                         "own_us": own / actions * 1e6, "total_us": total / actions * 1e6,
                         "calls": n / actions}
                        for (path, line, fn), (_, n, own, total, _) in stats.items()),
                       key=lambda r: -r["own_us"])[:25]
    pipe.close()
    reference.close()
    parts.close()
    return {"values": values, "actions": actions, "profile": where, "calls": calls}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive, default=400)
    parser.add_argument("--repeat", type=positive, default=3)
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--io-priority", choices=IO_PRIORITIES, default="auto",
                        help="every gloo I/O thread's (Tuning.io_priority), both drivers'")
    parser.add_argument("--profile", metavar="MD",
                        help="write here where each rank's time per action goes (cProfile)")
    parser.add_argument("--caller-ms", type=float, default=0.0,
                        help="the caller's own code after each step, in ms (a sleep, every "
                             "driver alike: logging, a metric); default 0")
    args = parser.parse_args()
    results = launch(overhead_job, 2, args.steps, args.repeat, bool(args.profile),
                     args.io_priority, args.caller_ms, timeout=1200)
    result = results[0]
    if args.profile:
        write_results(
            args.profile, "Where the executor's time per action goes (each rank, cProfile)",
            [f"`Pipeline.train` on the overhead workload (1f1b, {args.steps} steps of {CHUNKS} "
             f"microbatches, Linear({WIDTH}, {WIDTH}) per stage), one run under cProfile "
             f"after the timed rounds. cProfile slows Python calls, so the sum is above the "
             f"unprofiled time; the order is what it says. Own: time in the function itself; "
             f"total: with what it calls."],
            ["function", "own us/action", "total us/action", "calls/action"],
            [(f"rank {rank}: {r['function']}".replace("|", "/"), f"{r['own_us']:.1f}",
              f"{r['total_us']:.1f}", f"{r['calls']:.2f}")
             for rank, res in enumerate(results) for r in res["profile"]],
            ["Python function calls per action (cProfile's count, which load does not move), "
             "one run of each driver: " + "; ".join(
                 f"rank {rank}: " + ", ".join(f"{name} {n:.1f}" for name, n in res["calls"].items())
                 for rank, res in enumerate(results)) + "."])
    values = result["values"]
    spreads = {name: Spread.of(v) for name, v in values.items()}
    ratio = paired_ratio(values, "pipedream_fast executor", "plain torch.distributed")
    ratios = {name: paired_ratio(values, name, "plain torch.distributed") for name in values}
    for name, spread in spreads.items():
        print(f"{name:26s} {spread.text()} us/action (median, range over {args.repeat} "
              f"rounds; {result['actions']} actions on rank 0)", flush=True)
    overhead = spreads["pipedream_fast executor"].median - spreads["plain torch.distributed"].median
    parts_overhead = spreads[COMPONENTS].median - spreads["plain torch.distributed"].median
    print(f"overhead: {overhead:+.1f} us per action ({ratio.text(2)}x, round by round)")
    if args.out:
        write_results(
            args.out, "Runtime overhead per action (near-empty stages)",
            [f"Two ranks, gloo, 1 thread each, gloo's I/O threads at priority "
             f"{args.io_priority}; 1f1b, {args.steps} steps of {CHUNKS} "
             f"microbatches; Linear({WIDTH}, {WIDTH}) per stage"
             + (f"; after each step the caller's own code, {args.caller_ms:g} ms (a sleep, "
                f"every driver alike)" if args.caller_ms else "") + ". The drivers alternate "
             f"in the same processes ({args.repeat} rounds after a warm-up, A B C D then D C B A); "
             f"medians with their range. The executor hands each run of transfers to the C++ "
             f"core (`Tuning.transfer_runs`, the default); '{PYTHON_PATH}' is its reference "
             f"path, every action a Python one."],
            ["driver", "us per action (rank 0)", "actions", "vs plain (round by round)"],
            [(name, spread.text(), result["actions"],
              "1.00x" if name.startswith("plain") else f"{ratios[name].text(2)}x")
             for name, spread in spreads.items()],
            [f"The executor adds {overhead:+.1f} us per action over the plain loop; its parts "
             f"alone (the same stage runtime, weight ring and C++ transport, driven by the "
             f"plain loop's dispatch: no program stream, calibration, step tracking, loss "
             f"reporting, stop vote or data feed) add {parts_overhead:+.1f} us "
             f"({ratios[COMPONENTS].text(2)}x): the rest is the orchestration around them."],
            {"steps": args.steps, "rounds": args.repeat, "io_priority": args.io_priority,
             "caller_ms": args.caller_ms, "values_us_per_action": values,
             "rows": [{"driver": name, "us_per_action": spread.median,
                       "actions": result["actions"], "vs_plain": ratios[name].median}
                      for name, spread in spreads.items()],
             "actions": result["actions"], "ratio": ratio.median,
             "ratio_range": [ratio.low, ratio.high]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
