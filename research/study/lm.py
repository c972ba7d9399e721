"""The language model through the real runtime: `build_charlm(layers=2)` (blocks embed,
block1, block2, head: S = 2 or 4) on the `text` corpus, trained by `Pipeline(ranks="threads")` (threads,
plain SGD, one microbatch of 16 windows per step). Time: the unit-cost simulation of the same
schedule; loss: the training loss of microbatch m (computed by the last stage at the weights
m read), placed at the end of m's last-stage forward, averaged over windows of 16
microbatches. LocalSGD runs through the runtime only when `schedules.kind("localsgd")
.trainable` (never through the RPD replay). PipeDream's staleness corrections run through the
runtime too (`Pipeline(..., staleness=...)`: labels pd+predict, pd+nesterov, pd+lr-scale)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipedream_fast.ir import ActionKind

from research.study.replay import Method, timeline
from research.study.settings import PAPER_CLAIM, Progress, Settings, finite, winner

BLOCKS = 4  # embed, block1, block2, head: S must divide it


def lm_run(schedule: str, stages: int, gamma: float, steps: int, batch: int,
           local_steps: int | None = None, seed: int = 0,
           staleness: str | None = None) -> dict[str, Any]:
    """Train `build_charlm(layers=2)` with Pipeline(ranks="threads") on `stages` stages (blocks of layers)
    for `steps` microbatches; loss of each microbatch against the unit-cost simulated time of
    its last-stage forward (NaN from a NaN loss on, where the runtime stops the run:
    `stopped` says so, and the final loss is None). `staleness`: the runtime's correction for stale weights
    (predict, nesterov, lr-scale; pipedream only here), None for none."""
    import torch

    from pipedream_fast.datasets import char_corpus
    from pipedream_fast.formats import Plan, StagePlan
    from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
    from pipedream_fast.models import build_charlm, loss_fn

    torch.manual_seed(seed)
    model = build_charlm(layers=2, dropout=0.0)
    if BLOCKS % stages:
        raise ValueError(f"the LM has {BLOCKS} blocks: S must divide it, got {stages}")
    per = BLOCKS // stages
    plan = Plan(model="charlm", batch_size=batch, workers=stages, schedule=schedule,
                stages=[StagePlan(i * per, (i + 1) * per, 1, (i,), 1.0) for i in range(stages)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    train, _, _ = char_corpus()
    windows = len(train)  # type: ignore[arg-type]  # a CharWindows, which has a length
    g = torch.Generator().manual_seed(seed)
    order = torch.randint(0, windows, (steps, batch), generator=g)
    data = []
    for rows in order:
        xs, ys = zip(*(train[int(i)] for i in rows))
        data.append((torch.stack(xs), torch.stack(ys)))
    kwargs: dict[str, Any] = {}
    if local_steps is not None:
        kwargs = {"local_steps": local_steps, "model_replicas": stages}
    if staleness is not None:
        kwargs["staleness"] = staleness
    pipe = Pipeline(model, loss_fn, lambda params: torch.optim.SGD(params, lr=gamma),
                    plan=plan, schedule=schedule, timeout=120, ranks="threads", **kwargs)
    start = time.perf_counter()
    losses: list[float] = []
    stopped = None
    try:
        for v in pipe.train(data, steps):
            losses.append(float("nan") if v is None else float(v))
    except NonFiniteLoss as err:  # diverged: the runtime stops at a NaN loss (on_nan="stop")
        stopped = str(err)
        losses += [float("nan")] * (steps - len(losses))
    finally:
        pipe.close()
    wall = time.perf_counter() - start
    method = (Method("localsgd", local_steps) if schedule == "localsgd"
              else Method("sync") if schedule == "gpipe"
              else Method(schedule, staleness=staleness))
    records, _ = timeline(method, stages, steps)
    when = {r.action.microbatch: r.end for r in records
            if r.action.kind is ActionKind.FORWARD and r.action.stage == stages - 1}
    window = 16
    times, smooth = [], []
    for i in range(window - 1, steps, window // 2):
        times.append(float(when[i]))
        smooth.append(float(np.mean(losses[i - window + 1:i + 1])))
    final = float(np.mean(losses[-max(1, steps // 10):])) if all(map(math.isfinite, losses)) \
        else math.inf
    return {"schedule": schedule, "stages": stages, "gamma": gamma, "local_steps": local_steps,
            "staleness": staleness, "stopped": stopped,
            "steps": steps, "wall_s": wall, "final": finite(final),
            "makespan": float(max(r.end for r in records)),
            "curve": {"times": times, "losses": smooth}}


def study_lm(settings: Settings, progress: Progress = print) -> dict[str, Any]:
    """PD, its corrected variants, sync, and LocalSGD when the runtime trains it, on the LM
    at each gamma."""
    from pipedream_fast.schedules import kind

    localsgd_trainable = kind("localsgd").trainable
    out: dict[str, Any] = {"objective": "lm", "steps": settings.lm_steps,
                           "batch": settings.lm_batch,
                           "localsgd_trainable": localsgd_trainable, "runs": {}, "table": []}
    grid = sorted(set(settings.lm_gammas) | {settings.lm_fixed_gamma})
    for s in settings.lm_stages:
        runs: dict[str, Any] = {}
        configs: list[tuple[str, str, int | None, str | None]] = [
            ("pipedream", "pipedream", None, None)]
        configs += [(Method("pipedream", staleness=c).label, "pipedream", None, c)
                    for c in settings.corrections]
        configs.append(("sync", "gpipe", None, None))
        if localsgd_trainable:
            configs += [(f"localsgd-H{h}", "localsgd", h, None) for h in settings.local_steps]
        for label, schedule, h, c in configs:
            by_gamma = {}
            for g in grid:
                # Every method trains the same number of microbatches; the time axis is cut
                # at PD's makespan (the budget) when the table is made.
                try:
                    r = lm_run(schedule, s, g, settings.lm_steps, settings.lm_batch, h,
                               staleness=c)
                except Exception as err:  # a runtime failure is a result to report, not hide
                    if schedule != "localsgd":
                        raise
                    out.setdefault("errors", []).append(f"S={s} {label} gamma={g}: {err}")
                    progress(f"lm S={s} {label} gamma={g:g}: FAILED: {err}")
                    continue
                by_gamma[g] = r
                progress(f"lm S={s} {label} gamma={g:g}: final {r['final']} "
                         f"(simulated makespan {r['makespan']:g}, {r['wall_s']:.1f} s wall)")
            if len(by_gamma) == len(grid):
                runs[label] = {str(g): r for g, r in by_gamma.items()}
        out["runs"][str(s)] = runs
        out["table"].append(lm_row(s, runs, grid, settings))
    return out


def lm_final_at(run: dict[str, Any], budget: float) -> float:
    """Mean smoothed training loss over the last 10% of the time budget."""
    c = run["curve"]
    pts = [v for t, v in zip(c["times"], c["losses"]) if 0.9 * budget <= t <= budget]
    if not pts:
        inside = [v for t, v in zip(c["times"], c["losses"]) if t <= budget]
        pts = inside[-1:]
    return float(np.mean(pts)) if pts and all(map(math.isfinite, pts)) else math.inf


def lm_row(s: int, runs: dict[str, Any], grid: Sequence[float],
           settings: Settings) -> dict[str, Any]:
    """One row of the LM table, at PD's makespan."""
    budget = runs["pipedream"][str(grid[0])]["makespan"]
    finals = {label: {g: lm_final_at(runs[label][str(g)], budget) for g in grid}
              for label in runs}
    tuned = {label: min(grid, key=lambda g: f[g]) for label, f in finals.items()}
    edge = [label for label, g in tuned.items()
            if len(grid) > 1 and g in (min(grid), max(grid))]
    locals_ = [label for label in runs if label.startswith("localsgd")]
    corrected = [label for label in runs if runs[label][str(grid[0])].get("staleness")]
    pd_t = finals["pipedream"][tuned["pipedream"]]
    row: dict[str, Any] = {"objective": "lm", "stages": s, "budget": budget,
                           "pipedream_tuned": finite(pd_t),
                           "pipedream_gamma": tuned["pipedream"],
                           "sync_tuned": finite(finals["sync"][tuned["sync"]]),
                           "pipedream_fixed": finite(finals["pipedream"][settings.lm_fixed_gamma]),
                           "sync_fixed": finite(finals["sync"][settings.lm_fixed_gamma]),
                           "paper": PAPER_CLAIM["lm"], "tuned_at_grid_edge": edge}
    if corrected:
        best_c = min(corrected, key=lambda k: finals[k][tuned[k]])
        best_cf = min(corrected, key=lambda k: finals[k][settings.lm_fixed_gamma])
        row.update({
            "corrected": {k: {"tuned": finite(finals[k][tuned[k]]), "gamma": tuned[k],
                              "fixed": finite(finals[k][settings.lm_fixed_gamma])}
                          for k in corrected},
            "corrected_best": best_c, "corrected_tuned": finite(finals[best_c][tuned[best_c]]),
            "corrected_best_fixed": best_cf,
            "corrected_fixed": finite(finals[best_cf][settings.lm_fixed_gamma])})
    if locals_:
        best = min(locals_, key=lambda k: finals[k][tuned[k]])
        lo_t = finals[best][tuned[best]]
        best_f = min(locals_, key=lambda k: finals[k][settings.lm_fixed_gamma])
        lo_f = finals[best_f][settings.lm_fixed_gamma]
        w, wf = winner(pd_t, lo_t), winner(finals["pipedream"][settings.lm_fixed_gamma], lo_f)
        row.update({"localsgd_tuned": finite(lo_t), "localsgd_best": best,
                    "localsgd_gamma": tuned[best], "localsgd_fixed": finite(lo_f),
                    "winner_tuned": w, "winner_fixed": wf,
                    "agrees_tuned": "yes" if w == "pipedream" else "no",
                    "agrees_fixed": "yes" if wf == "pipedream" else "no"})
        if corrected:
            wc = winner(finals[best_c][tuned[best_c]], lo_t)
            wcf = winner(finals[best_cf][settings.lm_fixed_gamma], lo_f)
            row.update({"winner_corrected_tuned": wc, "winner_corrected_fixed": wcf,
                        "verdict_changed_tuned": wc != w, "verdict_changed_fixed": wcf != wf})
    else:
        row.update({"localsgd_tuned": None, "winner_tuned": "n/a (LocalSGD not trainable by "
                    "the runtime yet)", "agrees_tuned": "n/a", "agrees_fixed": "n/a"})
    return row
