"""CLI sub-commands; each module exposes `register(subparsers)` (see `pipedream_fast.cli`).

What several commands share lives here, so that their defaults cannot drift apart.
"""

# Bytes/s assumed between ranks where nothing says otherwise: `train --bandwidth` (its plan
# and prediction) and `simulate --bandwidth` (a plan without a topology). 1 GB/s, as the
# library plans a `Pipeline` without a topology (`rank/cutting.py`, `planner/replan.py`).
DEFAULT_BANDWIDTH = 1e9
