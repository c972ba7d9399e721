"""A rank's program compiled once per period (`ir.periodic`) is the streamed program, action for
action, on every registered schedule, placement and run length; and it does compile where a
schedule repeats, so the executor's replay is what runs."""

from __future__ import annotations

import pytest

from pipedream_fast.ir import Action, ActionKind as K, Schedule
from pipedream_fast.ir.periodic import _compile, compiled_program
from pipedream_fast.schedules import kind, make_schedule, names

LAYOUTS = [  # (stages, chunks, make_schedule options)
    (2, 4, {}),
    (4, 8, {}),
    (3, 2, {}),
    (2, 4, {"replicas": [2, 1]}),
    (3, 4, {"replicas": [1, 2, 2]}),
    (4, 4, {"stages_per_rank": 2}),
    (1, 4, {"replicas": [2]}),  # data-parallel's only layout
]


def schedules(name: str):
    spec = kind(name)
    for stages, chunks, options in LAYOUTS:
        for n in (12, 97, 160):
            kwargs = dict(options)
            if spec.chunked_steps:
                kwargs["chunks"] = chunks
            try:
                yield make_schedule(name, stages, n, **kwargs)
            except ValueError:
                continue  # a layout this schedule does not take


@pytest.mark.parametrize("name", names())
def test_compiled_program_equals_the_stream(name: str) -> None:
    compiled = 0
    for schedule in schedules(name):
        for rank in range(schedule.num_ranks):
            streamed = list(schedule.program(rank))
            assert list(compiled_program(schedule, rank)) == streamed, (schedule, rank)
            compiled += _compile(schedule, rank) is not None
    assert compiled > 0, f"{name}: no run long enough was compiled"


def test_one_f_one_b_replays_periods() -> None:
    """A long 1f1b run replays: the program is the window's head, its period shifted, its
    tail; the replayed actions are new objects equal to the stream's."""
    schedule = make_schedule("1f1b", 2, 4 * 100, chunks=4)
    for rank in range(2):
        fit = _compile(schedule, rank)
        assert fit is not None
        segments, head, tail, steps, period, periods = fit
        assert (period, periods) == (4, 100) and head >= 1 and tail >= 1
        assert steps == {(rank, 0): 1}  # one version a step
        replayed = list(compiled_program(schedule, rank))
        assert replayed == list(schedule.program(rank))
        assert replayed[-1].kind is K.OPTIMIZER_STEP and replayed[-1].version == 100


def test_short_runs_and_explicit_programs_stream() -> None:
    assert _compile(make_schedule("1f1b", 2, 8, chunks=4), 0) is None  # too short to pay
    explicit = Schedule("hand", 1, 1, [[0]], [[Action(K.FORWARD, 0, 0, version=0),
                                             Action(K.BACKWARD, 0, 0, version=0)]], [1], [1])
    assert _compile(explicit, 0) is None
    assert list(compiled_program(explicit, 0)) == list(explicit.program(0))


def test_shifted_moves_microbatches_and_versions() -> None:
    step = Action(K.OPTIMIZER_STEP, 1, version=2, microbatches=(4, 5, 6, 7))
    assert step.shifted(4, 1) == Action(K.OPTIMIZER_STEP, 1, version=3,
                                        microbatches=(8, 9, 10, 11))
    send = Action(K.SEND_ACT, 0, 3, peer=1)
    assert send.shifted(8, 5) == Action(K.SEND_ACT, 0, 11, peer=1)  # no version to move
