"""The PipeDream-vs-LocalSGD study of the PipeDream theory paper, in simulated time.

"Demystifying Pipeline Parallelism: First Theory for PipeDream" analyses Randomized PipeDream
(RPD), a stale block-SGD abstraction, and compares PipeDream (PD) with LocalSGD in simulated
time: PD wins on a quadratic and a small language model, LocalSGD on logistic regression as
the number of stages S grows. This package reruns that comparison on pipedream_fast's
schedules; it is research built on the library, not part of it. Run it from the repository
root with `python -m research.study` (options: `--help`); results and the honest comparison
are in STUDY.md.

Files, one job each:
  objectives.py  the quadratic and the logistic objective (breast_cancer);
  replay.py      the RPD replay: a schedule's unit-cost simulated timeline replayed on block
                 weight versions as the IR names them (split backwards included: the weight
                 gradient lands at BACKWARD_WEIGHT); kinds it does not model are refused;
  settings.py    the grids, budgets and sizes of a run, and the paper's claims;
  rpd.py         the comparison on the replayed objectives and the gamma^2 S^4 check;
  lm.py          the char LM trained through the real runtime (`LocalPipeline`);
  report.py      the Markdown tables and the plots;
  cli.py         the command line (`python -m research.study`).

Time axis. Every method is a schedule of the IR, simulated with `UnitCosts()`: forward 1,
backward 1, transfers, updates and averages 0 (the textbook unit costs under which
`staleness.pipedream_unit_law` gives the max delay S^2 - ceil(S/2)). The clock of a run is
that simulation's: PD's fill, LocalSGD's drain before every averaging and the synchronous
baseline's fill and drain per update cost exactly what the simulator says. A run is cut at
the time budget T, the same for every method of an objective.

Methods (schedules of `pipedream_fast.schedules`):
  pipedream  `make_schedule("pipedream", S, N)`: asynchronous 1F1B, weight stashing, one
             update of every block per microbatch.
  localsgd   `make_schedule("localsgd", S, N, local_steps=H)` with R = S model replicas
             (the schedule's default): replica m mod R trains on microbatch m with plain
             SGD; every R*H microbatches the pipeline drains and each stage averages its R
             copies.
  sync       `make_schedule("gpipe", S, N, chunks=1)`: synchronous SGD, one microbatch per
             update, the pipeline filled and drained for each (2S time units per update).
             The staleness-free baseline of the gamma^2 S^4 check; in time it is the slowest.
  pd+predict, pd+nesterov, pd+lr-scale  `Method("pipedream", staleness=...)`: PipeDream with
             the library's staleness correction (`pipedream_fast.runtime.staleness_correction`
             defines them; the replay applies them on the blocks, the LM through
             `Pipeline(..., staleness=...)`). predict and nesterov shift the version a forward
             reads along the stage's velocity (the bias-corrected moving average, 0.9, of its
             updates) by d resp. 0.9 + ... + 0.9^d velocities, d the forward's delay; lr-scale
             divides the update's step size by 1 + its microbatches' mean delay. Same
             schedule, same clock as PD; `--staleness` picks which run (default all three).
The replay also takes any other schedule (`Method("zb-h1", chunks=4)`), which the tests use.

RPD replay (quadratic and logistic): see `research.study.replay`. Block j's update for m uses
the gradient at the parameters every block had when m read it: RPD's stale-read rule with
exactly the schedule's delays. Microbatch m's sample (noise, or minibatch rows) depends only
on (seed, m), so all methods see the same data.

Objectives: see `research.study.objectives` (quadratic: d = 64, condition number 100, noise
0.3; logistic: L2-regularised on breast_cancer, microbatches of 16 rows, step sizes in units
of 1/L) and `research.study.lm` (the LM through `LocalPipeline`).

Step sizes. "tuned": per objective, method and S, the grid gamma in {2^3, ..., 2^-8} / L
(LM: {0.1, 0.3, 1, 3}); kept is the gamma with the lowest final loss, the mean loss over the
last 10% of the time budget (diverged runs count as infinite). "fixed": one gamma for every
method and S, chosen before running as the middle of the grid, 2^-4 / L (LM: 0.3).

Table. For every objective and S: final loss at the budget (tuned and fixed), the best H of
LocalSGD, time to a threshold loss (1.1 x the larger of PD's and best LocalSGD's tuned final
loss, so that both reach it), the winner (lower final loss at tuned gamma; a tie within 2%)
and whether that agrees with the paper.

gamma^2 S^4 check. The convergence theorem's stale-read term scales as gamma^2 S^4. For the
quadratic and the logistic objective, for S in `gap_stages` and gamma in `gap_gammas`, PD and
sync run K updates on the same microbatches (loss recorded against the number of microbatches
every block has applied: the iterate x_k is version k of every block, so a stage that runs
ahead in time is not credited early) and gap = mean over the last half of the K updates of
(loss_PD - loss_sync), averaged over 3 seeds; printed next to gap / (gamma^2 S^4), which the
theory predicts to be roughly constant (it is an upper bound's scaling, not an equality).
Each corrected PD runs the same K updates on the same microbatches and seeds, and its gap
(loss_corrected - loss_sync) is set against PD's (`rpd.closes`: closes, narrows, no change,
widens by |gap|; diverges). The table's winner is also given with the best corrected PD
(the lowest final loss among the corrections) in PD's place against the best LocalSGD.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from research.study.lm import lm_run, study_lm
from research.study.objectives import OBJECTIVES, Logistic, Objective, Quadratic
from research.study.replay import (EFFECTS, Curve, Method, ReplayError, check_replayable,
                                   replay, run_method, timeline)
from research.study.report import markdown, plot
from research.study.rpd import gamma_s4_check, study_rpd
from research.study.settings import Progress, Settings


def run_study(objectives: Sequence[str], settings: Settings,
              progress: Progress = print) -> dict[str, Any]:
    """Every objective of `objectives` (quadratic, logistic, lm) under `settings`: the
    results the report and `--json` are made from."""
    out: dict[str, Any] = {"settings": {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in vars(settings).items()},
                           "costs": "UnitCosts(): forward 1, backward 1, communication 0",
                           "objectives": {}}
    for name in objectives:
        start = time.perf_counter()
        if name == "lm":
            out["objectives"][name] = study_lm(settings, progress)
        else:
            out["objectives"][name] = study_rpd(name, settings, progress)
        out["objectives"][name]["wall_s"] = time.perf_counter() - start
    return out


__all__ = ["EFFECTS", "OBJECTIVES", "Curve", "Logistic", "Method", "Objective", "Quadratic",
           "ReplayError", "Settings", "check_replayable", "gamma_s4_check", "lm_run",
           "markdown", "plot", "replay", "run_method", "run_study", "study_lm", "study_rpd",
           "timeline"]
