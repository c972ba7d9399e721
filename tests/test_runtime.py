"""The distributed runtime against single-process references (gloo, 2 and 3 processes).

Synchronous schedules must equal plain training with gradient accumulation; asynchronous ones
(pipedream, pipedream-vsync, 2bw) must equal `interpret_schedule`, which applies the IR's
version rules step by step with every version kept as its own copy. Each world size is
launched once for all schedules (process start-up dominates on 2 cores).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pipedream_fast.formats import FormatError, Plan, StagePlan
from pipedream_fast.launch import LaunchError, launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.schedules import make_schedule
from pipedream_fast.training import target_spec
from pipedream_fast.tuning import Tuning
from runtime_reference import interpret_sequential, train_reference

STEPS, CHUNKS, BATCH = 3, 4, 8
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "pipedream", "pipedream-vsync", "2bw")
ASYNC = ("pipedream", "pipedream-vsync", "2bw")
# Layouts: stage block ranges and the ranks of each stage.
LAYOUTS = {
    "2-stage": [((0, 3), (0,)), ((3, 5), (1,))],
    "2+1": [((0, 3), (0, 1)), ((3, 5), (2,))],
    "dp2": [((0, 5), (0, 1))],
    # Looped placements of deep_cnn for interleaved-1f1b: stage g on rank g mod p.
    "looped-2x2": [((0, 2), (0,)), ((2, 5), (1,)), ((5, 7), (0,)), ((7, 9), (1,))],
    "looped-3x2": [((0, 1), (0,)), ((1, 2), (1,)), ((2, 4), (2,)), ((4, 5), (0,)),
                   ((5, 7), (1,)), ((7, 9), (2,))],
}


def tiny_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def deep_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def model_for(layout: str) -> nn.Sequential:
    return deep_cnn() if layout.startswith("looped") else tiny_cnn()


def chunks_for(layout: str) -> int:
    """Interleaved steps run in rounds of the ranks: 6 microbatches on 3 ranks."""
    return 6 if layout == "looped-3x2" else CHUNKS


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def optimizer(name: str):
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=0.01)
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def plan_for(layout: str) -> Plan:
    stages = [StagePlan(a, b, len(ranks), ranks, 1.0) for (a, b), ranks in LAYOUTS[layout]]
    workers = len({r for _, ranks in LAYOUTS[layout] for r in ranks})
    return Plan(model="tiny_cnn", batch_size=BATCH, workers=workers, schedule="1f1b",
                stages=stages, bottleneck_ms=1.0, data_parallel_ms=1.0)


def train_job(rank: int, world: int, runs: list[tuple[str, ...]]) -> dict:
    """Every (layout, schedule, optimizer[, variant]) in `runs`, one Pipeline each; returns
    rank 0's gathered state and the last stage's losses. Variant "python": the executor
    performs every action itself (`Tuning.transfer_runs` off: the reference path); "split":
    gradients on a process group of their own (`Tuning.split_channels`)."""
    out = {}
    for layout, schedule, opt, *path in runs:
        chunks = chunks_for(layout)
        pipe = Pipeline(model_for(layout), loss_fn, optimizer(opt), plan=plan_for(layout),
                        schedule=schedule, chunks=chunks, timeout=60,
                        tuning=Tuning(transfer_runs=path != ["python"],
                                      split_channels=path == ["split"]))
        losses = list(pipe.train(batches(batch=2 * chunks), steps=STEPS))
        out[(layout, schedule, opt, *path)] = (losses, pipe.state_dict())
        pipe.close()
    return out


def reference_async(layout: str, schedule: str, opt: str) -> dict[str, torch.Tensor]:
    plan = plan_for(layout)
    sched = make_schedule(schedule, len(plan.stages), STEPS * CHUNKS,
                          stage_ranks=[list(s.ranks) for s in plan.stages],
                          **({"chunks": CHUNKS} if schedule == "2bw" else {}))
    mbs = [(x, y) for bx, by in batches() for x, y in zip(bx.chunk(CHUNKS), by.chunk(CHUNKS))]
    return interpret_sequential(model_for(layout), [blocks for blocks, _ in LAYOUTS[layout]],
                                sched, mbs, loss_fn, optimizer(opt))


def assert_same_state(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=2e-5, rtol=1e-4, msg=key)


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    runs = [("2-stage", s, "sgd") for s in SCHEDULES] + [("2-stage", "1f1b", "adam"),
                                                        ("2-stage", "pipedream", "adam"),
                                                        ("dp2", "data-parallel", "sgd"),
                                                        ("looped-2x2", "interleaved-1f1b", "sgd")]
    runs += [("2-stage", s, "sgd", "python") for s in ("1f1b", "zb-h1", "pipedream")]
    runs += [("2-stage", s, "sgd", "split") for s in ("1f1b", "pipedream")]
    return launch(train_job, 2, runs, timeout=120)


@pytest.fixture(scope="module")
def three_ranks() -> dict:
    runs = [("2+1", s, "sgd") for s in SCHEDULES] + [("looped-3x2", "interleaved-1f1b", "sgd")]
    runs += [("2+1", "1f1b", "sgd", "split"), ("looped-3x2", "interleaved-1f1b", "sgd", "split")]
    return launch(train_job, 3, runs, timeout=120)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_flush_schedules_equal_gradient_accumulation(two_ranks, schedule):
    losses, state = two_ranks[0][("2-stage", schedule, "sgd")]
    assert_same_state(state, train_reference(tiny_cnn(), batches(), CHUNKS, loss_fn, optimizer("sgd")))
    last_stage_losses = two_ranks[1][("2-stage", schedule, "sgd")][0]
    assert len(last_stage_losses) == STEPS and all(torch.isfinite(x) for x in last_stage_losses)
    # the loss travels back with the gradients: rank 0 (first stage) yields the same losses
    assert torch.equal(torch.stack(losses), torch.stack(last_stage_losses))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "pipedream"])
def test_transfer_runs_change_nothing(two_ranks, schedule):
    """The C++ core performing each run of transfers (the default) against the executor
    performing every action in Python: the same losses and weights, bit for bit."""
    fast_losses, fast_state = two_ranks[0][("2-stage", schedule, "sgd")]
    python_losses, python_state = two_ranks[0][("2-stage", schedule, "sgd", "python")]
    assert [float(x) for x in fast_losses] == [float(x) for x in python_losses]
    assert set(fast_state) == set(python_state)
    for key, value in python_state.items():
        assert torch.equal(fast_state[key], value), key


@pytest.mark.parametrize("ranks, layout, schedule", [
    (2, "2-stage", "1f1b"), (2, "2-stage", "pipedream"), (3, "2+1", "1f1b"),
    (3, "looped-3x2", "interleaved-1f1b")])
def test_split_channels_change_nothing(two_ranks, three_ranks, ranks, layout, schedule):
    """Gradients on a process group of their own (`Tuning.split_channels`): the same losses
    and weights as on one group, bit for bit (a replicated stage, and a rank holding two
    stages, included)."""
    runs = two_ranks if ranks == 2 else three_ranks
    one_losses, one_state = runs[0][(layout, schedule, "sgd")]
    split_losses, split_state = runs[0][(layout, schedule, "sgd", "split")]
    assert [float(x) for x in split_losses] == [float(x) for x in one_losses]
    assert set(split_state) == set(one_state)
    for key, value in one_state.items():
        assert torch.equal(split_state[key], value), key


def test_data_parallel_equals_gradient_accumulation(two_ranks):
    _, state = two_ranks[0][("dp2", "data-parallel", "sgd")]
    assert_same_state(state, train_reference(tiny_cnn(), batches(), CHUNKS, loss_fn, optimizer("sgd")))


def test_adam_state_follows_the_newest_weights(two_ranks):
    _, state = two_ranks[0][("2-stage", "1f1b", "adam")]
    assert_same_state(state, train_reference(tiny_cnn(), batches(), CHUNKS, loss_fn, optimizer("adam")))
    _, state = two_ranks[0][("2-stage", "pipedream", "adam")]
    assert_same_state(state, reference_async("2-stage", "pipedream", "adam"))


@pytest.mark.parametrize("schedule", ASYNC)
def test_async_schedules_follow_their_version_rules(two_ranks, schedule):
    _, state = two_ranks[0][("2-stage", schedule, "sgd")]
    assert_same_state(state, reference_async("2-stage", schedule, "sgd"))
    # Stale weights make a real difference here, so the comparison above has teeth.
    synchronous = train_reference(tiny_cnn(), batches(), CHUNKS, loss_fn, optimizer("sgd"))
    assert max_difference(state, synchronous) > 1e-3


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_replicated_first_stage(three_ranks, schedule):
    _, state = three_ranks[0][("2+1", schedule, "sgd")]
    if schedule in ASYNC:
        want = reference_async("2+1", schedule, "sgd")
    else:
        want = train_reference(tiny_cnn(), batches(), CHUNKS, loss_fn, optimizer("sgd"))
    assert_same_state(state, want)


@pytest.mark.parametrize("world, layout", [(2, "looped-2x2"), (3, "looped-3x2")])
def test_interleaved_1f1b_equals_gradient_accumulation(two_ranks, three_ranks, world, layout):
    """Several stages per rank across processes: messages are matched by (stage, microbatch)
    on links per stage boundary, and every rank's stages step on the averaged gradients."""
    results = two_ranks if world == 2 else three_ranks
    losses, state = results[0][(layout, "interleaved-1f1b", "sgd")]
    chunks = chunks_for(layout)
    want = train_reference(deep_cnn(), batches(batch=2 * chunks), chunks, loss_fn,
                           optimizer("sgd"))
    assert_same_state(state, want)
    last_rank = LAYOUTS[layout][-1][1][0]
    last_losses = results[last_rank][(layout, "interleaved-1f1b", "sgd")][0]
    assert len(last_losses) == STEPS and all(torch.isfinite(x) for x in last_losses)


# --- errors ----------------------------------------------------------------------------------

def wrong_world_job(rank: int, world: int) -> str:
    try:
        Pipeline(tiny_cnn(), loss_fn, optimizer("sgd"), plan=plan_for("2+1"), schedule="1f1b")
    except FormatError as err:
        return str(err)
    return "no error"


def test_plan_for_another_world_size_is_rejected_before_training():
    messages = launch(wrong_world_job, 2, timeout=60)
    assert all("3 workers" in m and "2 ranks" in m for m in messages)


def dead_peer_job(rank: int, world: int, mode: str) -> str:
    pipe = Pipeline(tiny_cnn(), loss_fn, optimizer("sgd"), plan=plan_for("2-stage"),
                    schedule="pipedream", chunks=CHUNKS, timeout=3)
    if rank == 1:
        if mode == "stuck":
            time.sleep(6)  # alive but silent, longer than rank 0's timeout
        return "gone"  # returning ends this process: its sockets close
    started = time.perf_counter()
    try:
        for _ in pipe.train(batches(), steps=STEPS):
            pass
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{time.perf_counter() - started:.1f}s {type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("mode", ["dead", "stuck"])
def test_a_dead_or_stuck_peer_fails_the_others_with_a_clear_error(mode):
    message = launch(dead_peer_job, 2, mode, timeout=60)[0]
    assert message != "no error"
    assert "rank 0" in message and "rank 1" in message
    assert float(message.split("s ", 1)[0]) < 10  # within the 3 s timeout, plus start-up


def test_launch_reports_the_failing_rank():
    with pytest.raises(LaunchError, match="rank 1 of 2 failed"):
        launch(_fail_on_rank_one, 2, timeout=30)


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom")
    time.sleep(0.2)


def test_step_needs_a_synchronous_schedule():
    message = launch(_step_async_job, 1, timeout=30)[0]
    assert "synchronous" in message


def _step_async_job(rank: int, world: int) -> str:
    pipe = Pipeline(tiny_cnn(), loss_fn, optimizer("sgd"), schedule="pipedream")
    x, y = batches(1)[0]
    try:
        pipe.step(x, y)
    except ValueError as err:
        return str(err)
    return "no error"


# --- one process, one thread per rank ---------------------------------------------------------

@pytest.mark.parametrize("layout,schedule", [("2-stage", "1f1b"), ("2-stage", "pipedream"),
                                             ("2+1", "2bw"), ("dp2", "data-parallel"),
                                             ("looped-2x2", "interleaved-1f1b")])
def test_thread_per_rank_pipeline_matches_the_references(layout, schedule):
    from pipedream_fast.local_pipeline import LocalPipeline
    pipe = LocalPipeline(model_for(layout), loss_fn, optimizer("sgd"), plan_for(layout),
                         schedule=schedule, chunks=CHUNKS, timeout=60)
    losses = list(pipe.train(batches(), steps=STEPS))
    assert len(losses) == STEPS
    if schedule in ASYNC:
        want = reference_async(layout, schedule, "sgd")
    else:
        want = train_reference(model_for(layout), batches(), CHUNKS, loss_fn, optimizer("sgd"))
    assert_same_state(pipe.state_dict(), want)


# --- inputs, checkpoints, meta-device models --------------------------------------------------

class TwoInputNet(nn.Module):
    """Two named inputs and a skip connection: traced with torch.fx, fed from dicts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(4, 16)
        self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x) + self.b(z))
        return self.d(torch.relu(self.c(h)) + h)


def test_dict_inputs_reach_the_model_by_name():
    from pipedream_fast.local_pipeline import LocalPipeline
    from pipedream_fast.tracing import trace
    blocks = len(trace(TwoInputNet()))
    plan = Plan(model="two", batch_size=BATCH, workers=2, schedule="1f1b",
                stages=[StagePlan(0, blocks // 2, 1, (0,), 1.0),
                        StagePlan(blocks // 2, blocks, 1, (1,), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    g = torch.Generator().manual_seed(3)
    data = [({"z": torch.randn(BATCH, 4, generator=g), "x": torch.randn(BATCH, 8, generator=g)},
             torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(STEPS)]
    pipe = LocalPipeline(TwoInputNet(), loss_fn, optimizer("sgd"), plan, schedule="1f1b",
                         chunks=CHUNKS, timeout=60)
    assert len(list(pipe.train(data, STEPS))) == STEPS
    model = TwoInputNet()
    opt = optimizer("sgd")(list(model.parameters()))
    for inputs, y in data:
        opt.zero_grad()
        for i in range(CHUNKS):
            part = {k: v.chunk(CHUNKS)[i] for k, v in inputs.items()}
            (loss_fn(model(**part), y.chunk(CHUNKS)[i]) / CHUNKS).backward()
        opt.step()
    assert_same_state(pipe.state_dict(), model.state_dict())


def checkpoint_job(rank: int, world: int, folder: str) -> dict | None:
    def make() -> Pipeline:
        return Pipeline(tiny_cnn(), loss_fn, optimizer("sgd"), plan=plan_for("2-stage"),
                        schedule="1f1b", chunks=CHUNKS, timeout=60)
    data = batches(STEPS)
    pipe = make()
    list(pipe.train(data[:2], steps=2))
    pipe.save(folder)
    pipe.close()
    restored = Pipeline.load(folder, tiny_cnn(), loss_fn, optimizer("sgd"), schedule="1f1b",
                             chunks=CHUNKS, timeout=60)
    list(restored.train(data[2:], steps=1))
    state = restored.state_dict()
    restored.close()
    return state


def test_save_and_load_resume_training_exactly(tmp_path):
    state = launch(checkpoint_job, 2, str(tmp_path / "ckpt"), timeout=120)[0]
    # Momentum buffers were restored too, or the third step would differ.
    assert_same_state(state, train_reference(tiny_cnn(), batches(STEPS), CHUNKS, loss_fn,
                                             optimizer("sgd")))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json",
                                                                    "stage0.pt", "stage1.pt"]


def meta_job(rank: int, world: int) -> list[str]:
    with torch.device("meta"):
        model = tiny_cnn()
    pipe = Pipeline(model, loss_fn, optimizer("sgd"), plan=plan_for("2-stage"),
                    schedule="pipedream", chunks=CHUNKS, timeout=60)
    losses = list(pipe.train(batches(), steps=STEPS))
    devices = sorted({str(p.device) for m in pipe.stage_modules.values()
                      for p in m.parameters()})
    pipe.close()
    assert all(x is None or torch.isfinite(x) for x in losses)
    return devices


def test_a_meta_device_model_is_materialised_stage_by_stage():
    assert launch(meta_job, 2, timeout=120) == [["cpu"], ["cpu"]]


def different_models_job(rank: int, world: int) -> str:
    model = tiny_cnn()
    if rank == 1:  # a different last layer on one rank
        model[4] = nn.Linear(4 * 4 * 4, 7)
    try:
        Pipeline(model, loss_fn, optimizer("sgd"), plan=plan_for("2-stage"), schedule="1f1b")
    except FormatError as err:
        return str(err)
    return "no error"


def test_ranks_that_built_different_models_are_stopped_before_training():
    messages = launch(different_models_job, 2, timeout=60)
    assert all("rank 1 built a different model" in m for m in messages), messages


def test_a_plan_for_other_blocks_or_sizes_is_rejected():
    from pipedream_fast.local_pipeline import LocalPipeline
    plan = plan_for("2-stage")
    named = Plan.from_dict({**plan.to_dict(), "stages": [
        {**s.to_dict(), "blocks": ["a", "b", "c"][: s.stop - s.start]} for s in plan.stages]})
    with pytest.raises(FormatError, match="expects blocks"):
        LocalPipeline(tiny_cnn(), loss_fn, optimizer("sgd"), named)
    sized = Plan.from_dict({**plan.to_dict(), "stages": [
        {**s.to_dict(), "parameter_bytes": 1} for s in plan.stages]})
    with pytest.raises(FormatError, match="bytes of parameters"):
        LocalPipeline(tiny_cnn(), loss_fn, optimizer("sgd"), sized)


def test_two_stages_on_one_rank_hand_tensors_over_locally():
    """Room for interleaved schedules: a rank holding consecutive stages needs no send/receive."""
    from pipedream_fast.ir import Action, ActionKind as K, Schedule
    from pipedream_fast.runtime import Executor, StageRuntime
    from pipedream_fast.runtime.transport import ThreadHub, ThreadTransport
    model = tiny_cnn()
    children = list(model.children())
    stages = {0: StageRuntime(0, nn.Sequential(*children[:3]), optimizer("sgd"), 1, True, False, None),
              1: StageRuntime(1, nn.Sequential(*children[3:]), optimizer("sgd"), 1, False, True,
                              loss_fn)}
    mbs = [(x, y) for bx, by in batches(1) for x, y in zip(bx.chunk(CHUNKS), by.chunk(CHUNKS))]
    actions = [Action(K.FORWARD, s, m, version=0) for m in range(CHUNKS) for s in (0, 1)]
    actions += [Action(K.BACKWARD, s, m, version=0) for m in range(CHUNKS) for s in (1, 0)]
    actions += [Action(K.OPTIMIZER_STEP, s, version=1, microbatches=tuple(range(CHUNKS)))
                for s in (0, 1)]
    schedule = Schedule("local", 2, CHUNKS, ((0,), (0,)), (tuple(actions),), (1,), (CHUNKS,))
    executor = Executor(schedule, 0, stages, ThreadTransport(ThreadHub(1, 10.0), 0),
                        inputs=lambda mb: ((mbs[mb][0],), mbs[mb][1]),
                        target_spec=target_spec(mbs[0][1]))
    losses = [loss for _, _, loss in executor.run() if loss is not None]
    assert len(losses) == CHUNKS
    want = train_reference(tiny_cnn(), batches(1), CHUNKS, loss_fn, optimizer("sgd"))
    assert_same_state(model.state_dict(), want)
