"""1F1B with a flush (PipeDream-Flush / Megatron's schedule): per minibatch, each replica
warms up with min(NOAM, its microbatches) forwards, alternates backward/forward, drains, and
the stage steps once with the averaged gradients. Same weights and result as GPipe, but only
NOAM microbatches stashed instead of the whole minibatch."""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b


def generate(config: Config, name: str = "1f1b") -> Schedule:
    layout = config.layout
    programs, inflight = {}, {}
    for s in range(layout.num_stages):
        r, noam = layout.replicas(s), layout.noam(s)
        for i, rank in enumerate(layout.stage_ranks[s]):
            p = Program(s)
            most = 0
            for group in config.groups():
                local = [m for m in group if m % r == i]
                for kind, m in one_f_one_b(local, noam):
                    p.forward(m) if kind == "F" else p.backward(m)
                p.step(group, replicated=r > 1)
                most = max(most, len(local))
            programs[rank] = p.actions
            inflight[rank] = min(noam, most)
    return build(name, config, programs, dict.fromkeys(programs, 1), inflight)
