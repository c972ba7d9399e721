"""LocalSGD, the baseline of the PipeDream theory paper, on the same S-stage pipeline.

R model replicas share the pipeline: microbatch m belongs to replica m mod R, and every rank
keeps one weight copy of its stage per replica (`copy` in the IR). Each replica is plain
sequential SGD: its forward on stage j comes after its previous microbatch's backward there
(1F1B with at most min(S - j, R) microbatches in flight). Every R*H microbatches the pipeline
drains and each stage averages its R copies: the next round's first forward on stage 0
follows the round's last backward on stage 0. A trailing partial round is not averaged.
"""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b


def generate(config: Config) -> Schedule:
    layout, replicas = config.layout, config.model_replicas
    round_size = replicas * config.local_steps
    n = layout.num_microbatches
    programs, inflight = {}, {}
    for s in range(layout.num_stages):
        (rank,) = layout.stage_ranks[s]
        limit = min(layout.num_stages - s, replicas)
        p = Program(s)
        for start in range(0, n, round_size):
            mbs = list(range(start, min(n, start + round_size)))
            for kind, m in one_f_one_b(mbs, limit):
                if kind == "F":
                    p.forward(m, copy=m % replicas)
                else:
                    p.backward(m)
                    p.step([m], replicated=False, copy=m % replicas)
            if len(mbs) == round_size:
                p.average()
        programs[rank] = p.actions
        inflight[rank] = limit
    return build("localsgd", config, programs, dict.fromkeys(programs, replicas), inflight)
