"""DualPipeV (DeepSeek-V3's DualPipe folded onto one model copy, "cut-in-half" DualPipe, as
PyTorch's ScheduleDualPipeV writes it down after deepseek-ai/DualPipe), flushed every step.

Placement: zb-v's V: the model is cut into 2p stages for p ranks, and rank r holds stages r
and 2p - 1 - r (`zb_v.v_ranks`), its chunk 0 on the way down and its chunk 1 on the way back.
Backwards are whole (B) where they overlap a forward and split (I, then W later) where a W can
fill a gap.

Each rank's order for a step of m microbatches (m >= 2p), counting microbatches per chunk
from 0; "F0 + B1" is an overlapped pair, a forward of chunk 0 and the whole backward of
chunk 1 run back to back:
  1  2(p - r - 1) forwards of chunk 0;
  2  r + 1 times a forward of chunk 0 and one of chunk 1;
  3  p - r - 1 times I of chunk 1, the oldest W held back, a forward of chunk 1;
  4  m - 2p + r + 1 times the pair F0 + B1 and the pair F1 + B0 (on the last rank the first
     F0 and B1 are not paired: two single actions, as torch has them);
  5  p - r - 1 times B of chunk 1 and the pair F1 + B0;
  6  r + 1 times a backward of chunk 1 and one of chunk 0, whole in the first half and split
     (I only) from the middle on (on odd ranks from the middle's chunk-1 backward, on even
     ones from its chunk-0 backward);
  7  p - r - 1 times the oldest W held back and a backward (I) of chunk 0;
  8  the r + 1 W's still held back, oldest first.
Each stage then steps once on the averaged gradients (the result of gradient accumulation).

Overlapped pairs. DualPipe's point is that the two halves of a pair run together, the
forward's communication (MoE all-to-all, pipeline sends) hidden behind the backward's compute
and the other way round; torch's default runtime runs a pair's two halves one after the other
unless a custom overlap function is registered. The IR has no fused action and needs none:
a pair is its forward then its backward, consecutive in the rank's stream, which the
executor runs back to back (the lowering puts between them only what costs no compute: the
forward's send and the receive posted for its gradient), and which the simulator times as
the two actions in sequence. So the order is torch's exactly (tests/test_new_schedules.py
compares every rank's compute actions); what differs is where sends go: the shared lowering
sends a forward's activation right after the forward, inside the pair, where torch sends both
halves' tensors after the pair; receives are posted as early as their buffers are known
(torch posts one when its sender sends).

Microbatches per step: torch refuses fewer than the 2p stages (rank 0's steps 1 and 2 alone
forward 2p - 1 microbatches of chunk 0, and step 4 would run a negative number of times
below that); so does this schedule, for the step and for a shorter last step, naming the
rule. On a placement with one stage per rank there is no V to fold:
dualpipe-v then runs ZB-H1 (as zb-v does), so every schedule runs on a plain pipeline.
A weight tied across the first and last stage (which the V puts on rank 0) gets a copy per
stage there, their gradients summed on the rank before the update (`rank.cutting`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, ScheduleKind, flush_options, register
from pipedream_fast.schedules.zb_v import (generate_v, is_v, v_placement, v_ranks,
                                           v_stage_stashed)

NAME = "dualpipe-v"


def rank_order(p: int, rank: int, m: int) -> Iterator[tuple[str, int, int]]:
    """('F'|'B'|'I'|'W', chunk 0|1, index within the step) in the order `rank` runs them for
    a step of m >= 2p microbatches (see the module docstring); an overlapped pair is its
    forward and then its whole backward ('B')."""
    yield from _order(p, rank, m)[0]


def pairs(p: int, rank: int, m: int) -> list[int]:
    """Where the overlapped pairs' forwards are in `rank_order` (each backward follows)."""
    return _order(p, rank, m)[1]


def _order(p: int, rank: int, m: int) -> tuple[list[tuple[str, int, int]], list[int]]:
    if m < 2 * p:
        raise ValueError(f"dualpipe-v needs at least 2p = {2 * p} microbatches per step, got {m}")
    r = rank
    counts = {kind: [0, 0] for kind in "FIW"}  # a whole backward counts as an I and a W
    held: deque[tuple[int, int]] = deque()  # (chunk, index) of I's whose W is put off
    out: list[tuple[str, int, int]] = []
    paired: list[int] = []

    def op(kind: str, chunk: int) -> None:
        index = counts["I" if kind == "B" else kind][chunk]
        out.append((kind, chunk, index))
        if kind == "B":
            counts["I"][chunk] += 1
            counts["W"][chunk] += 1
            return
        counts[kind][chunk] += 1
        if kind == "I":
            held.append((chunk, index))

    def weight() -> None:
        if held:
            chunk, index = held.popleft()
            out.append(("W", chunk, index))
            counts["W"][chunk] += 1

    def pair(forward: int) -> None:  # an overlapped pair: F of one chunk, B of the other
        paired.append(len(out))
        op("F", forward)
        op("B", 1 - forward)

    for _ in range(2 * (p - r - 1)):  # 1: F0
        op("F", 0)
    for _ in range(r + 1):  # 2: F0 F1
        op("F", 0)
        op("F", 1)
    for _ in range(p - r - 1):  # 3: I1 W F1
        op("I", 1)
        weight()
        op("F", 1)
    for i in range(m - 2 * p + r + 1):  # 4: F0+B1, F1+B0
        if i == 0 and r == p - 1:  # not overlapped, to shorten the bubble (torch's note)
            op("F", 0)
            op("B", 1)
        else:
            pair(0)
        pair(1)
    for _ in range(p - r - 1):  # 5: B1, F1+B0
        op("B", 1)
        pair(1)
    split = False
    for i in range(r + 1):  # 6: B1 B0, split from the middle on
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        op("I" if split else "B", 1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        op("I" if split else "B", 0)
    for _ in range(p - r - 1):  # 7: W, I0
        weight()
        op("I" if split else "B", 0)
    for _ in range(r + 1):  # 8: W
        weight()
    assert not held and counts["F"] == counts["I"] == counts["W"] == [m, m], counts
    return out, paired


def most_in_flight(p: int, rank: int, m: int) -> int:
    """The most chunk-microbatches `rank` holds between a forward and the end of its backward
    (its W, or its whole B) in a step of m."""
    held = peak = 0
    for kind, _, _ in rank_order(p, rank, m):
        held += 1 if kind == "F" else -1 if kind in "WB" else 0
        peak = max(peak, held)
    return peak


def placement(num_stages: int, stages_per_rank: int) -> list[list[int]]:
    """`stages_per_rank` for dualpipe-v: 2 is the V placement (zb-v's), 1 one stage per rank."""
    try:
        return v_placement(num_stages, stages_per_rank)
    except ValueError as error:
        raise ValueError(str(error).replace("zb-v", NAME)) from None


def step_sizes(config: Config) -> set[int]:
    """The microbatches per step: `chunks`, and the last step's where it is shorter."""
    return {len(config.group(g)) for g in {0, config.num_groups() - 1}}


def generate(config: Config) -> Schedule:
    return generate_v(config, NAME, rank_order, most_in_flight)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    config, params = flush_options(layout, options)
    if not is_v(layout):
        if any(len(layout.stages_of(r)) != 1 for r in range(layout.num_ranks)):
            raise ValueError(f"dualpipe-v needs the V placement, rank r holding stages r and "
                             f"2p - 1 - r, e.g. {v_ranks(2)} on 2 ranks (or one stage per rank, "
                             f"where it runs ZB-H1); got {[list(r) for r in layout.stage_ranks]}")
        return config, params
    stages = layout.num_stages
    short = min(step_sizes(config))
    if short < stages:
        which = "a step" if short == config.chunks else "the last step"
        raise ValueError(f"dualpipe-v needs at least as many microbatches per step as stages "
                         f"(2p = {stages} on {layout.num_ranks} ranks), but {which} holds "
                         f"{short} (chunks, --chunks: at least {stages}, and dividing the "
                         f"number of microbatches)")
    return config, {**params, "stages_per_rank": 2, "placement": "v"}


register(ScheduleKind(
    name=NAME, order=12, generate=generate, options=_options, synchronous=True,
    summary="DualPipeV: 2 stages per rank in a V (r and 2p-1-r), overlapped forward and "
            "backward pairs run back to back, W's split off into the gaps, flushed every step",
    plans_as="1f1b", split_backward=True, planning={"stages_per_rank": 2, "placement": "v"},
    default_chunks=lambda workers: 2 * workers,  # its order needs at least 2p per step
    weight_versions=lambda noam: 1, stashed=lambda noam, microbatches: min(noam, microbatches),
    stage_stashed=v_stage_stashed(rank_order, "WB", least=lambda p: 2 * p),
    stage_versions=lambda v: v, placement=placement))
