"""The schedule IR: action tokens, JSON/text round-trips, and every validator rule on small
hand-written schedules (each error must name the rank, the action index and the action)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedream_fast.ir import (KIND_SPECS, Action, ActionKind, Placement, Schedule, ScheduleError,
                               format_mb_list, parse_mb_list, validate)
from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule

K = ActionKind


def sched(*ranks: str, stages: str | None = None, mbs: int = 1, versions: str | None = None,
          inflight: str | None = None) -> Schedule:
    """A schedule from one token line per rank; by default one stage per rank."""
    n = len(ranks)
    stages = stages or " | ".join(map(str, range(n)))
    header = ["schedule test", f"stages {len(stages.split('|'))}",
              f"microbatches {mbs}", f"stage_ranks {stages}",
              f"max_versions {versions or ' '.join(['1'] * n)}",
              f"max_inflight {inflight or ' '.join(['1'] * n)}"]
    return Schedule.from_text("\n".join(header + [f"rank {r}: {t}" for r, t in enumerate(ranks)]))


# One microbatch through two stages: the smallest complete pipeline.
R0 = "0F0@0 0rB0<1 0sF0>1 0B0@0 0U@1:0"
R1 = "1rF0<0 1F0@0 1B0@0 1sB0>0 1U@1:0"


def rejects(schedule: Schedule, rank: int, index: int, *phrases: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    err = info.value
    assert (err.rank, err.index) == (rank, index), str(err)
    assert err.action == schedule.actions[rank][index]
    assert err.action.to_text() in str(err)
    for phrase in phrases:
        assert phrase in str(err)
    return err


# --- tokens ---------------------------------------------------------------------------------

@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(ActionKind)))
    stage = draw(st.integers(0, 20))
    small = st.integers(0, 500)
    if kind.is_compute:
        return Action(kind, stage, draw(small), version=draw(small), copy=draw(st.integers(0, 3)))
    if kind.is_p2p:
        return Action(kind, stage, draw(small), peer=draw(small))
    mbs = tuple(sorted(draw(st.sets(small, min_size=1, max_size=12))))
    return Action(kind, stage, version=draw(small), copy=draw(st.integers(0, 3)),
                  microbatches=mbs if kind is K.OPTIMIZER_STEP else ())


@settings(max_examples=300, deadline=None)
@given(actions())
def test_action_text_round_trip(action: Action) -> None:
    assert Action.parse(action.to_text()) == action


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 300), min_size=1))
def test_microbatch_list_round_trip(mbs: set[int]) -> None:
    assert parse_mb_list(format_mb_list(mbs)) == tuple(sorted(mbs))


def test_token_examples() -> None:
    assert Action.parse("0F3@1") == Action(K.FORWARD, 0, 3, version=1)
    assert Action.parse("1rB3<2") == Action(K.RECV_GRAD, 1, 3, peer=2)
    assert Action.parse("0U@2:4-7") == Action(K.OPTIMIZER_STEP, 0, version=2,
                                              microbatches=(4, 5, 6, 7))
    assert Action.parse("2F5@1c3").copy == 3
    assert format_mb_list([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"


def test_needs_narrows_a_field_or_names_the_action() -> None:
    recv = Action.parse("1rB3<2")
    assert (recv.needs("microbatch"), recv.needs("peer")) == (3, 2)
    with pytest.raises(ScheduleError, match=r"recv_grad action 1rB3<2 names no version"):
        recv.needs("version")


def test_every_kind_has_a_token() -> None:
    """The parser is built from KIND_SPECS: each kind's code reads back as that kind."""
    for kind, spec in KIND_SPECS.items():
        a = Action(kind, 1, 2 if spec.microbatch else None,
                   peer=3 if kind.is_p2p else None, version=4 if spec.version else None,
                   microbatches=(2, 3) if kind is K.OPTIMIZER_STEP else ())
        assert a.to_text().startswith(f"1{spec.code}")
        assert Action.parse(a.to_text()) == a


@pytest.mark.parametrize("token, phrase", [
    ("0Q3", "cannot read action"), ("0F3", "weight version"), ("0sF3<1", "'>' PEER"),
    ("0F3>1@0", "peer"), ("0U@2", "microbatches"), ("0B3@1:3", "only optimizer steps"),
    ("0sF3>1c1", "copy")])
def test_bad_tokens(token: str, phrase: str) -> None:
    with pytest.raises(ScheduleError, match=phrase):
        Action.parse(token)


# --- containers -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_json_and_text_round_trip(name: str, tmp_path) -> None:
    stages, replicas = (1, [2]) if name == "data-parallel" else (3, None)
    if name == "interleaved-1f1b":
        s = make_schedule(name, 4, 8, stages_per_rank=2)
    else:
        s = make_schedule(name, stages, 7, replicas=replicas)
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_text(s.to_text()) == s
    s.save(tmp_path / "ir.json")
    assert Schedule.load(tmp_path / "ir.json") == s


def test_schedule_structure_errors() -> None:
    with pytest.raises(ScheduleError, match="must be 0..1"):
        Schedule("x", 2, 1, [(0,), (2,)], [[], []], [1, 1], [1, 1])
    with pytest.raises(ScheduleError, match="one bound per rank"):
        Schedule("x", 1, 1, [(0,)], [[]], [1, 1], [1])
    with pytest.raises(ScheduleError, match="format"):
        Schedule.from_dict({"format": "other"})


# --- validator ------------------------------------------------------------------------------

def test_minimal_pipeline_is_valid() -> None:
    report = validate(sched(R0, R1))
    assert report.peak_versions == (1, 1) and report.peak_inflight == (1, 1)


def test_backward_before_forward() -> None:
    rejects(sched(R0, "1rF0<0 1B0@0 1F0@0 1sB0>0 1U@1:0"), 1, 1, "backward before its forward")


def test_unmatched_send_and_receive() -> None:
    rejects(sched(R0, "1F0@0 1B0@0 1sB0>0 1U@1:0"), 0, 2, "unmatched send_act", "1rF0<0")
    rejects(sched("0F0@0 0sF0>1 0B0@0 0U@1:0", R1), 1, 3, "unmatched send_grad", "0rB0<1")


def test_forward_needs_a_received_input_and_send_needs_its_forward() -> None:
    rejects(sched(R0, "1F0@0 1rF0<0 1B0@0 1sB0>0 1U@1:0"), 1, 0, "no earlier RECV_ACT")
    rejects(sched("0rB0<1 0sF0>1 0F0@0 0B0@0 0U@1:0", R1), 0, 1, "before the forward")


def test_deadlock_names_every_blocked_rank() -> None:
    # Rank 0 runs B0 before sending mb 1's activation; rank 1 runs F1 before B0, so each waits
    # in a compute for an input the other sends only after its own wait.
    r0 = "0F0@0 0rB0<1 0sF0>1 0B0@0 0F1@0 0rB1<1 0sF1>1 0B1@0 0U@1:0-1"
    r1 = "1rF0<0 1F0@0 1rF1<0 1F1@0 1B0@0 1sB0>0 1B1@0 1sB1>0 1U@1:0-1"
    err = rejects(sched(r0, r1, mbs=2, inflight="2 2"), 0, 3, "deadlock")
    assert ("rank 0 waits at action 3 (0B0@0) for its input until rank 1 reaches action 5"
            in str(err))
    assert ("rank 1 waits at action 3 (1F1@0) for its input until rank 0 reaches action 6"
            in str(err))


def test_a_link_holds_one_message_in_transit() -> None:
    # Rank 0 sends mbs 0 and 1 before rank 1 posts either receive: the first waits in transit,
    # the second blocks until rank 1 takes the first, which it does: no deadlock.
    r0 = "0F0@0 0sF0>1 0F1@0 0sF1>1 0rB0<1 0rB1<1 0B0@0 0B1@0 0U@1:0-1"
    r1 = "1rF0<0 1F0@0 1B0@0 1sB0>0 1rF1<0 1F1@0 1B1@0 1sB1>0 1U@1:0-1"
    validate(sched(r0, r1, mbs=2, inflight="2 1"))


def test_link_order_must_match_on_both_ends() -> None:
    # Rank 1 takes microbatch 1 first, rank 0 sends 0 first on the same link.
    r0 = "0F0@0 0rB0<1 0sF0>1 0F1@0 0rB1<1 0sF1>1 0B0@0 0B1@0 0U@1:0-1"
    r1 = "1rF1<0 1F1@0 1rF0<0 1F0@0 1B0@0 1sB0>0 1B1@0 1sB1>0 1U@1:0-1"
    rejects(sched(r0, r1, mbs=2, inflight="2 2"), 0, 2, "receives microbatch 1 there next")


def test_declared_bounds() -> None:
    one_stage = "0F0@0 0F1@0 0B0@0 0S@0 0U@1:0 0B1@0 0X@0 0U@2:1"
    validate(sched(one_stage, mbs=2, versions="2", inflight="2"))
    rejects(sched(one_stage, mbs=2, versions="2", inflight="1"), 0, 1, "max_inflight 1")
    rejects(sched(one_stage, mbs=2, versions="1", inflight="2"), 0, 4, "max_versions 1")


def test_version_rules() -> None:
    rejects(sched("0F0@0 0B0@1 0U@1:0"), 0, 1, "its forward used version 0")
    rejects(sched("0F0@1 0B0@1 0U@1:0"), 0, 0, "does not exist yet")
    missing_snapshot = "0F0@0 0F1@0 0B0@0 0U@1:0 0B1@0 0U@2:1"
    rejects(sched(missing_snapshot, mbs=2, versions="2", inflight="2"), 0, 4, "missing SNAPSHOT")
    released = "0F0@0 0F1@0 0B0@0 0S@0 0U@1:0 0X@0 0B1@0 0U@2:1"
    rejects(sched(released, mbs=2, versions="2", inflight="2"), 0, 6, "already RELEASEd")
    leak = "0F0@0 0B0@0 0S@0 0U@1:0"
    rejects(sched(leak, versions="2"), 0, 3, "never released")
    rejects(sched("0F0@0 0B0@0 0U@2:0"), 0, 2, "must create version 1")
    rejects(sched("0F0@0 0B0@0 0S@1 0U@1:0"), 0, 2, "newest version 0")


def test_step_rules() -> None:
    rejects(sched("0F0@0 0F1@0 0B0@0 0B1@0 0U@1:0", mbs=2, inflight="2"), 0, 4, "omits")
    rejects(sched("0F0@0 0B0@0", "0F1@0 0B1@0 0U@1:0-1", stages="0,1", mbs=2), 1, 2,
            "without an ALLREDUCE")
    rejects(sched("0F0@0 0B0@0"), 0, 1, "never applied")
    replicated = sched("0F0@0 0B0@0 0AR@1 0U@1:0-1", "0F1@0 0B1@0 0AR@1 0U@1:0-1",
                       stages="0,1", mbs=2)
    validate(replicated)
    rejects(sched("0F0@0 0B0@0 0AR@1 0U@1:0-1", "0F1@0 0B1@0 0AR@2 0U@1:0-1",
                  stages="0,1", mbs=2), 0, 2, "meets rank 1's all-reduce for version 2")


def test_placement_and_completeness() -> None:
    rejects(sched("0F0@0 0B0@0 0U@1:0", "0F0@0"), 1, 0, "does not run on rank 1")
    rejects(sched("0F3@0 0B3@0 0U@1:3", mbs=2), 0, 0, "out of range")
    with pytest.raises(ScheduleError, match="microbatch 1 is never forwarded on stage 0"):
        validate(sched("0F0@0 0B0@0 0U@1:0", mbs=2))


# --- several stages per rank (interleaved chunks): no interpreter change needed -------------

# Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; one microbatch goes 0 -> 1 -> 2 -> 3.
INTERLEAVED = sched(
    "0F0@0 2rF0<1 0sF0>1 2F0@0 2rB0<1 2sF0>1 2B0@0 0rB0<1 2sB0>1 0B0@0 0U@1:0 2U@1:0",
    "1rF0<0 1F0@0 3rF0<0 1sF0>0 3F0@0 3B0@0 1rB0<0 3sB0>0 1B0@0 1sB0>0 1U@1:0 3U@1:0",
    stages="0 | 1 | 0 | 1", versions="2 2", inflight="2 2")


def test_several_stages_per_rank() -> None:
    assert INTERLEAVED.stages_of(0) == (0, 2)
    assert INTERLEAVED.stages_of(1) == Placement(INTERLEAVED.stage_ranks).stages_of(1) == (1, 3)
    assert validate(INTERLEAVED).peak_versions == (2, 2)
    # Two stages on one rank hand the tensor over locally, without a send/receive.
    local = sched("0F0@0 1F0@0 1B0@0 0B0@0 0U@1:0 1U@1:0", stages="0 | 0", versions="2",
                  inflight="2")
    assert validate(local).peak_inflight == (2,)


def test_placement_queries() -> None:
    """One helper answers placement for Schedule, Layout and bare stage_ranks alike."""
    p = Placement([[0, 2], [1]])
    assert p.stage_ranks == ((0, 2), (1,)) and p.num_ranks == 3
    assert [p.rank_of(0, m) for m in range(4)] == [0, 2, 0, 2] and p.rank_of(1, 3) == 1
    assert p.stages_of(2) == (0,) and p.stages_of(5) == ()
    s = make_schedule("pipedream", 2, 8, stage_ranks=[[0, 2], [1]])
    assert (s.stages_of(2), s.rank_of(0, 3), s.num_ranks) == ((0,), 2, 3)
