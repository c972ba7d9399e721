"""Moving stages between ranks in a running pipeline (`Pipeline.move`, `adapt=True`).

A synchronous schedule trains exactly as without the move (weights, optimizer and scheduler
state follow their blocks); so do 2bw, pipedream-vsync and zb-h1, whose delays do not depend on
the stage a block is on. pipedream's do (a block moved to an earlier stage reads older
weights), so its run is checked to keep learning, and the move itself to change no weight.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import LaunchError, launch
from pipedream_fast.options import OptionError
from pipedream_fast.pipeline import Pipeline

BLOCKS = 5


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(BLOCKS - 1)],
                         nn.Linear(8, 3))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(n)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)


def layout(schedule: str, bounds: list[int], ranks: list[list[int]], workers: int) -> Plan:
    """A plan of stages [bounds[i], bounds[i+1]) on `ranks[i]`."""
    edges = [0, *bounds, BLOCKS]
    stages = [StagePlan(a, b, len(r), tuple(r), 0.0) for a, b, r in zip(edges, edges[1:], ranks)]
    return Plan("Sequential", 16, workers, schedule, stages, 0.0, 0.0)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, worst


def threads_run(schedule: str, start: Plan, moves: dict[int, Plan], steps: int = 6,
                optimizer=momentum, scheduler=None, **options) -> tuple[list[float], Pipeline]:
    """`steps` steps, one train() call per step, moving to moves[k] before step k."""
    pipe = Pipeline(make_model(), loss_fn, optimizer, plan=start, schedule=schedule, chunks=4,
                    ranks="threads", scheduler=scheduler, **options)
    losses = []
    for k, batch in enumerate(batches(steps)):
        if k in moves:
            before = pipe.state_dict()
            pipe.move(moves[k])
            assert_same(pipe.state_dict(), before)  # a move changes no weight
            assert [(s.start, s.stop, s.ranks) for s in pipe.plan.stages] == \
                [(s.start, s.stop, s.ranks) for s in moves[k].stages]
        losses += [float(x) for x in pipe.train([batch])]
    return losses, pipe


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "2bw", "pipedream-vsync", "zb-h1"])
def test_a_forced_move_trains_exactly_as_no_move_under_threads(schedule: str) -> None:
    start = layout(schedule, [2, 3], [[0], [1], [2]], 3)
    moves = {2: layout(schedule, [4], [[0], [1, 2]], 3) if schedule in ("1f1b", "gpipe")
             else layout(schedule, [1, 4], [[0], [1], [2]], 3),
             4: layout(schedule, [3, 4], [[0], [1], [2]], 3)}
    moved, pipe = threads_run(schedule, start, moves, optimizer=adam, scheduler=halving)
    still, other = threads_run(schedule, start, {}, optimizer=adam, scheduler=halving)
    replicated = schedule in ("1f1b", "gpipe")  # a replicated stage sums in another order
    assert moved == pytest.approx(still, rel=1e-5 if replicated else 0, abs=0)
    assert_same(pipe.state_dict(), other.state_dict(), 1e-6 if replicated else 0.0)
    assert [m["step"] for m in pipe.moves] == [2, 4]
    # what ranks gain: a hidden block is 288 bytes of weights and 584 of Adam state, the
    # last 108 and 224; first move: rank 0 gains blocks 2, 3 and rank 1 block 4 (replicated)
    # for 1f1b and gpipe, rank 1 blocks 1 and 3 for the others
    assert pipe.moves[0]["bytes"] == (2 * 872 + 332 if replicated else 2 * 872)
    lrs = [group["lr"] for o in pipe.optimizers for group in o.param_groups]
    assert lrs == [group["lr"] for o in other.optimizers for group in o.param_groups]


def learnable(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose targets a fixed linear map of the inputs decides (learnable)."""
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(8, 3, generator=g)
    xs = [torch.randn(16, 8, generator=g) for _ in range(n)]
    return [(x, (x @ teacher).argmax(1)) for x in xs]


def pipedream_losses(moves: dict[int, Plan]) -> list[float]:
    start = layout("pipedream", [2, 3], [[0], [1], [2]], 3)
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="pipedream",
                    ranks="threads")
    data = learnable(8)
    losses = []
    for k in range(40):
        if k in moves:
            before = pipe.state_dict()
            pipe.move(moves[k])
            assert_same(pipe.state_dict(), before)  # a move changes no weight
        losses += [float(x) for x in pipe.train([data[k % 8]])]
    return losses


def test_pipedream_keeps_learning_across_moves() -> None:
    moved = pipedream_losses({10: layout("pipedream", [1, 4], [[0], [1], [2]], 3),
                              20: layout("pipedream", [3, 4], [[0], [1], [2]], 3)})
    still = pipedream_losses({})
    assert all(torch.isfinite(torch.tensor(moved)))
    assert moved[:10] == still[:10]
    first, last = sum(moved[:8]) / 8, sum(moved[-8:]) / 8
    assert last < 0.6 * first, (first, last)
    assert last < 1.2 * sum(still[-8:]) / 8  # as far as the run that never moved


def test_a_move_keeps_the_staleness_velocity_of_each_block() -> None:
    start = layout("2bw", [2, 3], [[0], [1], [2]], 3)
    moves = {3: layout("2bw", [1, 4], [[0], [1], [2]], 3)}
    options = dict(staleness="predict")
    moved, _ = threads_run("2bw", start, moves, steps=6, **options)
    still, _ = threads_run("2bw", start, {}, steps=6, **options)
    assert moved == still


def process_job(rank: int, world: int, schedule: str, move: bool, factory: bool) -> dict:
    start = layout(schedule, [2, 4], [[0], [1], [2]], 3)
    pipe = Pipeline(make_model if factory else make_model(), loss_fn, adam, plan=start,
                    schedule=schedule, chunks=2, scheduler=halving)
    data = batches(6)
    losses = [float(x) for x in pipe.train(data[:3])]
    if move:
        pipe.move(layout(schedule, [1, 4], [[0], [1], [2]], 3))
        pipe.move(layout(schedule, [3, 4], [[0], [1], [2]], 3))
    losses += [float(x) for x in pipe.train(data[3:])]
    meta = [all(p.is_meta for p in b.module.parameters()) for b in pipe._stages.chain.blocks]
    return {"losses": losses, "state": pipe.state_dict(), "meta": meta}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_forced_move_trains_exactly_as_no_move_in_processes(schedule: str) -> None:
    moved = launch(process_job, 3, schedule, True, True, timeout=120)
    still = launch(process_job, 3, schedule, False, True, timeout=120)
    assert moved[0]["losses"] == still[0]["losses"]
    assert moved[2]["losses"] == still[2]["losses"]
    assert_same(moved[0]["state"], still[0]["state"])
    # built from a factory on meta: each rank holds only its blocks after the move, too
    owners = [0, 0, 0, 1, 2]
    for rank in range(3):
        assert moved[rank]["meta"] == [owner != rank for owner in owners]


def test_a_move_is_refused_when_the_loader_would_change_hands() -> None:
    start = layout("1f1b", [2], [[0], [1]], 2)
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b",
                    ranks="threads")
    list(pipe.train(batches(1)))
    with pytest.raises(ValueError, match="read the loader"):
        pipe.move(Plan("Sequential", 16, 2, "1f1b", [StagePlan(0, 2, 1, (1,), 0.0),
                                                     StagePlan(2, 5, 1, (0,), 0.0)], 0, 0))
    with pytest.raises(ValueError, match="3 workers"):
        pipe.move(layout("1f1b", [2, 3], [[0], [1], [2]], 3))
    assert len(list(pipe.train(batches(1)))) == 1  # refused before anything changed


def test_adapt_options_are_checked() -> None:
    with pytest.raises(OptionError, match="cannot re-plan schedule 'localsgd'"):
        Pipeline(make_model(), loss_fn, momentum, schedule="localsgd", adapt=True,
                 ranks="threads", workers=2)
    with pytest.raises(OptionError, match="pass profile="):
        Pipeline(make_model(), loss_fn, momentum, schedule="1f1b", adapt=True, balance=[2, 3],
                 ranks="threads", workers=2)
    with pytest.raises(OptionError, match="adapt_every must be >= 1"):
        Pipeline(make_model(), loss_fn, momentum, schedule="1f1b", adapt=True, adapt_every=0,
                 ranks="threads", workers=2)


def test_adapt_moves_inside_train_and_a_synchronous_run_is_unchanged(monkeypatch) -> None:
    """The decision forced (the planner's replan patched): the move happens at the check
    after the baseline one, inside one train() call, and the losses are those of a run that
    never moved."""
    from pipedream_fast.planner import replan as replan_module

    target = layout("1f1b", [4], [[0], [1]], 2)
    calls: list[int] = []

    def forced(profile, plan, snapshots, **kwargs):
        calls.append(len(snapshots))
        decided = target if plan.stages[0].stop != 4 else None
        return replan_module.Replan(decided, "forced by the test", (1.0, 0.5), 2.0, 1.0, 0.5)

    monkeypatch.setattr(replan_module, "replan", forced)
    from pipedream_fast.profiler import profile_model
    profile = profile_model(make_model(), batches(1)[0][0], 16, progress=False, repeat=1,
                            warmup=0)
    start = layout("1f1b", [2], [[0], [1]], 2)
    data = batches(6)
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b", chunks=2,
                    ranks="threads", adapt=True, adapt_every=2, profile=profile,
                    adapt_threshold=0.95)  # no move back: a tiny model's steps are noise
    adaptive = [float(x) for x in pipe.train(data)]
    plain = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b", chunks=2,
                     ranks="threads")
    assert adaptive == [float(x) for x in plain.train(data)]
    # (a tiny model's step times are noise: the check after the move may move back, which
    # changes no loss either)
    assert pipe.moves[0]["step"] == 4 and pipe.moves[0]["to"][0][1] == 4
    assert "baseline" in pipe.adapt_checks[0]["reason"]  # the check after step 2
    assert calls[0] == 2 and set(calls) == {2}  # each check with both ranks' figures
    assert [c["moved"] for c in pipe.adapt_checks][:2] == [False, True]


def test_adapt_takes_blocks_from_a_slowed_rank() -> None:
    """Rank 1 made far slower than rank 0 after the first check (the baseline), by a sleep
    in each of its computations: the next check moves blocks to rank 0."""
    from pipedream_fast.runtime import stage as stage_module

    original_forward = stage_module.StageRuntime.forward
    slowed: set[int] = set()

    def slow_forward(self, *args, **kwargs):
        out = original_forward(self, *args, **kwargs)
        if self.stage in slowed:
            import time
            time.sleep(0.004)
        return out

    data = batches(4)
    pipe = Pipeline(make_model(), loss_fn, momentum, stages=2, schedule="1f1b", chunks=2,
                    ranks="threads", workers=2, adapt=True, adapt_every=5)
    stage_module.StageRuntime.forward = slow_forward
    try:
        list(pipe.train(data * 5, steps=5))
        assert not pipe.moves and "baseline" in pipe.adapt_checks[0]["reason"]
        slowed.add(1)  # stage 1, on rank 1
        list(pipe.train(data * 5, steps=10))
    finally:
        stage_module.StageRuntime.forward = original_forward
    assert pipe.moves, pipe.adapt_checks
    before, after = pipe.moves[0]["from"], pipe.moves[0]["to"]
    assert after[0][1] > before[0][1]  # rank 0's stage grew
    assert pipe.adapt_checks[1]["speeds"][1] < 0.5


def failing_move_job(rank: int, world: int, folder: str, report: str) -> None:
    from pipedream_fast.rank import moving

    start = layout("1f1b", [2], [[0], [1]], 2)
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b", chunks=2,
                    timeout=20)
    list(pipe.train(batches(2)))
    pipe.save(folder)
    if rank == 1:
        def die(stages, checkpoints, index):
            os._exit(7)
        moving.stage_state = die  # rank 1 dies in the middle of the move
    try:
        pipe.move(layout("1f1b", [4], [[0], [1]], 2))
    except Exception as err:  # noqa: BLE001 - what rank 0 saw is the test's result
        Path(report).write_text(f"{type(err).__name__}: {err}")
        with pytest.raises(RuntimeError, match="cannot train any more"):
            list(pipe.train(batches(1)))
        raise


def test_a_rank_dying_mid_move_fails_the_others_clearly_and_keeps_the_checkpoint(
        tmp_path: Path) -> None:
    folder, report = tmp_path / "ckpt", tmp_path / "rank0.txt"
    with pytest.raises(LaunchError, match="rank 1"):
        launch(failing_move_job, 2, str(folder), str(report), timeout=120)
    seen = report.read_text()
    assert "moving the stages to the new plan needs every rank" in seen, seen
    resolved, _ = ckpt.resolve(folder)
    manifest = ckpt.read_manifest(resolved)
    assert manifest["step"] == 2
    loaded = Pipeline.load(folder, make_model(), loss_fn, momentum, ranks="threads")
    assert len(list(loaded.train(batches(1)))) == 1


def test_a_move_that_made_steps_slower_is_undone_and_not_tried_again(monkeypatch) -> None:
    from pipedream_fast.planner import replan as replan_module

    start = layout("1f1b", [2], [[0], [1]], 2)
    target = layout("1f1b", [4], [[0], [1]], 2)
    monkeypatch.setattr(replan_module, "replan", lambda *a, **k: replan_module.Replan(
        target, "forced by the test", (1.0, 0.5), 2.0, 1.0, 0.5))
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b",
                    ranks="threads", profile=object())  # rank 0 decides; the profile unread
    list(pipe.train(batches(1)))
    rank0 = pipe._ranks[0]
    rank0._moving._microbatch_samples, rank0._moving._adapt_chunks = 16, 1
    rank0._moving._baseline = rank0._stages.profile  # past the first check
    first = rank0._moving._decide({}, step_seconds=0.010)
    assert first["plan"] is not None  # moves, and remembers the step time before
    pipe.move(Plan.from_dict(first["plan"]))
    back = rank0._moving._decide({}, step_seconds=0.013)  # 30% slower than before the move
    assert "made steps 30% slower" in back["reason"] and "moving back" in back["reason"]
    assert Plan.from_dict(back["plan"]).stages[0].stop == 2
    pipe.move(Plan.from_dict(back["plan"]))
    again = rank0._moving._decide({}, step_seconds=0.010)
    assert again["plan"] is None and "made steps slower when tried" in again["reason"]


def test_a_move_that_paid_is_kept(monkeypatch) -> None:
    from pipedream_fast.planner import replan as replan_module

    start = layout("1f1b", [2], [[0], [1]], 2)
    decisions = iter([layout("1f1b", [4], [[0], [1]], 2), None])
    monkeypatch.setattr(replan_module, "replan", lambda *a, **k: replan_module.Replan(
        next(decisions), "forced by the test", (1.0, 0.5), 2.0, 1.0, 0.5))
    pipe = Pipeline(make_model(), loss_fn, momentum, plan=start, schedule="1f1b",
                    ranks="threads", profile=object())
    list(pipe.train(batches(1)))
    rank0 = pipe._ranks[0]
    rank0._moving._microbatch_samples, rank0._moving._adapt_chunks = 16, 1
    rank0._moving._baseline = rank0._stages.profile  # past the first check
    pipe.move(Plan.from_dict(rank0._moving._decide({}, step_seconds=0.010)["plan"]))
    assert rank0._moving._decide({}, step_seconds=0.008)["plan"] is None  # faster: stays
