"""Corrections for stale weights (`staleness=` of pipedream, pipedream-vsync and 2bw) against
`interpret_schedule`'s single-process application of the same corrected algorithm, on rank
threads and on 2 processes; the delays the executor finds against the schedules' own laws;
checkpoints that carry the velocity; refusals."""

from __future__ import annotations

import pytest
import torch

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.options import OptionError, PipelineOptions
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.runtime.staleness_correction import (CORRECTIONS, StalenessCorrection,
                                                         lookahead)
from pipedream_fast.schedules import make_schedule
from runtime_reference import interpret_sequential
from test_runtime import assert_same_state, batches, deep_cnn, loss_fn
from test_runtime import optimizer as runtime_optimizer

STEPS, CHUNKS, BATCH = 4, 4, 8  # batches(steps) makes BATCH samples a step
# deep_cnn's 9 blocks on 3 stages, one rank each; and on 2 stages, the first replicated.
LAYOUTS = {
    "3-stage": [((0, 2), (0,)), ((2, 5), (1,)), ((5, 9), (2,))],
    "2+1": [((0, 5), (0, 1)), ((5, 9), (2,))],
    "2-stage": [((0, 5), (0,)), ((5, 9), (1,))],
}


def optimizer(name: str):
    if name == "plain":
        return lambda ps: torch.optim.SGD(ps, lr=0.2)
    return runtime_optimizer(name)


def plan_for(layout: str) -> Plan:
    stages = [StagePlan(a, b, len(ranks), ranks, 1.0) for (a, b), ranks in LAYOUTS[layout]]
    workers = len({r for _, ranks in LAYOUTS[layout] for r in ranks})
    return Plan(model="deep_cnn", batch_size=BATCH, workers=workers, schedule="pipedream",
                stages=stages, bottleneck_ms=1.0, data_parallel_ms=1.0)


def reference(layout: str, schedule: str, opt: str, staleness: str | None,
              steps: int = STEPS) -> dict[str, torch.Tensor]:
    plan = plan_for(layout)
    sched = make_schedule(schedule, len(plan.stages), steps * CHUNKS,
                          stage_ranks=[list(s.ranks) for s in plan.stages],
                          **({"chunks": CHUNKS} if schedule == "2bw" else {}))
    mbs = [(x, y) for bx, by in batches(steps)
           for x, y in zip(bx.chunk(CHUNKS), by.chunk(CHUNKS))]
    return interpret_sequential(deep_cnn(), [blocks for blocks, _ in LAYOUTS[layout]], sched,
                                mbs, loss_fn, optimizer(opt), staleness)


def distance(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def pipeline(layout: str, schedule: str, opt: str, staleness: str | None, **values) -> Pipeline:
    return Pipeline(deep_cnn(), loss_fn, optimizer(opt), plan=plan_for(layout),
                    schedule=schedule, chunks=CHUNKS,
                    timeout=60, staleness=staleness, **values)


# --- the definition -----------------------------------------------------------------------------

def test_lookahead_is_the_delay_for_predict_and_the_decayed_momentum_sum_for_nesterov():
    assert [lookahead("predict", d) for d in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert lookahead("nesterov", 1) == pytest.approx(0.9)
    assert lookahead("nesterov", 3) == pytest.approx(0.9 + 0.81 + 0.729)
    assert lookahead("nesterov", 200) == pytest.approx(9.0, rel=1e-6)
    assert lookahead("lr-scale", 5) == 0.0
    with pytest.raises(ValueError, match="staleness must be one of predict, nesterov, lr-scale"):
        StalenessCorrection("momentum")


def test_the_velocity_is_the_bias_corrected_moving_average_of_the_updates():
    c = StalenessCorrection("predict")
    w = [torch.zeros(3)]
    assert c.read(w, 0, 2) is None  # no update yet: the version as it is
    for step in (torch.ones(3), 3 * torch.ones(3)):
        c.before_update(w)
        w[0] += step
        c.after_update(w)
    # v = 0.9 * 0.1 * 1 + 0.1 * 3 = 0.39; corrected by 1 - 0.81 = 0.19
    shifted = c.read(w, 1, 2)
    assert shifted is not None
    torch.testing.assert_close(shifted[0], w[0] + 2 * 0.39 / 0.19)
    assert c.learning_rate_factor([0, 1]) == 1.0 and c.delays == {}
    lr = StalenessCorrection("lr-scale")
    assert lr.read(w, 4, 3) is None and lr.read(w, 5, 1) is None
    assert lr.learning_rate_factor([4, 5]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule,layout,law", [
    ("pipedream", "3-stage", lambda s: 2 - s),      # NOAM - 1 = S - 1 - s
    ("pipedream-vsync", "3-stage", lambda s: 2),    # stage 0's delay on every stage
    ("2bw", "3-stage", lambda s: 1),                # one version stale
])
def test_the_executor_finds_the_schedules_delays(schedule, layout, law):
    seen: dict[int, set[int]] = {}
    from pipedream_fast.runtime import staleness_correction as module
    original = module.StalenessCorrection.read

    def spy(self, weights, microbatch, delay):
        seen.setdefault(id(self), set()).add(delay)
        return original(self, weights, microbatch, delay)

    pipe = pipeline(layout, schedule, "sgd", "predict", ranks="threads")
    module.StalenessCorrection.read = spy  # type: ignore[method-assign]
    try:
        list(pipe.train(batches(8), steps=8))
    finally:
        module.StalenessCorrection.read = original  # type: ignore[method-assign]
    steady = {}
    for rank in pipe._ranks:
        for index, runtime in rank._stages.runtimes.items():
            steady[index] = max(seen[id(runtime.correction)])
    assert steady == {s: law(s) for s in range(3)}


# --- runtime = reference ------------------------------------------------------------------------

THREAD_CASES = [("3-stage", "pipedream", "sgd", k) for k in CORRECTIONS] + [
    ("3-stage", "pipedream", "plain", "predict"),
    ("3-stage", "pipedream", "adam", "nesterov"),
    ("3-stage", "pipedream-vsync", "sgd", "predict"),
    ("3-stage", "2bw", "sgd", "nesterov"),
    ("2+1", "pipedream", "sgd", "predict"),
    ("2+1", "pipedream", "sgd", "lr-scale"),
    ("2+1", "2bw", "sgd", "lr-scale"),
]


@pytest.mark.parametrize("layout,schedule,opt,staleness", THREAD_CASES)
def test_a_corrected_run_on_rank_threads_equals_the_reference(layout, schedule, opt, staleness):
    pipe = pipeline(layout, schedule, opt, staleness, ranks="threads")
    list(pipe.train(batches(STEPS), steps=STEPS))
    got = pipe.state_dict()
    want = reference(layout, schedule, opt, staleness)
    assert_same_state(got, want)
    # and the correction is not a no-op: the uncorrected reference is elsewhere
    assert distance(want, reference(layout, schedule, opt, None)) > 1e-3


# --- checkpoints ----------------------------------------------------------------------------------

def test_a_checkpoint_carries_the_velocity_so_a_loaded_run_continues_exactly(tmp_path):
    data = batches(6)
    pipe = pipeline("3-stage", "pipedream", "sgd", "predict", ranks="threads")
    list(pipe.train(data[:3], steps=3))
    pipe.save(tmp_path / "ckpt")
    list(pipe.train(data[3:], steps=3))
    want = pipe.state_dict()

    def load() -> Pipeline:
        return Pipeline.load(tmp_path / "ckpt", deep_cnn(), loss_fn, optimizer("sgd"),
                             schedule="pipedream", chunks=CHUNKS, staleness="predict",
                             ranks="threads", timeout=60)

    resumed = load()
    list(resumed.train(data[3:], steps=3))
    assert_same_state(resumed.state_dict(), want)

    # The velocity matters: the same weights and optimizer state without it end elsewhere.
    forgetful = load()
    for rank in forgetful._ranks:
        for runtime in rank._stages.runtimes.values():
            runtime.restore_correction(None)
        rank._checkpoints.saved_staleness = dict.fromkeys(rank._checkpoints.saved_staleness)
    list(forgetful.train(data[3:], steps=3))
    assert distance(forgetful.state_dict(), want) > 1e-4


# --- refusals -------------------------------------------------------------------------------------

def test_a_synchronous_schedule_or_an_unknown_correction_is_refused_by_name():
    with pytest.raises(OptionError, match="staleness is an option of pipedream, "
                                          "pipedream-vsync and 2bw, not of '1f1b'"):
        PipelineOptions.of(schedule="1f1b", staleness="predict")
    with pytest.raises(OptionError, match="staleness must be one of predict, nesterov, lr-scale, "
                                          "got 'momentum'"):
        PipelineOptions.of(schedule="pipedream", staleness="momentum")
    assert PipelineOptions.of(schedule="2bw", staleness="lr-scale").schedule_options == {
        "staleness": "lr-scale"}
    assert make_schedule("pipedream", 2, 4, staleness="nesterov").params["staleness"] == "nesterov"
    assert "staleness" not in make_schedule("pipedream", 2, 4).params


# --- 2 processes --------------------------------------------------------------------------------

PROCESS_CASES = [("2-stage", "pipedream", "sgd", "predict"),
                 ("2-stage", "pipedream", "adam", "nesterov"),
                 ("2-stage", "pipedream", "sgd", "lr-scale"),
                 ("2-stage", "2bw", "sgd", "predict")]


def process_job(rank: int, world: int, cases: list) -> dict:
    out = {}
    for layout, schedule, opt, staleness in cases:
        pipe = pipeline(layout, schedule, opt, staleness)
        list(pipe.train(batches(STEPS), steps=STEPS))
        out[(layout, schedule, opt, staleness)] = pipe.state_dict()
        pipe.close()
    return out


def test_a_corrected_run_on_two_processes_equals_the_reference():
    got = launch(process_job, 2, PROCESS_CASES, timeout=120)[0]
    for case in PROCESS_CASES:
        assert_same_state(got[case], reference(*case))


def test_auto_with_a_correction_asks_for_the_schedule_by_name():
    with pytest.raises(OptionError, match="name one of them as the schedule"):
        PipelineOptions.of(schedule="auto", staleness="predict")
