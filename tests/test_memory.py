"""Measured memory (`measure_memory=True`, `pipe.memory`; issue 28 item 1): what each stage
holds, counted at its tensors, against counts made by hand from the model and the schedule.

The model: blocks of Linear(64, 64) + Tanh, 2 on stage 0 and 3 on stage 1 (the last a
Linear(64, 4) head). A forward of a Linear+Tanh block keeps its input (for the Linear's
weight gradient) and the Tanh's output (for its own backward); a stage also holds its inputs
and outputs until the microbatch's backward. Stage 0's microbatch inputs are views of the
minibatch, whose storage they hold (counted once). So per microbatch in flight stage 0 holds
2 activations of MB x 64 floats, beside the minibatch; how many microbatches are in flight
is the schedule's: all of them under GPipe, two under 1F1B on 2 stages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipedream_fast.pipeline import Pipeline

BATCH, CHUNKS, WIDTH = 32, 4, 64
FLOAT = 4
MINIBATCH = BATCH * WIDTH * FLOAT
ACTIVATION = BATCH // CHUNKS * WIDTH * FLOAT  # one microbatch's 64 features


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)],
                         nn.Linear(WIDTH, 4))


def batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def measured(schedule: str, chunks: int = CHUNKS, **options: Any) -> dict[int, Any]:
    pipe = Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    balance=[2, 3], schedule=schedule, chunks=chunks, ranks="threads",
                    workers=2, measure_memory=True, timeout=60, **options)
    try:
        list(pipe.train(batches(), steps=3))
        return pipe.memory
    finally:
        pipe.close()


def stage0(memory: dict[int, Any]) -> dict[str, int]:
    return memory[0]["stages"][0]


@pytest.mark.parametrize("schedule, in_flight", [("gpipe", CHUNKS), ("1f1b", 2)])
def test_stage_0_holds_its_in_flight_microbatches_activations(schedule: str, in_flight: int):
    got = stage0(measured(schedule))
    assert got["activations_peak"] == MINIBATCH + in_flight * 2 * ACTIVATION, got


def test_weights_gradients_optimizer_and_versions_are_their_tensors_bytes():
    memory = measured("pipedream", chunks=1)
    params = 2 * (WIDTH * WIDTH + WIDTH) * FLOAT  # stage 0: two Linear(64, 64)
    got = stage0(memory)
    assert got["parameters"] == params and got["gradients"] == params
    assert got["optimizer"] == 2 * params + 2 * 8  # Adam: two moments, a step count each
    assert got["weight_versions"] == 2 * params  # PipeDream stashes 2 versions on stage 0
    last = memory[1]["stages"][1]
    assert last["weight_versions"] == last["parameters"]  # one version on the last stage
    assert got["total_peak"] == sum(v for k, v in got.items() if k != "total_peak")


def test_the_rank_peak_counts_its_stages_together_and_without_measuring_only_weights():
    memory = measured("1f1b")
    rank = memory[0]["rank"]
    assert memory[0]["measured"] and rank["activations_peak"] == stage0(memory)["activations_peak"]
    pipe = Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    balance=[2, 3], schedule="1f1b", chunks=CHUNKS, ranks="threads", workers=2,
                    timeout=60)
    try:
        list(pipe.train(batches(), steps=1))
        plain = pipe.memory[0]
    finally:
        pipe.close()
    assert not plain["measured"] and plain["stages"][0]["activations_peak"] == 0
    assert plain["stages"][0]["parameters"] == stage0(memory)["parameters"]


def test_zero_bubble_holds_more_than_1f1b_until_its_weight_gradients():
    """ZB-H1 keeps a microbatch's graph from its input gradient to its weight gradient."""
    assert measured("zb-h1")[1]["stages"][1]["activations_peak"] > \
        measured("1f1b")[1]["stages"][1]["activations_peak"]


def test_a_traced_run_records_the_memory_over_time_as_counter_tracks(tmp_path):
    from pipedream_fast.trace import write_chrome_trace
    pipe = Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    balance=[2, 3], schedule="gpipe", chunks=CHUNKS, ranks="threads",
                    workers=2, measure_memory=True, timeout=60, trace=True)
    try:
        list(pipe.train(batches(), steps=3))
        samples, memory, events = pipe.last_memory, pipe.memory, pipe.last_events
    finally:
        pipe.close()
    for rank in (0, 1):  # the samples rise to the peak and fall back to nothing held
        mine = [m.bytes for m in samples if m.rank == rank]
        assert max(mine) == memory[rank]["rank"]["activations_peak"] and mine[-1] == 0
    write_chrome_trace(events, tmp_path / "trace.json", memory=samples)
    import json
    counters = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
                if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"rank 0 activations", "rank 1 activations"}
    assert len(counters) == len(samples)


# --- predicted (sim_memory) against measured -------------------------------------------------

@pytest.mark.parametrize("schedule, chunks", [
    ("gpipe", CHUNKS), ("1f1b", CHUNKS), ("zb-h1", CHUNKS), ("2bw", CHUNKS),
    ("pipedream", 1), ("pipedream-vsync", 1)])
def test_the_simulators_memory_prediction_is_within_10_percent_of_the_measurement(
        schedule: str, chunks: int):
    """The prediction comes from the profile (each block measured alone) and the simulated
    schedule; the measurement from the tensors the running stages hold. Every rank's peak
    of activations within 10%, its whole peak and each static part within 1%."""
    import copy

    from pipedream_fast.profiler import profile_model
    from pipedream_fast.sim import ProfileCosts, simulate
    from pipedream_fast.sim_memory import predict_memory
    from pipedream_fast.training import build_schedule

    pipe = Pipeline(build(), F.cross_entropy, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    balance=[2, 3], schedule=schedule, chunks=chunks, ranks="threads",
                    workers=2, measure_memory=True, timeout=60)
    try:
        list(pipe.train(batches(), steps=3))
        measured_memory, plan = pipe.memory, copy.deepcopy(pipe.plan)
    finally:
        pipe.close()
    micro = BATCH // chunks
    profile = profile_model(build(), batches(1)[0][0][:micro], micro, optimizer="adam",
                            warmup=0, repeat=1, progress=False)
    assert plan is not None
    plan.batch_size = micro  # a balance= plan records no profile
    result = simulate(build_schedule(plan, schedule, 3, chunks),
                      ProfileCosts.from_plan(profile, plan))
    predicted = predict_memory(result, profile, plan, micro, chunks)
    for rank in (0, 1):
        got, want = predicted[rank], measured_memory[rank]
        stage = want["stages"][rank]
        for kind, value in got.static.items():
            assert value == pytest.approx(stage[kind], rel=0.01), (rank, kind)
        assert got.activations_peak == pytest.approx(want["rank"]["activations_peak"],
                                                     rel=0.10), rank
        assert got.total_peak == pytest.approx(want["rank"]["total_peak"], rel=0.01), rank


@pytest.mark.parametrize("schedule, chunks", [("gpipe", CHUNKS), ("1f1b", CHUNKS),
                                              ("2bw", CHUNKS), ("pipedream", 1)])
def test_the_planners_memory_figures_agree_with_the_simulators_peak(schedule: str,
                                                                     chunks: int):
    """The planner's per-stage formula (planner/costs.py) against the simulated run's peak,
    rank by rank: within 5% (the formula counts one minibatch in flight on stage 0; the run
    may overlap two)."""
    from pipedream_fast.planner.costs import Costs, MemoryModel
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.sim import ProfileCosts, simulate
    from pipedream_fast.sim_memory import predict_memory
    from pipedream_fast.tracing import trace
    from pipedream_fast.training import build_schedule, manual_plan

    micro = BATCH // chunks
    profile = profile_model(build(), batches(1)[0][0][:micro], micro, optimizer="adam",
                            warmup=0, repeat=1, progress=False)
    plan = manual_plan(trace(build()), 2, schedule, balance=[2, 3])
    plan.batch_size, plan.model = micro, profile.model
    result = simulate(build_schedule(plan, schedule, 3, chunks),
                      ProfileCosts.from_plan(profile, plan))
    simulated = predict_memory(result, profile, plan, micro, chunks)
    costs, memory = Costs.from_profile(profile), MemoryModel(schedule=schedule, chunks=chunks)
    for rank, stage in enumerate(plan.stages):
        planned = memory.replica_bytes(costs, stage.start, stage.stop, noam=2 - rank)
        assert planned == pytest.approx(simulated[rank].total_peak, rel=0.05), rank


# --- shapes that vary (issue 29, item 4) -------------------------------------------------------

LENGTHS = [8, 32, 16]  # sequence lengths of the run's batches: the largest is not the first


def sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of sequences of WIDTH features, each batch its own length; a target per token."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(BATCH, n, WIDTH, generator=g), torch.randint(0, 4, (BATCH, n), generator=g))
            for n in LENGTHS]


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def test_the_memory_prediction_at_the_largest_batch_holds_when_shapes_vary():
    """The plan and its memory figures are made at one batch's shapes. Profiled at the
    largest batch of a run whose lengths vary, the simulator's prediction of every rank's
    peak of activations is within 10% of what the run holds at its largest batch (measured
    at the tensors); profiled at the first (shortest), it is 4x too small: that is why a
    plan under memory_per_worker wants the largest batch as example_inputs."""
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.sim import ProfileCosts, simulate
    from pipedream_fast.sim_memory import predict_memory
    from pipedream_fast.training import build_schedule

    pipe = Pipeline(build(), token_loss, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                    balance=[2, 3], schedule="1f1b", chunks=CHUNKS, ranks="threads",
                    workers=2, measure_memory=True, timeout=60)
    try:
        list(pipe.train(sequences(), steps=len(LENGTHS)))
        measured_memory, plan = pipe.memory, pipe.plan
    finally:
        pipe.close()
    assert plan is not None
    micro = BATCH // CHUNKS
    peaks = {}
    for name, batch in (("largest", sequences()[1]), ("first", sequences()[0])):
        profile = profile_model(build(), batch[0][:micro], micro, optimizer="adam",
                                warmup=0, repeat=1, progress=False)
        plan.batch_size = micro  # a balance= plan records no profile
        result = simulate(build_schedule(plan, "1f1b", len(LENGTHS), CHUNKS),
                          ProfileCosts.from_plan(profile, plan))
        peaks[name] = predict_memory(result, profile, plan, micro, CHUNKS)
    for rank in (0, 1):
        want = measured_memory[rank]["rank"]["activations_peak"]
        assert peaks["largest"][rank].activations_peak == pytest.approx(want, rel=0.10), rank
        assert peaks["first"][rank].activations_peak < 0.3 * want, rank


def test_a_batch_larger_than_the_planned_one_is_told_of_once_under_a_memory_limit(capsys):
    """Planned by the planner at the first batch (length 8) under memory_per_worker, the run
    meets a batch of length 32: one line says so and what to do; the run trains on."""
    pipe = Pipeline(build(), token_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                    stages=2, schedule="1f1b", chunks=CHUNKS, ranks="threads", workers=2,
                    memory_per_worker=1 << 30, timeout=60)
    try:
        losses = list(pipe.train(sequences() * 2, steps=2 * len(LENGTHS)))
    finally:
        pipe.close()
    assert len(losses) == 2 * len(LENGTHS)
    told = [line for line in capsys.readouterr().out.splitlines() if "larger samples" in line]
    assert len(told) == 1, told
    assert told[0].startswith("pipedream_fast: batch 2 of the epoch has larger samples ([32, 64]) "
                              "than the batch the plan was made at ([8, 64])"), told
    assert "pass your largest batch as example_inputs=" in told[0]


def test_a_runs_real_sizes_are_recorded_and_replayed_by_the_simulator():
    """`last_input_bytes` holds each microbatch's input bytes as the run fed them (lengths 8,
    32, 16: 1x, 4x, 2x the first); `SizedCosts` scales each microbatch's compute and
    transfers by them. On one rank, 1 forward + 1 backward a unit each, the replayed run
    lasts 2 x (4 + 16 + 8) microbatch sizes: every action at its own size."""
    from pipedream_fast.ir import ActionKind as K
    from pipedream_fast.sim import SizedCosts, UnitCosts, relative_sizes, simulate
    from pipedream_fast.training import build_schedule, manual_plan
    from pipedream_fast.tracing import trace

    pipe = Pipeline(build(), token_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                    balance=[2, 3], schedule="1f1b", chunks=CHUNKS, ranks="threads",
                    workers=2, timeout=60, trace=True)
    try:
        list(pipe.train(sequences(), steps=len(LENGTHS)))
        sizes = pipe.last_input_bytes
    finally:
        pipe.close()
    per_token = BATCH // CHUNKS * WIDTH * FLOAT
    assert sizes == {s * CHUNKS + i: n * per_token
                     for s, n in enumerate(LENGTHS) for i in range(CHUNKS)}, sizes
    relative = relative_sizes(sizes)
    assert relative[CHUNKS] == 4.0 and relative[2 * CHUNKS] == 2.0
    plan = manual_plan(trace(build()), 1, "gpipe", balance=[5])
    schedule = build_schedule(plan, "gpipe", len(LENGTHS), CHUNKS)
    replayed = simulate(schedule, SizedCosts(UnitCosts(), relative))
    assert replayed.makespan == pytest.approx(2 * CHUNKS * sum(LENGTHS) / LENGTHS[0])
    plain = simulate(schedule, UnitCosts())
    assert plain.makespan == pytest.approx(2 * CHUNKS * len(LENGTHS))
    forwards = [r for r in replayed.records if r.action.kind is K.FORWARD]
    assert {r.end - r.start for r in forwards} == {1.0, 4.0, 2.0}


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v", "interleaved-zb"])
def test_the_planners_memory_figures_agree_with_the_simulators_peak_on_two_stages_per_rank(
        schedule: str):
    """Issue 31: zb-v, dualpipe-v and interleaved-zb on 4 stages over 2 ranks (the V, or
    looped), each rank's two stages summed: the planner's figures told the plan's ranks
    (`MemoryModel.ranks`) against the simulated run's peak within 5%, and their activations
    exactly (a rank's stages do not peak at once: zb-v holds 4 chunk-microbatches, not the
    5 that 1F1B's per-stage rule adds up to, dualpipe-v 5)."""
    import dataclasses

    from pipedream_fast.planner.costs import Costs, MemoryModel
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.schedules import kind
    from pipedream_fast.sim import ProfileCosts, simulate
    from pipedream_fast.sim_memory import predict_memory
    from pipedream_fast.tracing import trace
    from pipedream_fast.training import build_schedule, manual_plan

    ranks, per_rank, chunks = 2, 2, CHUNKS  # dualpipe-v needs 2p = 4 microbatches a step
    stages = ranks * per_rank
    micro = BATCH // chunks
    profile = profile_model(build(), batches(1)[0][0][:micro], micro, optimizer="adam",
                            warmup=0, repeat=1, progress=False)
    place = kind(schedule).placement or (lambda n, v: [[g % (n // v)] for g in range(n)])
    plan = manual_plan(trace(build()), stages, schedule, balance=[1, 1, 1, 2])
    plan = dataclasses.replace(plan, workers=ranks, stages=[
        dataclasses.replace(s, ranks=tuple(r)) for s, r in zip(plan.stages, place(stages, 2))])
    plan.batch_size, plan.model = micro, profile.model
    result = simulate(build_schedule(plan, schedule, 3, chunks),
                      ProfileCosts.from_plan(profile, plan))
    simulated = predict_memory(result, profile, plan, micro, chunks)
    costs = Costs.from_profile(profile)
    memory = MemoryModel(schedule=schedule, chunks=chunks, ranks=ranks,
                         stages_per_rank=per_rank)
    for rank in range(ranks):
        parts = [memory.parts(costs, s.start, s.stop, stages - index, False)
                 for index, s in enumerate(plan.stages) if s.ranks == (rank,)]
        planned = sum(sum(p.values()) for p in parts)
        assert planned == pytest.approx(simulated[rank].total_peak, rel=0.05), rank
        held = sum(p["activations"] + p.get("minibatch", 0) for p in parts)
        assert held == simulated[rank].activations_peak, rank
