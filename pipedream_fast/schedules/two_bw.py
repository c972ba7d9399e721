"""PipeDream-2BW: asynchronous 1F1B with double-buffered weights.

Microbatches come in groups of m = `chunks`. Group g runs forward and backward on
version max(g - 1, 0) on every stage; after a replica's last backward of group g the stage
all-reduces and steps, creating version g + 1 from group g's accumulated gradients. So
W(t+1) = W(t) - lr * grad f(W(t-1)): gradients are one version stale, and with m >= the
number of workers (and a multiple of every replica count) at most 2 versions are ever live.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import (STALENESS, Options, ScheduleKind, register,
                                               staleness_params)


def generate(config: Config) -> Schedule:
    layout, m, n = config.layout, config.chunks, config.layout.num_microbatches

    def compute(rank: int) -> Iterator[Action]:
        s, i = layout.only_stage(rank, "2bw")
        r, noam, p = layout.replicas(s), layout.noam(s), Program(s)
        local = layout.local_mbs(s, i)
        for kind, mb in one_f_one_b(local, noam):
            if kind == "F":
                yield p.forward(mb, max(mb // m - 1, 0))
                continue
            yield p.backward(mb)
            g = mb // m
            if mb + r >= min(n, g * m + m):  # its replica's last microbatch of group g
                yield from p.step(config.group(g), replicated=r > 1)
        # A trailing short group with no microbatch of this replica still steps (all-reduce).
        first_without = (local[-1] // m + 1) if len(local) else 0
        for g in range(first_without, config.num_groups()):
            yield from p.step(config.group(g), replicated=r > 1)

    ranks = range(layout.num_ranks)
    inflight = {}
    for rank in ranks:
        s, i = layout.only_stage(rank, "2bw")
        inflight[rank] = min(layout.noam(s), len(layout.local_mbs(s, i)))
    return build("2bw", config, compute, dict.fromkeys(ranks, 2), inflight)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    reps = [len(r) for r in layout.stage_ranks]
    workers, lcm = layout.num_ranks, math.lcm(*reps)
    m = options.chunks or math.ceil(workers / lcm) * lcm
    if m < workers or m % lcm:
        raise ValueError(f"2bw needs chunks >= the number of workers ({workers}) "
                         f"and a multiple of every replica count {reps}, so that at most 2 "
                         f"weight versions are live; got {m}")
    return Config(layout, chunks=m), {"chunks": m, **staleness_params(options)}


register(ScheduleKind(
    name="2bw", order=4, generate=generate, options=_options,
    automatic=True, own_options=(STALENESS,),
    summary="PipeDream-2BW: double-buffered weights, an update every chunks",
    weight_versions=lambda noam: 2, stashed=lambda noam, microbatches: noam))
