"""zb-v and looped-bfs: the validator accepts them over a range of sizes, the simulator's
bubble at unit costs is the published one (derived below), and training with them equals
gradient accumulation (the plain loop's minibatch SGD) on rank threads and on processes,
with clipping and, on threads, a weight tied across stages (looped-bfs; zb-v holds the
embedding and the head on one rank, where ties are refused)."""

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
from pipedream_fast.schedules.zb_v import v_ranks
from pipedream_fast.sim import UnitCosts, simulate
from runtime_reference import train_reference_with

K = ActionKind
CHUNKS, BATCH, STEPS, CLIP = 4, 8, 3, 0.5
V_RANKS = [[0], [1], [1], [0]]  # zb-v on 2 ranks: rank 0 holds stages 0 and 3
LOOPED_RANKS = [[0], [1], [0], [1]]  # looped-bfs on 2 ranks: stage g on rank g mod 2
PLACEMENTS = {"zb-v": V_RANKS, "looped-bfs": LOOPED_RANKS}


def test_registered_trainable_synchronous_and_not_chosen_by_auto() -> None:
    for name in PLACEMENTS:
        assert name in TRAINABLE and name in SYNCHRONOUS and name not in AUTOMATIC
    assert kind("zb-v").split_backward and not kind("looped-bfs").split_backward
    assert v_ranks(2) == V_RANKS
    assert make_schedule("zb-v", 4, 8, stages_per_rank=2).stage_ranks == ((0,), (1,), (1,), (0,))
    assert make_schedule("looped-bfs", 4, 8, stages_per_rank=2).stage_ranks == \
        ((0,), (1,), (0,), (1,))
    with pytest.raises(ValueError, match="zb-v needs the V placement"):
        make_schedule("zb-v", 4, 8, stage_ranks=LOOPED_RANKS)


# --- the validator ----------------------------------------------------------------------------

@st.composite
def configs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(sorted(PLACEMENTS)))
    m = draw(st.integers(1, 9))
    kw: dict[str, Any] = {"chunks": m}
    n = m * draw(st.integers(1, 3)) - draw(st.integers(0, m - 1))  # a short last step too
    if draw(st.booleans()):  # the schedule's own placement
        p = draw(st.integers(1, 4))
        v = 2 if name == "zb-v" else draw(st.integers(1, 3))
        return name, {"num_stages": p * v, "num_microbatches": n, "stages_per_rank": v, **kw}
    stages = draw(st.integers(1, 4))  # one stage per rank, replicated
    replicas = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    return name, {"num_stages": stages, "num_microbatches": n, "replicas": replicas, **kw}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


def lm_pipeline(name: str) -> Pipeline:
    return Pipeline(lm(), lm_loss, sgd, plan=plan(name, [(0, 1), (1, 2), (2, 3), (3, 4)]),
                    schedule=name, chunks=CHUNKS, timeout=30, ranks="threads", workers=2,
                    clip_grad_norm=CLIP)


def test_a_weight_tied_across_stages_trains_exactly_with_looped_bfs() -> None:
    """The embedding (stage 0, rank 0) and the output head (stage 3, rank 1) share a weight."""
    g = torch.Generator().manual_seed(2)
    data = [(x, (x + 1) % VOCAB) for x in (torch.randint(0, VOCAB, (BATCH, 6), generator=g)
                                           for _ in range(STEPS))]
    want = train_reference_with(lm(), data, CHUNKS, lm_loss, sgd, clip_grad_norm=CLIP)
    pipe = lm_pipeline("looped-bfs")
    try:
        list(pipe.train(data))
        got = pipe.state_dict()
    finally:
        pipe.close()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_zb_v_refuses_an_embedding_tied_to_the_head_on_its_one_rank() -> None:
    """The V puts the first and the last stage on rank 0, and ties are summed across ranks
    only: a tied embedding and head is refused, by name, before any work."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (BATCH, 6), generator=g)
    with pytest.raises(ValueError, match="tied weights need their stages on different ranks"):
        pipe = lm_pipeline("zb-v")
        try:
            list(pipe.train([(x, (x + 1) % VOCAB)]))
        finally:
            pipe.close()


def process_job(rank: int, world: int) -> dict[str, tuple[list[float], dict]]:
    out = {}
    for name in sorted(PLACEMENTS):
        losses, state, _ = train(name, plan=plan(name), clip_grad_norm=CLIP, timeout=60)
        out[name] = (losses, state)
    return out


@pytest.mark.slow
def test_processes_equal_gradient_accumulation_with_clipping() -> None:
    results = launch(process_job, 2, timeout=120)
    want = reference(mlp(), batches(), CLIP)
    for name in PLACEMENTS:
        assert_exact(*results[0][name], want)  # rank 0 gathers every stage's weights
        assert results[1][name][0] == pytest.approx(want[0], rel=1e-6)
