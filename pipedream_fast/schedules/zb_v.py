"""ZB-V, the zero-bubble schedule on a V-shaped placement (Qi et al., "Zero Bubble Pipeline
Parallelism", section 6), flushed every step.

Placement: the model is cut into 2p stages for p ranks, and rank r holds stages r and
2p - 1 - r (`v_ranks`): its "chunk 0" on the way down and its "chunk 1" on the way back, so
the last stage sits on rank 0 with the first and every rank does the same work. Backwards are
split as in ZB-H1: BACKWARD_INPUT (I) makes the input gradient the stage before waits for,
BACKWARD_WEIGHT (W) the weight gradient nobody waits for.

Each rank's order for a step of m microbatches (the paper's hand-made ZB-V, as PyTorch's
ScheduleZBVZeroBubble writes it down), counting microbatches per chunk from 0:
  warm-up   2(p - r) - 1 forwards of chunk 0; then r times a forward of chunk 1 and one of
            chunk 0; then p - r times a forward of chunk 1 and its I and W;
  steady    while forwards remain: a forward of chunk 0 (if any left), I and W of chunk 0,
            a forward of chunk 1, I and W of chunk 1;
  cool-down r times I of chunk 0 and I of chunk 1; p - r times I of chunk 0 and a W of
            chunk 0; then the W's left, chunk 1's first.
The order is written for max(m, 2p - 1) microbatches and the ones beyond m are dropped, so a
short step keeps the same shape. Each stage then steps once on the averaged gradients (the
result of gradient accumulation). At most 2p chunk-microbatches are in flight per rank:
p microbatches of a whole rank's share of the model, 1F1B's first-stage memory. With equal
forward, input-gradient and weight-gradient costs the steady state has no bubble: every step
after the first adds exactly its work to the run (tests/test_new_schedules.py).

On a placement with one stage per rank there is no V to fold: zb-v runs ZB-H1 there, the
zero-bubble schedule at the same memory (so every schedule runs on a plain pipeline).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules import zb_h1
from pipedream_fast.schedules.common import Config, Program, build, ordered_steps
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, ScheduleKind, flush_options, register

NAME = "zb-v"


def v_ranks(num_ranks: int) -> list[list[int]]:
    """The V placement of 2 x num_ranks stages: rank r holds stages r and 2p - 1 - r."""
    p = num_ranks
    return [[g if g < p else 2 * p - 1 - g] for g in range(2 * p)]


def v_placement(num_stages: int, stages_per_rank: int) -> list[list[int]]:
    """`stages_per_rank` for zb-v: 2 is the V placement, 1 one stage per rank."""
    if stages_per_rank == 1:
        return [[g] for g in range(num_stages)]
    if stages_per_rank != 2 or num_stages % 2:
        raise ValueError(f"zb-v holds 2 stages per rank in a V (or 1), on an even number of "
                         f"stages; got {stages_per_rank} stages per rank for {num_stages} stages")
    return v_ranks(num_stages // 2)


def is_v(layout: Layout) -> bool:
    """Whether the layout is a V placement (else it must hold one stage per rank)."""
    p = layout.num_ranks
    return layout.num_stages == 2 * p and \
        layout.stage_ranks == tuple(tuple(r) for r in v_ranks(p))


def rank_order(p: int, rank: int, m: int) -> Iterator[tuple[str, int, int]]:
    """('F'|'I'|'W', chunk 0|1, index within the step) in the order `rank` runs them for a
    step of m microbatches (see the module docstring)."""
    n = max(m, 2 * p - 1)
    f, i, w = [0, 0], [0, 0], [0, 0]  # per chunk: forwards, I's and W's made so far
    out: list[tuple[str, int]] = []

    def op(kind: str, chunk: int) -> None:
        count = f if kind == "F" else i if kind == "I" else w
        out.append((kind, chunk))
        count[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        op("F", 0)
    for _ in range(rank):
        op("F", 1)
        op("F", 0)
    for _ in range(p - rank):
        op("F", 1)
        op("I", 1)
        op("W", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            op("F", 0)
        op("I", 0)
        op("W", 0)
        op("F", 1)
        op("I", 1)
        op("W", 1)
    for _ in range(rank):
        op("I", 0)
        op("I", 1)
    for _ in range(p - rank):
        op("I", 0)
        op("W", 0)
    for chunk in (1, 0):
        while w[chunk] < i[chunk]:
            op("W", chunk)
    assert f == i == w == [n, n], (f, i, w)
    seen = {(kind, c): 0 for kind in "FIW" for c in (0, 1)}
    for kind, chunk in out:
        index = seen[(kind, chunk)]
        seen[(kind, chunk)] += 1
        if index < m:
            yield kind, chunk, index


def most_in_flight(p: int, rank: int, m: int) -> int:
    """The most chunk-microbatches `rank` holds between a forward and its W in a step of m."""
    held = peak = 0
    for kind, _, _ in rank_order(p, rank, m):
        held += 1 if kind == "F" else -1 if kind == "W" else 0
        peak = max(peak, held)
    return peak


def held_at_peak(order: Iterable[tuple[str, int, int]], chunks: int,
                 releases: str = "W") -> tuple[int, ...]:
    """Per chunk, the microbatches a rank holds (from a forward to its `releases` action) at
    the moment it holds the most in all: the split of `most_in_flight` over its stages (of
    the moments of that peak, the one that holds the most in the later chunks)."""
    held, moments = [0] * chunks, [tuple([0] * chunks)]
    for kind, chunk, _ in order:
        held[chunk] += 1 if kind == "F" else -1 if kind in releases else 0
        moments.append(tuple(held))
    peak = max(sum(m) for m in moments)
    return max((m for m in moments if sum(m) == peak), key=lambda m: m[::-1])


def v_stage_stashed(order: Callable[[int, int, int], Iterable[tuple[str, int, int]]],
                    releases: str, least: Callable[[int], int] = lambda p: 1
                    ) -> Callable[[int, int, int, int], int]:
    """`ScheduleKind.stage_stashed` of a schedule on the V placement (`order` as in
    `generate_v`; steps of fewer than `least(p)` microbatches it refuses): stage g of 2p
    has NOAM 2p - g and is chunk 0 of rank g (g < p) or chunk 1 of rank 2p - 1 - g; it counts
    its chunk's share of the rank's peak (`held_at_peak`). Elsewhere, 1F1B's min(NOAM, m)."""
    def rule(ranks: int, stages_per_rank: int, noam: int, microbatches: int) -> int:
        p = ranks
        if stages_per_rank != 2 or not 1 <= noam <= 2 * p or microbatches < least(p):
            return min(noam, microbatches)
        g = 2 * p - noam
        rank, chunk = (g, 0) if g < p else (2 * p - 1 - g, 1)
        return _split(order, releases, p, rank, microbatches)[chunk]
    return rule


@functools.lru_cache(maxsize=256)
def _split(order: Callable[[int, int, int], Iterable[tuple[str, int, int]]], releases: str,
           p: int, rank: int, m: int) -> tuple[int, ...]:
    return held_at_peak(order(p, rank, m), 2, releases)


def generate(config: Config) -> Schedule:
    return generate_v(config, NAME, rank_order, most_in_flight)


def generate_v(config: Config, name: str,
               order: Callable[[int, int, int], Iterable[tuple[str, int, int]]],
               in_flight: Callable[[int, int, int], int]) -> Schedule:
    """A schedule on the V placement from its rank order: `order(p, rank, microbatches)`
    gives a step's compute as (kind, 0 or 1 for stage rank or 2p-1-rank, index), and
    `in_flight(p, rank, microbatches)` the most microbatches the rank holds at once. One
    stage per rank (no V) runs zb-h1."""
    layout = config.layout
    if not is_v(layout):
        return zb_h1.generate(config, name)  # one stage per rank (`_options` checked it)
    p = layout.num_ranks

    def compute(rank: int) -> Iterator[Action]:
        return ordered_steps(config, (Program(rank), Program(2 * p - 1 - rank)),
                             lambda m: order(p, rank, m))

    ranks = range(p)
    sizes = {len(config.group(g)) for g in {0, config.num_groups() - 1}}
    inflight = {r: max(in_flight(p, r, size) for size in sizes) for r in ranks}
    return build(name, config, compute, dict.fromkeys(ranks, 2), inflight)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    config, params = flush_options(layout, options)
    if is_v(layout):
        return config, {**params, "stages_per_rank": 2, "placement": "v"}
    if any(len(layout.stages_of(r)) != 1 for r in range(layout.num_ranks)):
        raise ValueError(f"zb-v needs the V placement, rank r holding stages r and 2p - 1 - r, "
                         f"e.g. {v_ranks(2)} on 2 ranks (or one stage per rank, where it runs "
                         f"ZB-H1); got {[list(r) for r in layout.stage_ranks]}")
    return config, params


register(ScheduleKind(
    name=NAME, order=9, generate=generate, options=_options, synchronous=True,
    summary="zero-bubble V: 2 stages per rank in a V (r and 2p-1-r), I and W split, "
            "flushed every step",
    plans_as="1f1b", split_backward=True, planning={"stages_per_rank": 2, "placement": "v"},
    weight_versions=lambda noam: 1, stashed=lambda noam, microbatches: min(noam, microbatches),
    stage_stashed=v_stage_stashed(rank_order, "W"), stage_versions=lambda v: v,
    placement=v_placement))
