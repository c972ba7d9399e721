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

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config, Layout, Program, build, one_f_one_b


def generate(config: Config, vertical_sync: bool = False) -> Schedule:
    layout = config.layout
    n = layout.num_microbatches
    programs, versions, inflight = {}, {}, {}
    stage0_version: dict[int, int] = {}
    for s in range(layout.num_stages):
        r, noam = layout.replicas(s), layout.noam(s)
        rounds = [list(range(q * r, min(n, q * r + r))) for q in range(math.ceil(n / r))]
        for i, rank in enumerate(layout.stage_ranks[s]):
            p = Program(s)
            local = layout.local_mbs(s, i)
            for kind, m in one_f_one_b(local, noam):
                if kind == "B":
                    p.backward(m)
                    p.step(rounds[m // r], replicated=r > 1)
                elif s == 0:
                    stage0_version[m] = p.forward(m)
                else:
                    p.forward(m, (stage0_version[m] * layout.replicas(0)) // r
                              if vertical_sync else None)
            if len(local) < len(rounds):  # no microbatch of its own in the last round
                p.step(rounds[-1], replicated=r > 1)
            programs[rank] = p.actions
            inflight[rank] = min(noam, len(local))
            versions[rank] = vsync_versions(layout, s) if vertical_sync else noam
    return build("pipedream-vsync" if vertical_sync else "pipedream", config, programs,
                 versions, inflight)


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
