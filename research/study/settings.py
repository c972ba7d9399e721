"""What a study run is set to (grids, budgets, sizes) and what the paper claims it finds."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PAPER_WINNER = {"quadratic": "pipedream", "logistic": "localsgd", "lm": "pipedream"}
PAPER_CLAIM = {"quadratic": "PD wins", "logistic": "LocalSGD wins as S grows",
               "lm": "PD wins (training loss)"}
GAMMA_GRID = tuple(2.0 ** -k for k in range(-3, 9))  # in units of 1/L: 8 ... 1/256
FIXED_GAMMA = 2.0 ** -4
LM_GAMMAS = (0.1, 0.3, 1.0, 3.0)
LM_FIXED_GAMMA = 0.3
TIE = 0.02  # final losses within 2% are a tie
CORRECTIONS = ("predict", "nesterov", "lr-scale")  # PipeDream's, as `staleness=`

Progress = Callable[[str], None]


@dataclass
class Settings:
    stages: tuple[int, ...] = (2, 4, 8)
    local_steps: tuple[int, ...] = (1, 4, 16)
    # PipeDream's staleness corrections run next to it (labels pd+predict, ...), in the table
    # and in the gamma^2 S^4 check
    corrections: tuple[str, ...] = CORRECTIONS
    budget: float = 4000.0  # simulated time units (PD does ~budget/2 updates)
    gammas: tuple[float, ...] = GAMMA_GRID
    fixed_gamma: float = FIXED_GAMMA
    gap_stages: tuple[int, ...] = (2, 3, 4, 6, 8)
    gap_gammas: tuple[float, ...] = (2.0 ** -6, 2.0 ** -5, 2.0 ** -4, 2.0 ** -2, 1.0)
    gap_updates: int = 2000
    gap_seeds: int = 3
    # lm
    lm_steps: int = 200
    lm_batch: int = 16
    lm_gammas: tuple[float, ...] = LM_GAMMAS
    lm_fixed_gamma: float = LM_FIXED_GAMMA
    lm_stages: tuple[int, ...] = (2, 4)

    @classmethod
    def quick(cls, stages: Iterable[int], local_steps: Iterable[int]) -> Settings:
        return cls(stages=tuple(stages), local_steps=tuple(local_steps), budget=600.0,
                   gammas=(2.0 ** -2, 2.0 ** -4, 2.0 ** -6), gap_stages=(2, 3),
                   gap_gammas=(2.0 ** -5, 2.0 ** -4), gap_updates=300, gap_seeds=1,
                   lm_steps=40, lm_gammas=(0.3,), lm_stages=(2,))


def finite(v: float) -> float | None:
    """inf (diverged) as None, for JSON."""
    return v if math.isfinite(v) else None


def value(v: float | None) -> float:
    return math.inf if v is None else v


def winner(pd: float, local: float) -> str:
    """pipedream, localsgd, tie (within TIE) or neither (both diverged), by final loss."""
    if not (math.isfinite(pd) or math.isfinite(local)):
        return "neither (both diverged)"
    if abs(pd - local) <= TIE * min(pd, local):
        return "tie"
    return "pipedream" if pd < local else "localsgd"
