"""PipeDream-2BW: asynchronous 1F1B with double-buffered weights.

Microbatches come in groups of m = `step_microbatches`. Group g runs forward and backward on
version max(g - 1, 0) on every stage; after a replica's last backward of group g the stage
all-reduces and steps, creating version g + 1 from group g's accumulated gradients. So
W(t+1) = W(t) - lr * grad f(W(t-1)): gradients are one version stale, and with m >= the
number of workers (and a multiple of every replica count) at most 2 versions are ever live.
"""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b


def generate(config: Config) -> Schedule:
    layout, m = config.layout, config.step_microbatches
    groups = config.groups()
    programs, inflight = {}, {}
    for s in range(layout.num_stages):
        r, noam = layout.replicas(s), layout.noam(s)
        for i, rank in enumerate(layout.stage_ranks[s]):
            p = Program(s)
            local = layout.local_mbs(s, i)
            last_of_group = {max(mb for mb in local if mb // m == g): g
                             for g in {mb // m for mb in local}}
            for kind, mb in one_f_one_b(local, noam):
                if kind == "F":
                    p.forward(mb, max(mb // m - 1, 0))
                    continue
                p.backward(mb)
                if mb in last_of_group:
                    p.step(groups[last_of_group[mb]], replicated=r > 1)
            for g in sorted(set(range(len(groups))) - set(last_of_group.values())):
                p.step(groups[g], replicated=r > 1)  # trailing group with none of its own
            programs[rank] = p.actions
            inflight[rank] = min(noam, len(local))
    return build("2bw", config, programs, dict.fromkeys(programs, 2), inflight)
