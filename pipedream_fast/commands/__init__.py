"""CLI sub-commands; each module exposes `register(subparsers)` (see `pipedream_fast.cli`).

What several commands share lives here, so that their defaults cannot drift apart.
"""

from __future__ import annotations

import argparse
from typing import Any

# Bytes/s assumed between ranks where nothing says otherwise: `train --bandwidth` (its plan
# and prediction) and `simulate --bandwidth` (a plan without a topology). 1 GB/s, as the
# library plans a `Pipeline` without a topology (`rank/cutting.py`, `planner/replan.py`).
DEFAULT_BANDWIDTH = 1e9


def add_straight(parser: Any) -> None:
    """`--straight/--no-straight`, as `plan` and `train` take it (a parser or an argument
    group): `plan` plans a profile as `train` would."""
    parser.add_argument("--straight", action=argparse.BooleanOptionalAction, default=True,
                        help="one rank per stage, a pipeline as deep as the workers "
                             "(default); --no-straight lets the planner replicate stages")
