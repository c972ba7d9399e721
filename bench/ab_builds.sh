#!/usr/bin/env bash
# A/B of two builds of the package on one benchmark, side by side in one run: the builds'
# package folders (each a copy of pipedream_fast/ with its own _C extension) take turns,
# A B A B ..., each run printing its own line(s) matching PATTERN. Used to show that a change
# to the C++ core leaves a path as fast as it was (e.g. the frames of issue 29).
#
#   bash bench/ab_builds.sh OLD_DIR NEW_DIR ROUNDS PATTERN bench/overhead.py --steps 200
#
# OLD_DIR/NEW_DIR hold a folder pipedream_fast/ (e.g. `git archive REV pipedream_fast | tar -x
# -C OLD_DIR`, then copy that revision's built _C*.so into OLD_DIR/pipedream_fast/).
set -euo pipefail
old=$1 new=$2 rounds=$3 pattern=$4
shift 4
python=${PYTHON:-.venv/bin/python}
for ((i = 1; i <= rounds; i++)); do
  for side in old new; do
    dir=$old; [ "$side" = new ] && dir=$new
    PYTHONPATH=$dir "$python" "$@" 2>&1 | grep -E "$pattern" | sed "s/^/$side round $i: /"
  done
done
