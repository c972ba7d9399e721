"""Interleaved zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", its ZB-1P order on
looped stages, as PyTorch's ScheduleInterleavedZeroBubble writes it down), flushed every step.

Placement: the looped one of interleaved 1F1B, p ranks holding v stages each, stage g on rank
g mod p (`make_schedule(..., stages_per_rank=v)`): rank r holds stages r, r + p, ...,
r + (v - 1)p, its "chunks" 0..v-1. Backwards are split as in ZB-H1: BACKWARD_INPUT (I) makes
the input gradient the stage before waits for, BACKWARD_WEIGHT (W) the weight gradient nobody
waits for.

A step of m microbatches runs in R = max(1, m // p) rounds of n = m / R microbatches each
(torch's "flexible" rounds: m need not be a multiple of p, but R must divide m). Rank r
counts its v m forwards k = 0, 1, ... through chunk (k // n) mod v, and its backwards
j = 0, 1, ... through chunk v - 1 - (j // n) mod v, each chunk's microbatches in order:
  warm-up   w = min((v - 1) n + p - 1 - r, v m) forwards;
  steady    for each forward left: the forward, then the next I, then, once r I's have run
            since the warm-up, the oldest W held back (rank r puts off its W's by r);
  cool-down each I left, followed by the oldest W held back (again after the first r);
  drain     the W's still held back, oldest first.
Each stage then steps once on the averaged gradients (the result of gradient accumulation).
The warm-up is one forward shorter per rank from the last than interleaved 1F1B's two:
the I's race back through the pipeline while the W's fill the gaps. With a forward, an I and
a W of one unit per stage, every step idles p - 1 units: the paper's ZB-1P bubble
(p - 1)(F + B - 2W) at one stage's costs (B the whole backward), a third of interleaved 1F1B's
(tests/test_new_schedules.py, against torch's order too). On one stage per rank
(v = 1) this is ZB-H1's order exactly; there, and on any placement that is not looped
(replicated stages), interleaved-zb runs ZB-H1 (`zb_h1.py`), so every schedule runs on a
plain pipeline.

Against torch. The compute order of every rank is torch's (tests/test_new_schedules.py
compares them action by action). torch's list also holds idle slots (None), which place its
actions in time for its own dry run and its bubble insertion (`_add_bubbles_to_actions`);
the IR has no idle actions, as a rank here waits on its inputs, so they are dropped, which
changes no rank's order. Communication is added by the shared lowering (each send right
after the compute that makes it, receives posted as early as their buffers are known) rather
than by torch's `_add_send_recv`, which posts a receive when its sender sends; a stage's input
receive is posted right after the rank's forward of the microbatch on the stage before
(`early_inputs`, as looped-bfs does): with rounds of more than p microbatches the last rank
sends a round's activations ahead of rank 0's forwards on its next stage, and under the
one-message-per-link rule (`pipedream_fast.ir.validator`) late receives would deadlock it.

Microbatches per step. torch refuses an m that R = max(1, m // p) does not divide (p = 4:
m = 9, R = 2): the rounds would not hold every microbatch once per chunk. So does this
schedule, for the step's size and for a shorter last step, naming the rule.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from typing import Any

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules import zb_h1
from pipedream_fast.schedules.common import Config, Program, build, ordered_steps
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, ScheduleKind, flush_options, register
from pipedream_fast.schedules.zb_v import held_at_peak

NAME = "interleaved-zb"


def looped_stages(layout: Layout) -> int | None:
    """v, the stages per rank of a looped placement with v >= 2 (stage g on rank g mod p, no
    replicas), or None for any other placement (where ZB-H1 runs)."""
    p = layout.num_ranks
    if layout.num_stages <= p or layout.num_stages % p:
        return None
    if layout.stage_ranks != tuple((g % p,) for g in range(layout.num_stages)):
        return None
    return layout.num_stages // p


def rounds_error(p: int, m: int) -> str | None:
    """Why a step of m microbatches cannot run on p ranks (torch's rule), or None."""
    rounds = max(1, m // p)
    if m % rounds == 0:
        return None
    return (f"a step of {m} microbatches on {p} ranks runs in max(1, m // p) = {rounds} rounds, "
            f"which must divide m")


def rank_order(p: int, v: int, rank: int, m: int) -> Iterator[tuple[str, int, int]]:
    """('F'|'I'|'W', chunk, index within the step) in the order `rank` runs them for a step
    of m microbatches (see the module docstring)."""
    n = m // max(1, m // p)  # microbatches per round
    total = v * m
    warmup = min((v - 1) * n + p - 1 - rank, total)
    counts = {kind: [0] * v for kind in "FIW"}
    held: deque[tuple[int, int]] = deque()  # (chunk, index) of I's whose W is put off

    def op(kind: str, chunk: int) -> tuple[str, int, int]:
        index = counts[kind][chunk]
        counts[kind][chunk] += 1
        if kind == "I":
            held.append((chunk, index))
        return kind, chunk, index

    def weight() -> tuple[str, int, int]:
        chunk, index = held.popleft()
        counts["W"][chunk] += 1
        return "W", chunk, index

    for k in range(total + warmup):
        if k < total:
            yield op("F", (k // n) % v)
        if k >= warmup:
            j = k - warmup  # the backward's number
            yield op("I", v - 1 - (j // n) % v)
            if j >= rank:
                yield weight()
    while held:
        yield weight()
    assert counts["F"] == counts["I"] == counts["W"] == [m] * v, counts


def most_in_flight(p: int, v: int, rank: int, m: int) -> int:
    """The most chunk-microbatches `rank` holds between a forward and its W in a step of m."""
    held = peak = 0
    for kind, _, _ in rank_order(p, v, rank, m):
        held += 1 if kind == "F" else -1 if kind == "W" else 0
        peak = max(peak, held)
    return peak


def stage_stashed(ranks: int, stages_per_rank: int, noam: int, microbatches: int) -> int:
    """`ScheduleKind.stage_stashed`: stage g of the looped p x v has NOAM pv - g and is chunk
    g // p of rank g mod p; it counts its chunk's share of the rank's peak (`held_at_peak`).
    Elsewhere (one stage per rank: ZB-H1; steps torch refuses), 1F1B's min(NOAM, m)."""
    p, v, m = ranks, stages_per_rank, microbatches
    if v < 2 or not 1 <= noam <= p * v or rounds_error(p, m) is not None:
        return min(noam, m)
    g = p * v - noam
    return _split(p, v, g % p, m)[g // p]


@functools.lru_cache(maxsize=256)
def _split(p: int, v: int, rank: int, m: int) -> tuple[int, ...]:
    return held_at_peak(rank_order(p, v, rank, m), v)


def step_sizes(config: Config) -> set[int]:
    """The microbatches per step: `chunks`, and the last step's where it is shorter."""
    return {len(config.group(g)) for g in {0, config.num_groups() - 1}}


def generate(config: Config) -> Schedule:
    layout = config.layout
    v = looped_stages(layout)
    if v is None:
        return zb_h1.generate(config, NAME)  # one stage per rank, or replicas
    p = layout.num_ranks

    def compute(rank: int) -> Iterator[Action]:
        return ordered_steps(config, [Program(c * p + rank) for c in range(v)],
                             lambda m: rank_order(p, v, rank, m))

    ranks = range(p)
    inflight = {r: max(most_in_flight(p, v, r, size) for size in step_sizes(config))
                for r in ranks}
    return build(NAME, config, compute, dict.fromkeys(ranks, v), inflight,
                 early_inputs=True)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    config, params = flush_options(layout, options)
    v = looped_stages(layout)
    if v is None:
        if any(len(layout.stages_of(r)) != 1 for r in range(layout.num_ranks)):
            p = layout.num_ranks
            want = [[g % p] for g in range(layout.num_stages)]
            raise ValueError(f"interleaved-zb needs a looped placement, stage g on rank g mod p "
                             f"with the same number of stages on every rank and no replicas, "
                             f"e.g. {want} (or one stage per rank, where it runs ZB-H1); got "
                             f"{[list(r) for r in layout.stage_ranks]}")
        return config, params
    p = layout.num_ranks
    for m in sorted(step_sizes(config)):
        why = rounds_error(p, m)
        if why is not None:
            which = "the last step" if m != config.chunks else "a step"
            raise ValueError(f"interleaved-zb runs {which}'s microbatches in rounds: {why} "
                             f"(chunks, --chunks: an m that max(1, m // {p}) divides, such as a "
                             f"multiple of {p} or any m below {2 * p}, and dividing the "
                             f"number of microbatches)")
    return config, {**params, "stages_per_rank": v}


register(ScheduleKind(
    name=NAME, order=11, generate=generate, options=_options, synchronous=True,
    summary="interleaved zero bubble: v looped stages per rank, I and W split, W's put off "
            "into the bubbles, flushed every step",
    plans_as="1f1b", split_backward=True, planning={"stages_per_rank": 2},
    weight_versions=lambda noam: 1, stashed=lambda noam, microbatches: min(noam, microbatches),
    stage_stashed=stage_stashed, stage_versions=lambda v: v))
