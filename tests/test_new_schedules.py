"""zb-v, looped-bfs, interleaved-zb and dualpipe-v: the validator accepts them over a range of
sizes (and the last two refuse, naming the rule, the microbatch counts they cannot run), the
simulator's bubble at unit costs is the published one (derived below, or computed from
torch's own order), interleaved-zb and dualpipe-v run torch's order action by action, and
training with them equals gradient accumulation (the plain loop's minibatch SGD) on rank
threads and on processes, with clipping and a weight tied across stages (an embedding and
the head: on two ranks with looped placements, on one rank in the V)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.ir import ActionKind, validate
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.schedules import AUTOMATIC, SYNCHRONOUS, TRAINABLE, kind, make_schedule
from pipedream_fast.schedules import dualpipe_v, interleaved_zb
from pipedream_fast.schedules.zb_v import v_ranks
from pipedream_fast.sim import UnitCosts, simulate
from runtime_reference import train_reference_with

K = ActionKind
CHUNKS, BATCH, STEPS, CLIP = 4, 8, 3, 0.5
V_RANKS = [[0], [1], [1], [0]]  # zb-v on 2 ranks: rank 0 holds stages 0 and 3
LOOPED_RANKS = [[0], [1], [0], [1]]  # looped-bfs on 2 ranks: stage g on rank g mod 2
PLACEMENTS = {"zb-v": V_RANKS, "looped-bfs": LOOPED_RANKS, "interleaved-zb": LOOPED_RANKS,
              "dualpipe-v": V_RANKS}
SPLIT = {"zb-v", "interleaved-zb", "dualpipe-v"}  # split backwards (I and W)


def test_registered_trainable_synchronous_and_not_chosen_by_auto() -> None:
    for name, ranks in PLACEMENTS.items():
        assert name in TRAINABLE and name in SYNCHRONOUS and name not in AUTOMATIC
        assert kind(name).split_backward == (name in SPLIT)
        assert make_schedule(name, 4, 8, stages_per_rank=2).stage_ranks == \
            tuple(tuple(r) for r in ranks)
    assert v_ranks(2) == V_RANKS
    for name, other in (("zb-v", LOOPED_RANKS), ("dualpipe-v", LOOPED_RANKS),
                        ("interleaved-zb", V_RANKS)):
        with pytest.raises(ValueError, match=f"{name} needs (the V|a looped) placement"):
            make_schedule(name, 4, 8, stage_ranks=other)
    with pytest.raises(ValueError, match="dualpipe-v holds 2 stages per rank"):
        make_schedule("dualpipe-v", 6, 8, stages_per_rank=3)


# --- the validator ----------------------------------------------------------------------------

def runs(name: str, p: int, m: int) -> bool:
    """Whether `name` on its own placement over p ranks takes steps of m microbatches:
    dualpipe-v at least the 2p stages, interleaved-zb rounds of max(1, m // p) dividing m."""
    if name == "dualpipe-v":
        return m >= 2 * p
    return name != "interleaved-zb" or interleaved_zb.rounds_error(p, m) is None


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(sorted(PLACEMENTS)))
    m = draw(st.integers(1, 9))
    kw: dict[str, Any] = {"chunks": m}
    n = m * draw(st.integers(1, 3)) - draw(st.integers(0, m - 1))  # a short last step too
    if draw(st.booleans()):  # the schedule's own placement
        p = draw(st.integers(1, 4))
        v = 2 if name in ("zb-v", "dualpipe-v") else draw(st.integers(1, 3))
        if v > 1:  # steps (and a short last one) of the sizes the schedule takes
            m = draw(st.sampled_from([k for k in range(1, 13) if runs(name, p, k)]))
            last = draw(st.sampled_from([k for k in range(1, m + 1) if runs(name, p, k)]))
            kw, n = {"chunks": m}, m * draw(st.integers(0, 2)) + last
        return name, {"num_stages": p * v, "num_microbatches": n, "stages_per_rank": v, **kw}
    stages = draw(st.integers(1, 4))  # one stage per rank, replicated
    replicas = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    return name, {"num_stages": stages, "num_microbatches": n, "replicas": replicas, **kw}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_size_validates(config: tuple[str, dict[str, Any]]) -> None:
    name, kw = config
    s = make_schedule(name, **kw)
    report = validate(s)
    assert all(p <= b for p, b in zip(report.peak_inflight, s.max_inflight))
    for rank in range(s.num_ranks):  # every microbatch on the rank its placement names
        for a in s.actions[rank]:
            if a.kind.is_compute:
                assert rank == s.rank_of(a.stage, a.microbatch)


def test_zb_v_splits_every_backward_and_holds_1f1b_memory() -> None:
    p, m = 3, 8
    s = make_schedule("zb-v", 2 * p, 2 * m, stages_per_rank=2, chunks=m)
    for rank in range(p):
        kinds = [a.kind for a in s.actions[rank] if a.kind.is_compute]
        assert K.BACKWARD not in kinds
        assert kinds.count(K.BACKWARD_INPUT) == kinds.count(K.BACKWARD_WEIGHT) == 2 * 2 * m
    # 2p chunk-microbatches (each half a rank's share of the model): p whole ones, 1F1B's
    # first-stage memory.
    assert max(validate(s).peak_inflight) == 2 * p


@pytest.mark.parametrize("name, p, m, last", [
    ("interleaved-zb", 2, 3, 2), ("interleaved-zb", 3, 4, 3), ("interleaved-zb", 4, 6, 5),
    ("interleaved-zb", 4, 12, 8), ("dualpipe-v", 1, 2, 2), ("dualpipe-v", 2, 5, 4),
    ("dualpipe-v", 3, 6, 6), ("dualpipe-v", 4, 9, 8)])
def test_the_validator_accepts_several_sizes(name: str, p: int, m: int, last: int) -> None:
    """Two steps of m microbatches and a last one of `last` on p ranks, two stages each,
    within the declared in-flight bounds, each stage stepping once per step."""
    s = make_schedule(name, 2 * p, 2 * m + last, stages_per_rank=2, chunks=m)
    report = validate(s)
    assert all(peak <= bound for peak, bound in zip(report.peak_inflight, s.max_inflight))
    for rank in range(p):
        steps = [a.microbatches for a in s.actions[rank] if a.kind is K.OPTIMIZER_STEP]
        assert steps[::2] == steps[1::2] == [tuple(range(0, m)), tuple(range(m, 2 * m)),
                                             tuple(range(2 * m, 2 * m + last))]


@pytest.mark.parametrize("call, rule", [
    (lambda: make_schedule("interleaved-zb", 8, 18, stages_per_rank=2, chunks=9),
     r"interleaved-zb runs a step's microbatches in rounds: a step of 9 microbatches on 4 "
     r"ranks runs in max\(1, m // p\) = 2 rounds, which must divide m"),
    (lambda: make_schedule("interleaved-zb", 8, 19, stages_per_rank=2, chunks=10),
     r"the last step's microbatches in rounds: a step of 9 microbatches"),
    (lambda: make_schedule("dualpipe-v", 4, 6, stages_per_rank=2, chunks=3),
     r"dualpipe-v needs at least as many microbatches per step as stages \(2p = 4 on 2 "
     r"ranks\), but a step holds 3"),
    (lambda: make_schedule("dualpipe-v", 6, 14, stages_per_rank=2, chunks=6),
     r"stages \(2p = 6 on 3 ranks\), but the last step holds 2"),
    (lambda: make_schedule("dualpipe-v", 4, 4, stages_per_rank=2, chunks=1),
     r"chunks, --chunks: at least 4")])
def test_microbatch_counts_the_schedules_cannot_run_are_refused(call: Any, rule: str) -> None:
    """torch's rules, before anything is generated: interleaved-zb's rounds must hold every
    microbatch once per stage, dualpipe-v's order needs 2p microbatches per step."""
    with pytest.raises(ValueError, match=rule):
        call()


def test_one_stage_per_rank_runs_zb_h1() -> None:
    """Without their placement (one stage per rank, replicas) both run ZB-H1, as zb-v does,
    with any number of microbatches."""
    for name in ("interleaved-zb", "dualpipe-v"):
        for replicas in ([1, 1, 1], [2, 1]):
            s = make_schedule(name, len(replicas), 5, replicas=replicas)
            validate(s)
            plain = make_schedule("zb-h1", len(replicas), 5, replicas=replicas)
            assert s.actions == plain.actions


# --- torch's order --------------------------------------------------------------------------

def torch_interleaved_zb(p: int, v: int, m: int) -> dict[int, list[Any]]:
    """torch's ScheduleInterleavedZeroBubble order per rank (compute actions, idle slots
    dropped), from its own generator; the class is built without stages or a process group."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble as Torch
    schedule = Torch.__new__(Torch)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    return {r: [a for a in schedule._calculate_single_rank_operations(r) if a is not None]
            for r in range(p)}


def torch_dualpipe_v(p: int, m: int) -> dict[int, list[Any]]:
    """torch's ScheduleDualPipeV order per rank (an overlapped pair: one action whose
    sub_actions are its forward and its whole backward)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV as Torch
    schedule = Torch.__new__(Torch)
    schedule.pp_group_size, schedule._n_microbatches = p, m
    return {r: schedule._calculate_single_rank_operations(r) for r in range(p)}


TORCH_CODE = {K.FORWARD: "F", K.BACKWARD: "B", K.BACKWARD_INPUT: "I", K.BACKWARD_WEIGHT: "W"}


def ours(s: Any, rank: int) -> list[str]:
    """A rank's compute actions of the first step in torch's text ("2F0": stage, kind, mb)."""
    return [f"{a.stage}{TORCH_CODE[a.kind]}{a.microbatch}" for a in s.actions[rank]
            if a.kind.is_compute and a.version == 0]


def theirs(actions: list[Any]) -> list[str]:
    """torch's actions flattened: an overlapped pair is its forward then its backward."""
    return [str(sub) for a in actions for sub in (a.sub_actions or (a,))]


@pytest.mark.parametrize("p, v, m", [(1, 2, 3), (2, 2, 2), (2, 2, 3), (2, 3, 4), (3, 2, 3),
                                     (3, 2, 8), (4, 2, 4), (4, 2, 6), (4, 3, 10), (4, 2, 3),
                                     (3, 1, 5), (4, 1, 8)])
def test_interleaved_zb_runs_torchs_order(p: int, v: int, m: int) -> None:
    """v = 1 too, where this schedule runs ZB-H1: torch's order is ZB-H1's there."""
    s = make_schedule("interleaved-zb", p * v, 2 * m, stages_per_rank=v, chunks=m)
    want = torch_interleaved_zb(p, v, m)
    for rank in range(p):
        assert ours(s, rank) == theirs(want[rank])


@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (2, 7), (3, 6), (3, 10), (4, 8), (4, 11)])
def test_dualpipe_v_runs_torchs_order_with_its_pairs_back_to_back(p: int, m: int) -> None:
    """Every rank's compute actions are torch's, and each overlapped pair's forward and
    backward are consecutive in the rank's stream, with only its forward's send and the
    receive posted for that forward's gradient between them."""
    s = make_schedule("dualpipe-v", 2 * p, 2 * m, stages_per_rank=2, chunks=m)
    want = torch_dualpipe_v(p, m)
    for rank in range(p):
        assert ours(s, rank) == theirs(want[rank])
        stream = s.actions[rank]
        at = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(stream)}
        found = 0
        for pair in (a.sub_actions for a in want[rank] if a.sub_actions):
            f, b = pair
            i = at[(K.FORWARD, f.stage_index, f.microbatch_index)]
            j = at[(K.BACKWARD, b.stage_index, b.microbatch_index)]
            between = {(a.kind, a.stage, a.microbatch) for a in stream[i + 1:j]}
            assert i < j and between <= {(K.SEND_ACT, f.stage_index, f.microbatch_index),
                                         (K.RECV_GRAD, f.stage_index, f.microbatch_index)}
            found += 1
        assert found == len(dualpipe_v.pairs(p, rank, m)) > 0


# --- the simulator's bubble at unit costs -----------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m_over", [0, 1, 5])
def test_zb_v_has_no_bubble_in_steady_state(p: int, m_over: int) -> None:
    """F = I = W = 1 per stage, m >= 2p - 1 microbatches per step (what ZB-V needs):

        makespan(steps) = 6 m steps + (p - 1).

    Derivation: every rank does 2 stages x m x (F + I + W) = 6m units per step. Rank p - 1
    holds the bottom of the V (stages p - 1 and p): its first forward waits for microbatch 0
    to cross stages 0..p-2, p - 1 units, and from then on it never idles (the warm-up fills
    the pipe both ways, the steady state alternates F, I, W of both chunks, the cool-down's
    held-back W's fill what the drain leaves), across step boundaries too, since a rank's
    next step only needs its own update. The other ranks finish no later. So the bubble of
    each step in the steady state is 0 (the zero-bubble paper's ZB-V at T_F = T_B = T_W),
    and the whole run idles p - 1 units once, at the start; 1F1B idles 3(p - 1) x 2 (its
    stages twice as big) every step."""
    m = 2 * p - 1 + m_over
    costs = UnitCosts(forward=1, backward=2, backward_input=1, backward_weight=1)
    makespans = []
    for steps in (1, 2, 3):
        s = make_schedule("zb-v", 2 * p, m * steps, stages_per_rank=2, chunks=m)
        makespans.append(simulate(s, costs).makespan)
        assert makespans[-1] == pytest.approx(6 * m * steps + (p - 1))
    assert makespans[2] - makespans[1] == pytest.approx(6 * m)  # a step adds its work, no more


ZB_COSTS = UnitCosts(forward=1, backward=2, backward_input=1, backward_weight=1)


def torch_makespan(orders: dict[int, list[Any]], num_stages: int, whole_pairs: bool) -> float:
    """A peer of the simulator, on torch's own order: one step at F = I = W = 1 (a whole
    backward B = 2), free transfers. Each rank runs its actions in order, each when the rank
    is free and its inputs exist: a forward the stage before's forward, an I or B the stage
    after's I or B (the last stage: its own forward), a W its I. With `whole_pairs` an
    overlapped pair is one unit that starts once both halves' inputs exist (DualPipe's
    overlap); without, its forward runs and then its backward, which waits for its gradient
    only then (how the IR runs a pair)."""
    units = {r: [[(a.stage_index, a.computation_type.value, a.microbatch_index)
                  for a in (x.sub_actions or (x,))] for x in acts] for r, acts in orders.items()}
    if not whole_pairs:
        units = {r: [[a] for u in us for a in u] for r, us in units.items()}
    end: dict[tuple[int, str, int], float] = {}

    def ready(stage: int, kind: str, mb: int) -> float | None:
        if kind == "F":
            needs = [(stage - 1, "F")] if stage > 0 else []
        elif kind == "W":
            needs = [(stage, "I")]
        else:
            needs = [(stage, "F")] + ([(stage + 1, "IB")] if stage < num_stages - 1 else [])
        times = [next((end[(s, k, mb)] for k in what if (s, k, mb) in end), None)
                 for s, what in needs]  # "IB": whichever of the two the stage ran
        return None if None in times else max(times, default=0.0)

    at, free = dict.fromkeys(units, 0), dict.fromkeys(units, 0.0)
    while any(at[r] < len(units[r]) for r in units):
        moved = False
        for r in units:
            while at[r] < len(units[r]):
                unit = units[r][at[r]]
                inputs = [ready(*a) for a in unit]
                if None in inputs:
                    break
                t = max(free[r], *(x for x in inputs if x is not None))
                for stage, code, mb in unit:
                    t += 2 if code == "B" else 1
                    end[(stage, code, mb)] = t
                free[r], at[r], moved = t, at[r] + 1, True
        assert moved, "torch's order deadlocks"
    return max(free.values())


@pytest.mark.parametrize("p, v, m", [(1, 2, 3), (2, 2, 2), (2, 3, 4), (2, 2, 3), (3, 2, 3),
                                     (3, 3, 6), (3, 2, 8), (4, 2, 4), (4, 3, 8), (4, 2, 6)])
def test_interleaved_zb_bubble_is_zb1p_at_one_stages_costs(p: int, v: int, m: int) -> None:
    """F = I = W = 1 per stage (a whole backward 2), p ranks with v looped stages each, m
    microbatches per step:

        makespan = steps x (3 v m + p - 1),

    the bubble of every step is p - 1: the zero-bubble paper's ZB-1P bubble
    (p - 1)(F + B - 2W) with one stage's costs (B the whole backward), a third of interleaved
    1F1B's (p - 1)(F + B) at the same costs, and v times less than ZB-H1's with the model cut
    into p stages of v units. No closed form is derived here for every m: the figure is
    computed from torch's own order (`torch_makespan`, a list schedule of
    ScheduleInterleavedZeroBubble's actions), and the simulator must agree with it."""
    steps = 2
    s = make_schedule("interleaved-zb", p * v, m * steps, stages_per_rank=v, chunks=m)
    makespan = simulate(s, ZB_COSTS).makespan
    peer = torch_makespan(torch_interleaved_zb(p, v, m), p * v, whole_pairs=False)
    assert makespan == pytest.approx(steps * peer)
    assert makespan == pytest.approx(steps * (3 * v * m + p - 1))
    if m % p == 0:
        plain = make_schedule("interleaved-1f1b", p * v, m * steps, stages_per_rank=v, chunks=m)
        bubble = simulate(plain, UnitCosts(1, 2)).makespan - steps * 3 * v * m
        assert bubble == pytest.approx(3 * (makespan - steps * 3 * v * m))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m_over", [0, 1, 5])
def test_dualpipe_v_bubble_against_torchs_order_and_the_published_one(p: int,
                                                                      m_over: int) -> None:
    """F = I = W = 1 per stage (a whole backward 2), p ranks holding 2 stages in a V, m >= 2p
    microbatches per step:

        makespan = steps x (6 m + p - 1),

    which is torch's own order run the way the IR runs it (`torch_makespan`, each pair's
    forward and then its backward). DualPipe's published bubble, (PP/2 - 1)(F&B + B - 3W)
    with PP = 2p stages, is 2(p - 1) at F&B = F + B = 3 (no overlap of compute), B = 2,
    W = 1: the same order when each overlapped pair is one unit that waits for both of its
    inputs, which the peer reproduces. The IR's pair starts its forward without waiting for
    its backward's gradient, so it idles half as long."""
    m, steps = 2 * p + m_over, 2
    s = make_schedule("dualpipe-v", 2 * p, m * steps, stages_per_rank=2, chunks=m)
    makespan = simulate(s, ZB_COSTS).makespan
    order = torch_dualpipe_v(p, m)
    assert makespan == pytest.approx(steps * torch_makespan(order, 2 * p, whole_pairs=False))
    assert makespan == pytest.approx(steps * (6 * m + p - 1))
    published = (2 * p / 2 - 1) * ((1 + 2) + 2 - 3 * 1)
    assert torch_makespan(order, 2 * p, whole_pairs=True) - 6 * m == pytest.approx(published)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])
def test_looped_bfs_bubble_is_the_breadth_first_one(p: int, v: int, m: int) -> None:
    """F = B = 1 per stage, p ranks with v looped stages each, m microbatches per step:

        makespan = steps x 2((v - 1) max(m, p) + m + p - 1).

    Derivation: rank 0 forwards its first stage's m microbatches from time 0. Microbatch 0
    comes back round the loop to rank 0's next stage p units after it started there, and
    rank 0 is free after m units: each of its v - 1 later stages starts max(m, p) after the
    one before. The last rank then forwards the last stage's m microbatches, the last one
    ending (v - 1) max(m, p) + m + p - 1 after the start. The backwards mirror the forwards
    from there (last stage first), and the next step starts on rank 0 when its last backward
    and update are done. For m >= p the bubble per step is 2(p - 1): GPipe's fill and drain
    on p stages of one unit, v times less than GPipe with the model cut into p stages of v
    units, (p - 1) / (v m) of the step's work: the breadth-first paper's bubble."""
    steps = 2
    s = make_schedule("looped-bfs", p * v, m * steps, stages_per_rank=v, chunks=m)
    bfs = simulate(s, UnitCosts()).makespan
    assert bfs == pytest.approx(steps * 2 * ((v - 1) * max(m, p) + m + p - 1))
    if m >= p:
        work = 2 * v * m * steps
        gpipe = simulate(make_schedule("gpipe", p, m * steps, chunks=m), UnitCosts(v, v))
        assert bfs - work == pytest.approx(2 * (p - 1) * steps)
        assert bfs - work == pytest.approx((gpipe.makespan - work) / v)


# --- training equals gradient accumulation ----------------------------------------------------

def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


CUTS = [(0, 2), (2, 4), (4, 6), (6, 7)]  # mlp's 7 blocks as 4 stages


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


loss_fn = nn.CrossEntropyLoss()


def plan(name: str, cuts: list[tuple[int, int]] = CUTS) -> Plan:
    return Plan(model="mlp", batch_size=BATCH, workers=2, schedule=name,
                stages=[StagePlan(a, b, 1, tuple(ranks), 1.0)
                        for (a, b), ranks in zip(cuts, PLACEMENTS[name])],
                bottleneck_ms=1.0, data_parallel_ms=1.0)


def reference(model: nn.Module, data: list, clip: float | None,
              loss: Any = loss_fn) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses: list[float] = []
    state = train_reference_with(model, data, CHUNKS, loss, sgd, clip_grad_norm=clip,
                                 losses=losses)
    return losses, state


def assert_exact(losses: list[float], state: dict[str, torch.Tensor],
                 want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    assert losses == pytest.approx(want[0], rel=1e-6)
    assert set(state) == set(want[1])
    for key, value in want[1].items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=key)


def train(name: str, **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor], Pipeline]:
    options: dict[str, Any] = dict(schedule=name, chunks=CHUNKS, timeout=30)
    options.update(kwargs)
    pipe = Pipeline(options.pop("model", None) or mlp(), options.pop("loss", loss_fn), sgd,
                    **options)
    try:
        losses = [float(x) for x in pipe.train(batches())]
        return losses, pipe.state_dict(), pipe
    finally:
        pipe.close()


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_threads_equal_gradient_accumulation_with_clipping(name: str) -> None:
    want = reference(mlp(), batches(), CLIP)
    unclipped = reference(mlp(), batches(), None)[1]
    assert max((unclipped[k] - want[1][k]).abs().max().item() for k in unclipped) > 1e-3
    losses, state, _ = train(name, plan=plan(name), ranks="threads", workers=2,
                             clip_grad_norm=CLIP)
    assert_exact(losses, state, want)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_the_pipeline_plans_the_schedules_placement(name: str) -> None:
    losses, state, pipe = train(name, ranks="threads", workers=2)
    assert pipe.plan is not None
    assert [list(s.ranks) for s in pipe.plan.stages] == PLACEMENTS[name]
    assert_exact(losses, state, reference(mlp(), batches(), None))


class Head(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.weight = embed.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.weight)


VOCAB, DIM = 11, 8


def lm() -> nn.Module:
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    return nn.Sequential(OrderedDict(embed=embed, mix=nn.Linear(DIM, DIM), act=nn.Tanh(),
                                     head=Head(embed)))


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(x, (x + 1) % VOCAB) for x in (torch.randint(0, VOCAB, (BATCH, 6), generator=g)
                                           for _ in range(STEPS))]


def lm_train(name: str, **options: Any) -> dict[str, torch.Tensor]:
    pipe = Pipeline(lm(), lm_loss, sgd, plan=plan(name, [(0, 1), (1, 2), (2, 3), (3, 4)]),
                    schedule=name, chunks=CHUNKS, timeout=60, clip_grad_norm=CLIP, **options)
    try:
        list(pipe.train(lm_batches()))
        return pipe.state_dict()
    finally:
        pipe.close()


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_a_weight_tied_across_stages_trains_exactly(name: str) -> None:
    """The embedding (stage 0) and the output head (stage 3) share a weight. Looped
    placements hold them on ranks 0 and 1 (interleaved-zb: its W's of the two stages run at
    different times on different ranks; their gradients meet at the update); the V holds
    both on rank 0, each stage with a copy its optimizer steps, the copies' gradients summed
    on the rank."""
    want = train_reference_with(lm(), lm_batches(), CHUNKS, lm_loss, sgd, clip_grad_norm=CLIP)
    got = lm_train(name, ranks="threads", workers=2)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)


def process_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted(PLACEMENTS):
        losses, state, _ = train(name, plan=plan(name), clip_grad_norm=CLIP, timeout=60)
        out[name] = (losses, state)
        out[f"{name} tied"] = lm_train(name)
    return out


@pytest.mark.slow
def test_processes_equal_gradient_accumulation_with_clipping_and_a_tied_weight() -> None:
    results = launch(process_job, 2, timeout=180)
    want = reference(mlp(), batches(), CLIP)
    want_tied = train_reference_with(lm(), lm_batches(), CHUNKS, lm_loss, sgd,
                                     clip_grad_norm=CLIP)
    for name in PLACEMENTS:
        assert_exact(*results[0][name], want)  # rank 0 gathers every stage's weights
        assert results[1][name][0] == pytest.approx(want[0], rel=1e-6)
        for key, value in want_tied.items():
            torch.testing.assert_close(results[0][f"{name} tied"][key], value, rtol=1e-6,
                                       atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_a_v_with_a_tied_weight_resumes_from_its_checkpoint_exactly(name: str, tmp_path) -> None:
    """Rank 0's two copies of the tied weight (stages 0 and 3), and their momentum, are saved
    and restored: two steps, a save, a load, a third step equal three uninterrupted."""
    data = lm_batches()
    want = train_reference_with(lm(), data, CHUNKS, lm_loss, sgd, clip_grad_norm=CLIP)
    options: dict[str, Any] = dict(schedule=name, chunks=CHUNKS, timeout=60, ranks="threads",
                                   workers=2, clip_grad_norm=CLIP)
    pipe = Pipeline(lm(), lm_loss, sgd, plan=plan(name, [(0, 1), (1, 2), (2, 3), (3, 4)]),
                    **options)
    try:
        list(pipe.train(data[:2]))
        pipe.save(str(tmp_path / "ckpt"))
    finally:
        pipe.close()
    restored = Pipeline.load(str(tmp_path / "ckpt"), lm(), lm_loss, sgd, **options)
    try:
        list(restored.train(data[2:]))
        got = restored.state_dict()
    finally:
        restored.close()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)
