"""PipeDream: asynchronous 1F1B with weight stashing (1F1B-RR across stage replicas).

Each replica keeps NOAM microbatches in flight and never flushes. Every round of r
microbatches (one per replica of the stage) ends in an all-reduce and a step on the newest
weights, so a forward reads the newest version and its backward the very same one; the
retention pass stashes versions for in-flight microbatches (NOAM live versions at most).

With vertical sync, stage s reads the version stage 0 used for the microbatch: the newest of
its versions that holds only updates stage 0's version had, i.e. (v0 * r0) // r_s (v0 itself
when both stages have the same replica count). Later stages then keep older versions alive.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import (STALENESS, Options, ScheduleKind, no_options,
                                               register, staleness_params)


def generate(config: Config, vertical_sync: bool = False) -> Schedule:
    layout = config.layout
    name = "pipedream-vsync" if vertical_sync else "pipedream"
    n = layout.num_microbatches

    def compute(rank: int) -> Iterator[Action]:
        s, i = layout.only_stage(rank, name)
        r, noam, p = layout.replicas(s), layout.noam(s), Program(s)
        local = layout.local_mbs(s, i)
        for kind, m in one_f_one_b(local, noam):
            if kind == "B":
                yield p.backward(m)
                q = m // r  # the round of m: microbatches q*r .. q*r + r - 1
                yield from p.step(range(q * r, min(n, q * r + r)), replicated=r > 1)
            elif vertical_sync and s > 0:
                yield p.forward(m, (stage0_version(layout, m) * layout.replicas(0)) // r)
            else:
                yield p.forward(m)
        rounds = math.ceil(n / r)
        if len(local) < rounds:  # no microbatch of its own in the last round
            yield from p.step(range((rounds - 1) * r, n), replicated=r > 1)

    ranks = range(layout.num_ranks)
    versions, inflight = {}, {}
    for rank in ranks:
        s, i = layout.only_stage(rank, name)
        inflight[rank] = min(layout.noam(s), len(layout.local_mbs(s, i)))
        versions[rank] = vsync_versions(layout, s) if vertical_sync else layout.noam(s)
    return build(name, config, compute, versions, inflight)


def stage0_version(layout: Layout, mb: int) -> int:
    """The version stage 0 reads for microbatch mb. Its replica steps once per backward, and
    in 1F1B the forward of its k-th microbatch follows the backward of its (k - w)-th, w being
    the warm-up: so the version is max(0, k - w + 1)."""
    r0 = layout.replicas(0)
    warmup = max(1, min(layout.noam(0), len(layout.local_mbs(0, mb % r0))))
    return max(0, mb // r0 - warmup + 1)


def vsync_versions(layout: Layout, stage: int) -> int:
    """Live versions a stage keeps under vertical sync.

    When stage 0 forwards microbatch m, the r0 * (NOAM_0 - 1) microbatches before it that
    stage 0 still has in flight have not updated its version yet; stage s has (or will have)
    finished their rounds by the time it forwards m, so the version it must read lags its
    newest by up to r0 * (NOAM_0 - 1) / r_s rounds, all of which stay live. Without replicas
    that is S versions on every stage. (Checked against the validator for S <= 5 and
    replica counts up to 4 in tests/test_schedules.py.)
    """
    r0 = layout.replicas(0)
    return math.ceil(r0 * (layout.noam(0) - 1) / layout.replicas(stage)) + 1


def _options(layout: Layout, options: Options) -> tuple[Config, dict]:
    no_options("pipedream", options)
    return Config(layout), staleness_params(options)


register(ScheduleKind(
    name="pipedream", order=2, generate=generate, options=_options, chunked_steps=False,
    automatic=True, own_options=(STALENESS,),
    summary="asynchronous 1F1B with weight stashing: an update after every round",
    weight_versions=lambda noam: noam, stashed=lambda noam, microbatches: noam))
