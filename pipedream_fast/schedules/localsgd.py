"""LocalSGD, the baseline of the PipeDream theory paper, on the same S-stage pipeline.

R model replicas share the pipeline: microbatch m belongs to replica m mod R, and every rank
keeps one weight copy of its stage per replica (`copy` in the IR). Each replica is plain
sequential SGD: its forward on stage j comes after its previous microbatch's backward there
(1F1B with at most min(S - j, R) microbatches in flight). Every R*H microbatches the pipeline
drains and each stage averages its R copies: the next round's first forward on stage 0
follows the round's last backward on stage 0. A trailing partial round is not averaged.

The runtime trains it (`Pipeline(..., schedule="localsgd", local_steps=H, model_replicas=R)`,
one loader minibatch per microbatch): each stage holds R weight copies on its rank, copy 0
being the module's own parameters, each copy with an optimizer of its own. AVERAGE sets every
copy's weights to their mean; the optimizer states (momentum, Adam moments) stay per copy and
are not averaged, the usual LocalSGD choice (each replica keeps its own optimizer, only the
models are synchronised). Evaluation, `predict`, `state_dict` and export use copy 0, which is
the averaged model after every complete round. Averaging is local to a rank: a stage with
replicas on several ranks would need an all-reduce of the copies across them, which the IR's
AVERAGE (every copy of the stage *on this rank*) cannot name, so `_options` refuses replicated
stages; R model replicas already are localsgd's data parallelism.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b
from pipedream_fast.schedules.layout import Layout
from pipedream_fast.schedules.registry import Options, ScheduleKind, ScheduleOption, register


def generate(config: Config) -> Schedule:
    layout, replicas = config.layout, config.model_replicas
    round_size = replicas * config.local_steps
    n = layout.num_microbatches

    def compute(rank: int) -> Iterator[Action]:
        s, _ = layout.only_stage(rank, "localsgd")
        p = Program(s)
        for start in range(0, n, round_size):
            mbs = range(start, min(n, start + round_size))
            for kind, m in one_f_one_b(mbs, min(layout.num_stages - s, replicas)):
                if kind == "F":
                    yield p.forward(m, copy=m % replicas)
                else:
                    yield p.backward(m)
                    yield from p.step([m], replicated=False, copy=m % replicas)
            if len(mbs) == round_size:
                yield p.average(replicas)

    ranks = range(layout.num_ranks)
    inflight = {rank: min(layout.num_stages - layout.only_stage(rank, "localsgd")[0], replicas)
                for rank in ranks}
    return build("localsgd", config, compute, dict.fromkeys(ranks, replicas), inflight)


def _options(layout: Layout, options: Options) -> tuple[Config, dict[str, Any]]:
    if options.chunks is not None:
        raise ValueError("localsgd takes local_steps and model_replicas, not chunks")
    if {len(r) for r in layout.stage_ranks} != {1}:
        raise ValueError(f"localsgd replicates the whole model (model_replicas), not stages; "
                         f"got stage replicas {[len(r) for r in layout.stage_ranks]}")
    h = options.get("local_steps") or 1
    r = options.get("model_replicas") or layout.num_stages
    if h < 1 or r < 1:
        raise ValueError(f"local_steps and model_replicas must be >= 1, got {h} and {r}")
    return Config(layout, local_steps=h, model_replicas=r), {"local_steps": h,
                                                             "model_replicas": r}


register(ScheduleKind(
    name="localsgd", order=5, generate=generate, options=_options,
    chunked_steps=False, whole_minibatches=True, plans_as="pipedream",
    planning={"straight": True},
    own_options=(ScheduleOption("local_steps", int, "local steps of each model replica "
                                                    "between averages (default 1)", "H"),
                 ScheduleOption("model_replicas", int, "model replicas on the pipeline, "
                                                       "averaged every R*H minibatches "
                                                       "(default: the number of stages)", "R")),
    summary="LocalSGD: R model replicas on one pipeline, averaged every H local steps",
    weight_versions=lambda noam: noam, stashed=lambda noam, microbatches: noam,
    period=lambda c: c.model_replicas * c.local_steps))
