#!/usr/bin/env bash
# A/B of two builds of the package on one benchmark, taking turns (A B A B ...), each run
# printing its line(s) matching PATTERN:
#   bash bench/ab_builds.sh OLD_DIR NEW_DIR ROUNDS PATTERN bench/overhead.py --steps 200
# OLD_DIR/NEW_DIR hold a pipedream_fast/ each (`git archive REV pipedream_fast | tar -x -C
# OLD_DIR`, then that revision's built _C*.so copied into OLD_DIR/pipedream_fast/).
set -euo pipefail
old=$1 new=$2 rounds=$3 pattern=$4 python=${PYTHON:-.venv/bin/python}
shift 4
for ((i = 1; i <= rounds; i++)); do
  for side in old new; do
    PYTHONPATH=${!side} "$python" "$@" 2>&1 | grep -E "$pattern" | sed "s/^/$side round $i: /"
  done
done
