"""Interleaved 1F1B (Megatron-LM's virtual pipeline), flushed every step.

Each of the p ranks holds v stages in a looped placement: stage g runs on rank g mod p, so
rank r holds stages r, r + p, ..., r + (v - 1)p ("chunks" 0..v-1). A step's microbatches go
through the ranks v times, in rounds of p microbatches (so a step holds a multiple of p):
each round runs through chunks 0..v-1 in order for forwards and in reverse for backwards.
After a warm-up of 2(p - r - 1) + (v - 1)p forwards, rank r alternates a forward and a
backward, then drains; each stage then steps once with the averaged gradients
(the same result as gradient accumulation). The bubble shrinks by v against 1F1B, for v
times the activation sends.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, ScheduleKind, flush_options, register


def looped(layout: Layout) -> tuple[int, int]:
    """(p ranks, v stages per rank) of a looped placement, or a ValueError saying why not."""
    p = layout.num_ranks
    want = tuple((g % p,) for g in range(layout.num_stages))
    if layout.stage_ranks != want or layout.num_stages % p:
        raise ValueError(f"interleaved-1f1b needs a looped placement, stage g on rank g mod p "
                         f"with the same number of stages on every rank and no replicas, e.g. "
                         f"{[list(r) for r in want]}; got {[list(r) for r in layout.stage_ranks]}")
    return p, layout.num_stages // p


def units(p: int, v: int, m: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, index in the step) of a rank's forwards (or backwards) in a step of m
    microbatches: rounds of p microbatches, each through the chunks in order (backwards: in
    reverse)."""
    out = []
    for start in range(0, m, p):
        for c in range(v):
            chunk = v - 1 - c if backward else c
            out += [(chunk, i) for i in range(start, min(start + p, m))]
    return out


def rank_order(p: int, v: int, rank: int, m: int) -> Iterator[tuple[str, int, int]]:
    """('F'|'B', chunk, index within the step) in the order rank runs them for a step of m
    microbatches: Megatron's warm-up of 2(p - rank - 1) + (v - 1)p forwards, then one forward
    and one backward at a time, then the remaining backwards."""
    forwards, backwards = units(p, v, m, False), units(p, v, m, True)
    warmup = min(len(forwards), 2 * (p - rank - 1) + (v - 1) * p)
    for chunk, i in forwards[:warmup]:
        yield "F", chunk, i
    for k in range(len(forwards) - warmup):
        yield ("F", *forwards[warmup + k])
        yield ("B", *backwards[k])
    for chunk, i in backwards[len(forwards) - warmup:]:
        yield "B", chunk, i


def generate(config: Config) -> Schedule:
    layout, m = config.layout, config.chunks
    p, v = looped(layout)

    def compute(rank: int) -> Iterator[Action]:
        programs = {c: Program(c * p + rank) for c in range(v)}
        for g in range(config.num_groups()):
            group = config.group(g)
            for kind, chunk, i in rank_order(p, v, rank, len(group)):
                prog, mb = programs[chunk], group.start + i
                yield prog.forward(mb) if kind == "F" else prog.backward(mb)
            for chunk in reversed(range(v)):
                yield from programs[chunk].step(group, replicated=False)

    ranks = range(layout.num_ranks)
    inflight = {r: min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in ranks}
    return build("interleaved-1f1b", config, compute, dict.fromkeys(ranks, v), inflight)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    config, params = flush_options(layout, options)
    p, v = looped(layout)
    m = config.chunks
    if m % p or layout.num_microbatches % m:
        # Megatron's warm-up assumes whole rounds; with a short last round it can deadlock.
        raise ValueError(f"interleaved-1f1b runs a step's microbatches in rounds of the {p} "
                         f"ranks: microbatches per step must be a multiple of {p} and divide "
                         f"the {layout.num_microbatches} microbatches, got {m} (--chunks)")
    return config, {**params, "stages_per_rank": v}


register(ScheduleKind(
    name="interleaved-1f1b", order=7, generate=generate, options=_options, synchronous=True,
    automatic=True,
    summary="interleaved 1F1B: v looped stages per rank, bubble / v, flushed every step",
    plans_as="1f1b", planning={"stages_per_rank": 2}, weight_versions=lambda noam: 1,
    stashed=lambda noam, microbatches: min(noam, microbatches)))
