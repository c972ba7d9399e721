"""The simulator: closed forms with unit costs, costs from a Profile + Plan, and the timing
rules (per-rank order kept, data dependencies and transfers respected)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from pipedream_fast.formats import BlockProfile, Plan, Profile, StagePlan
from pipedream_fast.ir import ActionKind
from pipedream_fast.schedules import make_schedule
from pipedream_fast.schedules.common import Layout
from pipedream_fast.sim import ProfileCosts, UnitCosts, simulate
from pipedream_fast.topology import Topology

from tests.test_schedules import configs

K = ActionKind


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 12])
def test_gpipe_bubble_closed_form(p: int, m: int) -> None:
    result = simulate(make_schedule("gpipe", p, m), UnitCosts())
    assert result.makespan == 2 * (m + p - 1)
    assert result.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    for rank in result.ranks:  # every stage sits out the same (p - 1) / (m + p - 1)
        assert 1 - rank.busy / result.makespan == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("n", [1, 3, 8, 17])
def test_pipedream_makespan_closed_form(stages: int, n: int) -> None:
    assert simulate(make_schedule("pipedream", stages, n), UnitCosts()).makespan == \
        2 * n + 2 * (stages - 1)


def test_1f1b_flush_matches_gpipe_time_with_less_memory() -> None:
    one, fill = (simulate(make_schedule(name, 4, 10), UnitCosts()) for name in ("1f1b", "gpipe"))
    assert one.makespan == fill.makespan == 2 * (10 + 4 - 1)
    assert [r.peak_stashed for r in one.ranks] == [4, 3, 2, 1]
    assert [r.peak_stashed for r in fill.ranks] == [10] * 4


@pytest.mark.parametrize("replicas, noam", [([1] * 5, 5), ([1] * 3, 3), ([2, 1, 1], 2),
                                            ([3, 2, 1], 2), ([1, 2], 3)])
def test_noam_versions_at_stage_zero(replicas: list[int], noam: int) -> None:
    # NOAM = ceil(workers from stage 0 on / replicas of stage 0)
    s = make_schedule("pipedream", len(replicas), 40, replicas=replicas)
    result = simulate(s, UnitCosts())
    assert Layout(len(replicas), 40, s.stage_ranks).noam(0) == noam
    for rank in s.stage_ranks[0]:
        assert result.ranks[rank].peak_versions == noam
        assert result.ranks[rank].peak_stashed == noam


def test_gpipe_with_transfer_cost() -> None:
    # Every forward hop and every backward hop adds c to the critical path: 2(p-1)c more.
    for c in (0.25, 1.0):
        result = simulate(make_schedule("gpipe", 3, 5), UnitCosts(comm=c))
        assert result.makespan == pytest.approx(2 * (5 + 3 - 1) + 2 * 2 * c)


def test_data_parallel_all_reduce() -> None:
    # 3 workers, 7 microbatches round-robin: worker 0 gets 0, 3, 6 (3 forward+backward pairs,
    # 6 units), workers 1 and 2 two each (4); all wait for worker 0, then all-reduce (0.5).
    result = simulate(make_schedule("data-parallel", 1, 7, replicas=[3]), UnitCosts(comm=0.5))
    assert result.makespan == pytest.approx(6.5)
    assert [r.comm for r in result.ranks] == [0.5, 0.5, 0.5]
    assert [r.busy for r in result.ranks] == [6, 4, 4]


def two_stage_plan(replicas: tuple[int, int], topology: Topology | None) -> tuple[Profile, Plan]:
    blocks = [BlockProfile(f"b{i}", forward_ms=f, backward_ms=2 * f, activation_bytes=a,
                           parameter_bytes=p, optimizer_state_bytes=0)
              for i, (f, a, p) in enumerate([(1.0, 4_000_000, 10_000_000),
                                             (2.0, 2_000_000, 30_000_000),
                                             (1.5, 1_000_000, 5_000_000),
                                             (0.5, 8, 1_000_000)])]
    profile = Profile(model="toy", batch_size=8, device="cpu", blocks=blocks)
    r0, r1 = replicas
    stages = [StagePlan(0, 2, r0, tuple(range(r0)), 3.0),
              StagePlan(2, 4, r1, tuple(range(r0, r0 + r1)), 2.0)]
    extra = {"topology": topology.to_dict()} if topology else {}
    plan = Plan(model="toy", batch_size=8, workers=r0 + r1, schedule="gpipe", stages=stages,
                bottleneck_ms=3.0, data_parallel_ms=9.0, extra=extra)
    return profile, plan


def test_profile_costs_by_hand() -> None:
    profile, plan = two_stage_plan((1, 1), None)
    costs = ProfileCosts.from_plan(profile, plan, bandwidth=1e9, latency_ms=0.1)
    assert costs.forward_ms == (3.0, 2.0) and costs.backward_ms == (6.0, 4.0)
    # The cut after stage 0 is block 1's output: 2 MB at 1 GB/s = 2 ms, plus 0.1 ms latency.
    s = make_schedule("gpipe", 2, 1, stage_ranks=[list(st.ranks) for st in plan.stages])
    result = simulate(s, costs)
    # F0 3 + send 2.1 + F1 2 + B1 4 + send 2.1 + B0 6
    assert result.makespan == pytest.approx(19.2)
    assert result.time_unit == "ms"


def test_profiled_optimizer_steps_and_weight_copies_are_charged_per_stage() -> None:
    """Blocks that measured an update and a weight copy charge them to their stage's
    OPTIMIZER_STEP (step and clearing; the averaging pass only for an update of several
    microbatches) and SNAPSHOT; a profile without them keeps the old costs (0 and the global
    optimizer_ms)."""
    profile, plan = two_stage_plan((1, 1), None)
    old = ProfileCosts.from_plan(profile, plan, optimizer_ms=0.25)
    assert old.stage_optimizer_ms == () and old.snapshot_ms == ()
    for k, block in enumerate(profile.blocks):
        block.extra.update(optimizer_ms=0.5 * (k + 1), grad_zero_ms=0.01, grad_scale_ms=0.02,
                           snapshot_ms=0.1 * (k + 1))
    costs = ProfileCosts.from_plan(profile, plan, optimizer_ms=0.25)
    assert costs.stage_optimizer_ms == pytest.approx((1.52, 3.52))  # blocks 0+1, 2+3
    assert costs.grad_scale_ms == pytest.approx((0.04, 0.04))
    assert costs.snapshot_ms == pytest.approx((0.3, 0.7))
    layout = [list(st.ranks) for st in plan.stages]
    s = make_schedule("pipedream", 2, 8, stage_ranks=layout)
    charged = {(r.action.kind, r.action.stage): r.end - r.start
               for r in simulate(s, costs).records
               if r.action.kind in (K.OPTIMIZER_STEP, K.SNAPSHOT)}
    assert charged[(K.OPTIMIZER_STEP, 1)] == pytest.approx(3.52)  # one microbatch: no mean
    assert charged[(K.SNAPSHOT, 0)] == pytest.approx(0.3)
    assert simulate(s, costs).makespan > simulate(s, old).makespan
    flush = make_schedule("1f1b", 2, 8, stage_ranks=layout, chunks=4)
    updates = [r.end - r.start for r in simulate(flush, costs).records
               if r.action.kind is K.OPTIMIZER_STEP and r.action.stage == 1]
    assert updates == pytest.approx([3.56, 3.56])  # the mean over 4 microbatches: one pass


def test_profile_costs_use_the_plan_topology() -> None:
    topo = Topology.parse("2x10e9,2x1e9")  # ranks 0,1 share a server; rank 2 is remote
    profile, plan = two_stage_plan((2, 1), topo)
    costs = ProfileCosts.from_plan(profile, plan, bandwidth=123.0)
    s = make_schedule("gpipe", 2, 4, stage_ranks=[list(st.ranks) for st in plan.stages])
    result = simulate(s, costs)
    sends = [r for r in result.records if r.action.kind is K.SEND_ACT]
    assert sends and all(r.action.peer == 2 for r in sends)
    # Activation of the cut (2 MB) crosses the 1 GB/s level: 2 ms per transfer.
    assert costs.transfer(sends[0].action, 0, 2) == pytest.approx(2.0)
    # Ring all-reduce of stage 0 (40 MB) between ranks 0 and 1 at 10 GB/s: 2*1/2*40e6/10e9 s.
    reduce = [r for r in result.records if r.action.kind is K.ALLREDUCE]
    assert len(reduce) == 2
    assert all(r.end - r.ready == pytest.approx(4.0) for r in reduce)


def test_profile_and_plan_must_match() -> None:
    profile, plan = two_stage_plan((1, 1), None)
    profile.batch_size = 16
    with pytest.raises(ValueError, match="batch size"):
        ProfileCosts.from_plan(profile, plan)


@settings(max_examples=60, deadline=None)
@given(configs())
def test_timing_rules_hold_for_any_schedule(config) -> None:
    name, kw = config
    s = make_schedule(name, **kw)
    result = simulate(s, UnitCosts(forward=1.0, backward=2.0, comm=0.3))
    by_rank: dict[int, list] = {}
    for rec in result.records:
        by_rank.setdefault(rec.rank, []).append(rec)
    for rank, recs in by_rank.items():
        assert [r.index for r in recs] == list(range(len(s.actions[rank])))  # IR order kept
        for before, after in zip(recs, recs[1:]):
            assert after.start >= before.end - 1e-9  # one action at a time
    ends = {(r.action.kind, r.action.stage, r.action.microbatch): r.end for r in result.records
            if r.action.kind.is_compute}
    for rec in result.records:
        a = rec.action
        if a.kind is K.FORWARD and a.stage > 0:
            assert rec.start >= ends[(K.FORWARD, a.stage - 1, a.microbatch)] - 1e-9
        if a.kind is K.BACKWARD:
            assert rec.start >= ends[(K.FORWARD, a.stage, a.microbatch)] - 1e-9
            if a.stage < s.num_stages - 1:
                assert rec.start >= ends[(K.BACKWARD, a.stage + 1, a.microbatch)] - 1e-9
    assert max(r.busy for r in result.ranks) <= result.makespan + 1e-9
    assert 0 <= result.idle_fraction < 1


def test_several_stages_per_rank() -> None:
    from tests.test_ir import INTERLEAVED

    result = simulate(INTERLEAVED, UnitCosts())
    assert result.makespan == 8  # four forwards, then four backwards, alternating ranks
    assert [r.busy for r in result.ranks] == [4, 4]
