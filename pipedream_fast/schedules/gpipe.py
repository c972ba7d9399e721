"""GPipe (fill-drain): each replica forwards all its microbatches of a minibatch, then
backwards them all, then the stage takes one step with the averaged gradients. One weight
version; every microbatch of the minibatch stays stashed until the drain."""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config, Program, build


def generate(config: Config) -> Schedule:
    layout = config.layout
    programs, inflight = {}, {}
    for s in range(layout.num_stages):
        r = layout.replicas(s)
        for i, rank in enumerate(layout.stage_ranks[s]):
            p = Program(s)
            locals_ = [[m for m in group if m % r == i] for group in config.groups()]
            for group, local in zip(config.groups(), locals_):
                for m in local:
                    p.forward(m)
                for m in local:
                    p.backward(m)
                p.step(group, replicated=r > 1)
            programs[rank] = p.actions
            inflight[rank] = max(len(local) for local in locals_)
    return build("gpipe", config, programs, dict.fromkeys(programs, 1), inflight)
