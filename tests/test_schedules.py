"""Every generator: the validator accepts it over a range of stages, microbatches and
replicas; mutated copies are rejected; and the weight-version semantics of the design brief
hold, read off the IR itself."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedream_fast.ir import Action, ActionKind, Schedule, ScheduleError, validate
from pipedream_fast.schedules import SCHEDULE_NAMES, TRAINABLE, kind, make_schedule
from pipedream_fast.sim import UnitCosts, simulate
from pipedream_fast.schedules.common import Layout

K = ActionKind


@st.composite
def configs(draw: st.DrawFn, names=SCHEDULE_NAMES) -> tuple[str, dict]:
    name = draw(st.sampled_from(names))
    if name == "interleaved-1f1b":
        p, v = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        m = p * draw(st.integers(1, 3))
        return name, {"num_stages": p * v, "num_microbatches": m * draw(st.integers(1, 3)),
                      "stages_per_rank": v, "chunks": m}
    stages = 1 if name == "data-parallel" else draw(st.integers(1, 5))
    n = draw(st.integers(1, 24))
    kw: dict = {"num_stages": stages, "num_microbatches": n}
    if name != "localsgd":
        kw["replicas"] = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    if name in ("gpipe", "1f1b", "data-parallel", "zb-h1"):
        kw["chunks"] = draw(st.integers(1, n))
    if name == "2bw":
        lcm, workers = math.lcm(*kw["replicas"]), sum(kw["replicas"])
        kw["chunks"] = lcm * draw(st.integers(math.ceil(workers / lcm),
                                                         math.ceil(workers / lcm) + 2))
    if name == "localsgd":
        kw["local_steps"] = draw(st.integers(1, 3))
        kw["model_replicas"] = draw(st.integers(1, 5))
    return name, kw


def compute(s: Schedule, rank: int) -> list[Action]:
    return [a for a in s.actions[rank] if a.kind.is_compute]


def forward_versions(s: Schedule) -> dict[tuple[int, int], int]:
    return {(a.stage, a.microbatch): a.version for acts in s.actions for a in acts
            if a.kind is K.FORWARD}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_generated_schedule_validates(config: tuple[str, dict]) -> None:
    name, kw = config
    s = make_schedule(name, **kw)
    report = validate(s)
    assert all(p <= b for p, b in zip(report.peak_versions, s.max_versions))
    # Each (stage, microbatch) runs forward and backward exactly once, on its round-robin rank.
    layout = Layout(s.num_stages, s.num_microbatches, s.stage_ranks)
    for rank in range(s.num_ranks):
        for a in compute(s, rank):
            assert layout.rank_of(a.stage, a.microbatch) == rank


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n != "interleaved-1f1b"])
def test_small_grid_validates(name: str) -> None:
    for stages in ([1] if name == "data-parallel" else [1, 2, 3, 4]):
        for n in (1, 2, 5, 9):
            reps = [[1] * stages]
            if name != "localsgd":
                reps += [[2] + [1] * (stages - 1), [1] * (stages - 1) + [3]]
            for replicas in reps:
                validate(make_schedule(name, stages, n, replicas=replicas))


# --- mutations ------------------------------------------------------------------------------

def mutate(s: Schedule, rank: int, actions: list[Action]) -> Schedule:
    per_rank = list(s.actions)
    per_rank[rank] = tuple(actions)
    return Schedule(s.name, s.num_stages, s.num_microbatches, s.stage_ranks, per_rank,
                    s.max_versions, s.max_inflight)


def positions(s: Schedule, kinds: set[ActionKind]) -> list[tuple[int, int]]:
    return [(r, i) for r, acts in enumerate(s.actions) for i, a in enumerate(acts)
            if a.kind in kinds]


MUTABLE = [("gpipe", 3, 6, [1, 2, 1]), ("1f1b", 3, 7, [1, 1, 2]), ("pipedream", 4, 9, None),
           ("pipedream-vsync", 3, 8, [2, 1, 1]), ("2bw", 3, 9, None), ("localsgd", 3, 8, None),
           ("data-parallel", 1, 6, [3]), ("interleaved-1f1b", 4, 8, None),
           ("zb-h1", 3, 7, [1, 1, 2])]


@pytest.mark.parametrize("name, stages, n, replicas", MUTABLE)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_mutated_copies_are_rejected(name, stages, n, replicas, data) -> None:
    kw = ({"stages_per_rank": 2, "chunks": 4} if name == "interleaved-1f1b"
          else {"replicas": replicas})
    s = make_schedule(name, stages, n, **kw)
    validate(s)

    def pick(kinds: set[ActionKind]) -> tuple[int, int] | None:
        found = positions(s, kinds)
        return data.draw(st.sampled_from(found)) if found else None

    # A dropped receive or send leaves its partner unmatched.
    for kinds in ({K.RECV_ACT, K.RECV_GRAD}, {K.SEND_ACT, K.SEND_GRAD}):
        if (where := pick(kinds)) is not None:
            r, i = where
            with pytest.raises(ScheduleError, match="unmatched"):
                validate(mutate(s, r, list(s.actions[r][:i] + s.actions[r][i + 1:])))
    # A send swapped in front of the compute that produces it, a receive moved behind its
    # consumer, a dropped optimizer step, a backward on the wrong version.
    if (where := pick({K.SEND_ACT, K.SEND_GRAD})) is not None:
        r, i = where
        acts = list(s.actions[r])
        j = max(k for k in range(i) if acts[k].kind.is_compute)
        acts[i], acts[j] = acts[j], acts[i]
        with pytest.raises(ScheduleError, match="before the"):
            validate(mutate(s, r, acts))
    if (where := pick({K.RECV_ACT})) is not None:
        r, i = where
        acts = list(s.actions[r])
        j = next(k for k in range(i, len(acts)) if acts[k].kind is K.FORWARD
                 and acts[k].microbatch == acts[i].microbatch)
        acts.insert(j, acts.pop(i))
        with pytest.raises(ScheduleError, match="no earlier RECV_ACT"):
            validate(mutate(s, r, acts))
    r, i = pick({K.OPTIMIZER_STEP})
    with pytest.raises(ScheduleError):
        validate(mutate(s, r, list(s.actions[r][:i] + s.actions[r][i + 1:])))
    r, i = pick({K.BACKWARD, K.BACKWARD_WEIGHT})
    acts = list(s.actions[r])
    acts[i] = Action(acts[i].kind, acts[i].stage, acts[i].microbatch,
                     version=acts[i].version + 1, copy=acts[i].copy)
    with pytest.raises(ScheduleError, match="its forward used version"):
        validate(mutate(s, r, acts))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "pipedream-vsync", "2bw"])
def test_swapped_microbatches_are_rejected(name: str) -> None:
    """The last stage takes microbatch 1 before 0 while its neighbour sends 0 first: a FIFO
    link would hang (and under the blocking rule it deadlocks)."""
    s = make_schedule(name, 3, 6)
    last = s.num_ranks - 1
    swap = {0: 1, 1: 0}
    acts = [Action(a.kind, a.stage, swap.get(a.microbatch, a.microbatch), a.peer, a.version,
                   a.copy, tuple(sorted(swap.get(m, m) for m in a.microbatches)))
            for a in s.actions[last]]
    with pytest.raises(ScheduleError, match="in one order on both ends") as info:
        validate(mutate(s, last, acts))
    assert info.value.rank is not None and info.value.action is not None


def test_dropped_snapshot_is_rejected() -> None:
    s = make_schedule("pipedream", 3, 6)
    r, i = positions(s, {K.SNAPSHOT})[0]
    with pytest.raises(ScheduleError, match="missing SNAPSHOT|not retained"):
        validate(mutate(s, r, list(s.actions[r][:i] + s.actions[r][i + 1:])))


# --- semantics ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "data-parallel"])
def test_flush_schedules_step_once_per_minibatch(name: str) -> None:
    stages, replicas = (1, [3]) if name == "data-parallel" else (3, [2, 1, 1])
    s = make_schedule(name, stages, 12, replicas=replicas, chunks=4)
    for rank in range(s.num_ranks):
        steps = [a for a in s.actions[rank] if a.kind is K.OPTIMIZER_STEP]
        assert [a.microbatches for a in steps] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
        for a in compute(s, rank):  # minibatch g runs on version g: one version only
            assert a.version == a.microbatch // 4
        if len(s.stage_ranks[s.stages_of(rank)[0]]) > 1:
            assert sum(a.kind is K.ALLREDUCE for a in s.actions[rank]) == 3
    assert set(validate(s).peak_versions) == {1}


def test_gpipe_stashes_the_minibatch_and_1f1b_only_noam() -> None:
    assert validate(make_schedule("gpipe", 4, 8)).peak_inflight == (8, 8, 8, 8)
    assert validate(make_schedule("1f1b", 4, 8)).peak_inflight == (4, 3, 2, 1)


@pytest.mark.parametrize("replicas", [None, [2, 1, 1], [1, 2, 1], [3, 2, 1]])
def test_pipedream_weight_stashing_and_noam(replicas) -> None:
    s = make_schedule("pipedream", 3, 30, replicas=replicas)
    layout = Layout(3, 30, s.stage_ranks)
    report = validate(s)
    for stage, ranks in enumerate(s.stage_ranks):
        r = len(ranks)
        for rank in ranks:
            steps = 0
            for a in s.actions[rank]:
                if a.kind is K.OPTIMIZER_STEP:  # one update per round of r microbatches
                    assert a.microbatches == tuple(range(steps * r, min(30, steps * r + r)))
                    steps += 1
                elif a.kind is K.FORWARD:  # forwards read the newest weights
                    assert a.version == steps
            assert report.peak_versions[rank] == report.peak_inflight[rank] == layout.noam(stage)


def test_vertical_sync_reads_stage_zero_versions() -> None:
    s = make_schedule("pipedream-vsync", 4, 24)
    v = forward_versions(s)
    assert all(v[(stage, m)] == v[(0, m)] for stage in range(4) for m in range(24))
    assert validate(s).peak_versions == (4, 4, 4, 4)  # S versions on every stage
    plain = forward_versions(make_schedule("pipedream", 4, 24))
    assert any(plain[(0, m)] != plain[(3, m)] for m in range(24))  # without vsync they differ
    s = make_schedule("pipedream-vsync", 3, 24, replicas=[2, 1, 3])
    v = forward_versions(s)
    for m in range(24):
        for stage, r in enumerate([2, 1, 3]):
            assert v[(stage, m)] == v[(0, m)] * 2 // r


@pytest.mark.parametrize("replicas, m", [(None, 3), (None, 5), ([2, 2], 4), ([1, 3], 6)])
def test_2bw_double_buffering(replicas, m) -> None:
    stages = 3 if replicas is None else 2
    s = make_schedule("2bw", stages, 40, replicas=replicas, chunks=m)
    for (_, mb), version in forward_versions(s).items():
        assert version == max(mb // m - 1, 0)  # W(t+1) = W(t) - lr * grad f(W(t-1))
    report = validate(s)
    assert max(report.peak_versions) == 2
    for rank in range(s.num_ranks):
        steps = [a.microbatches for a in s.actions[rank] if a.kind is K.OPTIMIZER_STEP]
        assert steps == [tuple(range(g, min(g + m, 40))) for g in range(0, 40, m)]


def test_localsgd_rounds() -> None:
    stages, n, r, h = 3, 20, 2, 3
    s = make_schedule("localsgd", stages, n, local_steps=h, model_replicas=r)
    validate(s)
    for rank in range(stages):
        acts = s.actions[rank]
        where = {(a.kind, a.microbatch): i for i, a in enumerate(acts) if a.kind.is_compute}
        for m in range(n):
            assert acts[where[(K.FORWARD, m)]].copy == m % r
            if m >= r:  # a replica's forward waits for its previous microbatch's backward
                assert where[(K.FORWARD, m)] > where[(K.BACKWARD, m - r)]
        averages = [i for i, a in enumerate(acts) if a.kind is K.AVERAGE]
        assert len(averages) == n // (r * h)
        for k, i in enumerate(averages):  # a barrier: the round drained before the average
            last = (k + 1) * r * h - 1
            assert where[(K.BACKWARD, last)] < i < where[(K.FORWARD, last + 1)]


def test_custom_stage_ranks() -> None:
    s = make_schedule("pipedream", 2, 8, stage_ranks=[[0, 2], [1]])
    validate(s)
    assert s.stage_ranks == ((0, 2), (1,))
    assert {a.microbatch for a in compute(s, 2)} == {1, 3, 5, 7}


@pytest.mark.parametrize("call, phrase", [
    (lambda: make_schedule("zero-bubble", 2, 4), "unknown schedule"),
    (lambda: make_schedule("gpipe", 2, 4, replicas=[1]), "one count"),
    (lambda: make_schedule("gpipe", 2, 4, local_steps=2), "not an option of schedule 'gpipe'"),
    (lambda: make_schedule("pipedream", 2, 4, chunks=2), "takes no chunks"),
    (lambda: make_schedule("2bw", 3, 9, chunks=2), "at most 2"),
    (lambda: make_schedule("2bw", 2, 9, replicas=[2, 1], chunks=3), "multiple"),
    (lambda: make_schedule("localsgd", 2, 4, replicas=[2, 1]), "model_replicas"),
    (lambda: make_schedule("data-parallel", 3, 4), "--stages 1 --replicas W"),
    (lambda: make_schedule("gpipe", 2, 4, stage_ranks=[[0], [2]]), "must use every rank"),
    (lambda: make_schedule("gpipe", 2, 4, stage_ranks=[[0], [0]]), "one stage per rank"),
    (lambda: make_schedule("interleaved-1f1b", 4, 8, stage_ranks=[[0], [0], [1], [1]]),
     "looped placement"),
    (lambda: make_schedule("interleaved-1f1b", 4, 6, stages_per_rank=2, chunks=3),
     "multiple of 2"),
    (lambda: make_schedule("1f1b", 4, 6, stages_per_rank=3), "must divide the 4 stages"),
    (lambda: make_schedule("gpipe", 0, 4), "at least 1 stage")])
def test_bad_parameters(call, phrase: str) -> None:
    with pytest.raises(ValueError, match=phrase):
        call()


# --- interleaved 1F1B -----------------------------------------------------------------------

@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 8), (2, 4, 8)])
def test_interleaved_1f1b_bubble_is_1f1b_over_v(p: int, v: int, m: int) -> None:
    """With each of the v stages of a rank costing 1/v, the idle time at the flush shrinks
    from 1F1B's 2(p - 1) to 2(p - 1)/v, per step."""
    steps = 3
    inter = simulate(make_schedule("interleaved-1f1b", p * v, m * steps, stages_per_rank=v,
                                   chunks=m), UnitCosts(1 / v, 1 / v))
    plain = simulate(make_schedule("1f1b", p, m * steps, chunks=m), UnitCosts())
    work = 2 * m * steps
    assert plain.makespan - work == pytest.approx(2 * (p - 1) * steps)
    assert inter.makespan - work == pytest.approx((plain.makespan - work) / v)


def test_interleaved_1f1b_places_and_orders_like_megatron() -> None:
    s = make_schedule("interleaved-1f1b", 4, 8, stages_per_rank=2, chunks=4)
    assert s.stage_ranks == ((0,), (1,), (0,), (1,))
    order = [a.to_text() for a in compute(s, 0)]
    # Rank 0: warm-up 2(p-1) + (v-1)p = 4 forwards, chunk 0 then chunk 1 in rounds of p = 2.
    assert order[:6] == ["0F0@0", "0F1@0", "2F0@0", "2F1@0", "0F2@0", "2B0@0"]
    for rank in range(2):  # every stage steps once per step, on the averaged step
        steps = [a for a in s.actions[rank] if a.kind is K.OPTIMIZER_STEP]
        assert [(a.stage, a.microbatches) for a in steps] == \
            [(st, tuple(range(g, g + 4))) for g in (0, 4) for st in (rank + 2, rank)]
    assert validate(s).peak_versions == (2, 2)


# --- streams --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINABLE)
def test_a_million_microbatches_start_at_once(name: str) -> None:
    kw: dict = {"chunks": 4} if kind(name).chunked_steps else {}
    if name == "interleaved-1f1b":
        kw["stages_per_rank"] = 2
    stages = 1 if name == "data-parallel" else 4
    s = make_schedule(name, stages, 10**6, replicas=[2] if name == "data-parallel" else None,
                      **kw)
    report = validate(s)  # on the validation window, not a million microbatches
    assert s.validation_microbatches is not None and s.validation_microbatches < 200
    assert all(p <= b for p, b in zip(report.peak_versions, s.max_versions))
    first = [list(itertools.islice(s.program(r), 50)) for r in range(s.num_ranks)]
    assert all(len(f) == 50 for f in first)
    assert s.is_stream and s._actions is None  # nothing was materialised on the way


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_a_window_is_the_prefix_of_the_stream(name: str) -> None:
    """The window the validator proves runs the same actions as the long stream, up to the
    window's drain: the steady state is periodic."""
    kw: dict = {"chunks": 4} if kind(name).chunked_steps else {}
    if name == "interleaved-1f1b":
        kw["stages_per_rank"] = 2
    stages = 1 if name == "data-parallel" else 4
    long = make_schedule(name, stages, 4000, replicas=[3] if name == "data-parallel" else None,
                         **kw)
    window = long.window(long.validation_microbatches)
    drain = window.num_microbatches - long.num_ranks * max(long.replicas)
    for rank in range(long.num_ranks):
        short = window.actions[rank]
        head = list(itertools.islice(long.program(rank), len(short)))
        agree = next((i for i, (a, b) in enumerate(zip(head, short)) if a != b), len(short))
        # From the first difference on, the window only drains its last microbatches.
        assert all(a.microbatch >= drain for a in short[agree:] if a.microbatch is not None)
        assert agree > len(short) // 2


# --- zero bubble ----------------------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (6, 12)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_its_memory(p: int, m: int) -> None:
    """Equal forward, input-gradient and weight-gradient costs: ZB-H1 idles (p - 1) per step
    where 1F1B idles 3(p - 1), and no stage stashes more than 1F1B's first stage does."""
    steps = 3
    costs = UnitCosts(forward=1, backward=2)  # I and W take half a backward each
    zb = make_schedule("zb-h1", p, m * steps, chunks=m)
    plain = make_schedule("1f1b", p, m * steps, chunks=m)
    work = 3 * m * steps
    zb_bubble = simulate(zb, costs).makespan - work
    plain_bubble = simulate(plain, costs).makespan - work
    assert plain_bubble == pytest.approx(3 * (p - 1) * steps)
    assert zb_bubble == pytest.approx(plain_bubble / 3)
    assert max(validate(zb).peak_inflight) == max(validate(plain).peak_inflight) == p


def test_zb_h1_splits_every_backward_and_defers_weights() -> None:
    s = make_schedule("zb-h1", 3, 6)
    for rank in range(3):
        kinds = [a.kind for a in s.actions[rank] if a.kind.is_compute]
        assert K.BACKWARD not in kinds
        assert kinds.count(K.BACKWARD_INPUT) == kinds.count(K.BACKWARD_WEIGHT) == 6
    last = [a.to_text() for a in compute(s, 2)]
    assert last[:4] == ["2F0@0", "2I0@0", "2F1@0", "2I1@0"]  # its weights wait: stage 0 can go on
