#!/usr/bin/env bash
# The project's GPU check on a machine with one CUDA GPU (a CUDA torch, nvcc, ninja, pytest; no
# network), 5-8 min on one H200; run from anywhere. Steps, each timed and bounded (a failed one does
# not stop the rest; a failed build skips those needing it): preflight (no CUDA GPU: say why, exit
# 2), facts, build (build_ext --inplace, FORCE_CUDA=1, arch 9.0; asserts _C.cuda_enabled), tests
# (pytest -m cuda, at least one passed), then `bench/gpu.py --set` pipeline, memory, micro, zoo.
# Output in $OUT (default /tmp/gpu_check.*): gpu_check.log, gpu_{pipeline,memory,micro,zoo}.md and
# gpu_check.md (all of it: copy into bench/results/). Exit status: 0 all passed, 1 a step failed or
# timed out, 2 no CUDA GPU. Environment: PYTHON (python3), GPU_CHECK_WHEELS=dir (installed first,
# into /tmp/gpu_check_site), GPU_CHECK_BUDGET_S (540), MAX_JOBS (16).
set -euo pipefail
export PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/gpu_check_work.XXXXXX)"
export PY ROOT OUT WORK
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-16}"
START=$SECONDS
BENCHES=(pipeline memory micro zoo)  # the steps of bench/gpu.py, in order

banner() { printf '\n==== [%s, +%ds] %s\n' "$(date +%H:%M:%S)" "$((SECONDS - START))" "$*"; }

# ---- the steps: each runs as `bash -c` under timeout, with the variables exported above ----

step_facts() {
  # Also into $WORK/facts.txt, for gpu_check.md. Every probe is read-only and may fail alone.
  {
    echo "-- nvidia-smi -L"; nvidia-smi -L || echo "(nvidia-smi failed)"
    echo "-- nvidia-smi (query)"
    local query=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit
    nvidia-smi --format=csv --query-gpu="$query,temperature.gpu,utilization.gpu,compute_mode" \
      || echo "(nvidia-smi query failed)"
    echo "-- nvcc --version"; nvcc --version || echo "(nvcc not on PATH)"
    echo "-- Python and torch"
    "$PY" - <<'PY' || echo "(the Python probe failed)"
import platform, sys
print("python", platform.python_version(), sys.executable)
import torch
for what in ("torch.__version__", "torch.version.cuda", "torch.backends.cudnn.version()",
             "torch.cuda.nccl.version()", "torch.cuda.is_available()",
             "torch.cuda.device_count()", "torch.cuda.get_arch_list()",
             "[torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]",
             "__import__('torch.utils.cpp_extension').utils.cpp_extension.CUDA_HOME"):
    try:  # CUDA_HOME: as the build finds it (needs setuptools)
        print(what, eval(what))
    except Exception as err:  # noqa: BLE001
        print(what, f"({type(err).__name__}: {err})")
PY
    echo "-- packages"
    local names='torch|numpy|pytest|pytest-timeout|hypothesis|rich|scikit-learn|ninja|setuptools'
    names+='|pybind11|matplotlib|transformers|torchvision'
    "$PY" -m pip list 2>/dev/null | grep -iE "^($names) " || echo "(pip list failed)"
    echo "-- machine"; uname -srm; echo "cores: $(nproc)"; free -g | head -2 || true
  } 2>&1 | tee "$WORK/facts.txt"
}

step_build() {
  # The interpreter's folder first on PATH: torch's extension builder runs `ninja` from there.
  # A warm machine keeps build/ and the .so (both git-ignored), so a rerun only relinks.
  PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
  if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
    elif command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    fi
  fi
  export PATH CUDA_HOME="${CUDA_HOME:-}" FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0
  echo "CUDA_HOME=$CUDA_HOME FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$MAX_JOBS"
  echo "ninja $(ninja --version 2>/dev/null || echo 'not found: the build runs one job at a time')"
  "$PY" setup.py build_ext --inplace --build-temp build/gpu-temp
  "$PY" - <<'PY'
import torch  # noqa: F401  (libtorch first, as the package does)
import pipedream_fast._C as C
print("built:", C.__file__)
assert C.cuda_enabled, "the extension was built without CUDA (PIPEDREAM_FAST_WITH_CUDA unset)"
print("pipedream_fast._C.cuda_enabled = True")
PY
}

step_tests() {
  local log="$WORK/pytest.txt"
  "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider --timeout 120 tests/ 2>&1 | tee "$log"
  if ! grep -qE '[0-9]+ passed' "$log"; then
    echo "no CUDA test passed (all skipped or deselected?): the check has not run" >&2
    return 1
  fi
}

step_bench() {  # bench/gpu.py --set NAME on cuda, its report to $OUT/gpu_NAME.md
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$PY" bench/gpu.py --set "$1" --device cuda --out "$OUT/gpu_$1.md"
}

# ---- the runner --------------------------------------------------------------------------------

STEPS=()  # the step table's rows: | name | result | seconds |
record() { STEPS+=("| $1 | $2 | $3 |"); }

# run_step NAME LIMIT_S FUNCTION [ARG]: the function in its own bash under `timeout` (its whole
# process group), within the budget left. Never fails itself: the outcome goes into the table.
run_step() {
  local name=$1 limit=$2 fn=$3 arg=${4:-} rc=0 began=$SECONDS result
  local left=$((BUDGET - (SECONDS - START) - 10))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 20 ]; then
    banner "$name: skipped, the budget of ${BUDGET}s is spent"
    record "$name" "skipped (budget spent)" 0
    return 0
  fi
  banner "$name (limit ${limit}s)"
  timeout --kill-after=15 "$limit" bash -c "set -euo pipefail; $(declare -f "$fn"); $fn $arg" \
    || rc=$?
  case $rc in
    0) result="passed" ;;
    124|137) result="TIMED OUT after ${limit}s" ;;
    *) result="FAILED (exit status $rc)" ;;
  esac
  banner "$name: $result in $((SECONDS - began))s"
  record "$name" "$result" "$((SECONDS - began))"
}

summary() {
  banner "summary"
  local part row written="$OUT/gpu_check.log, $OUT/gpu_check.md"
  {
    echo "# GPU check ($(date -u +%Y-%m-%d), bench/gpu_check.sh)"
    echo
    echo "Made by \`bash bench/gpu_check.sh\` on a machine with one CUDA GPU; the full log is"
    echo "gpu_check.log beside this file. $((SECONDS - START)) s in all."
    echo
    echo "| step | result | seconds |"; echo "| --- | --- | ---: |"
    printf '%s\n' "${STEPS[@]}"
    if [ -s "$WORK/facts.txt" ]; then
      echo; echo "## Machine"; echo; echo '```'; cat "$WORK/facts.txt"; echo '```'
    fi
    for part in "${BENCHES[@]}"; do
      [ -s "$OUT/gpu_$part.md" ] || continue
      echo; sed 's/^#/##/' "$OUT/gpu_$part.md"; written+=", $OUT/gpu_$part.md"
    done
  } > "$OUT/gpu_check.md"
  printf '%s\n' "${STEPS[@]}"
  echo "written: $written"
  for row in "${STEPS[@]}"; do [[ $row == *"| passed |"* ]] || return 1; done
}

preflight() {
  banner "preflight: is there a CUDA GPU?"
  nvidia-smi -L 2>&1 || echo "(nvidia-smi: not found or failed)"
  if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: no CUDA GPU: the interpreter '$PY' is not there (set PYTHON)"
    return 1
  fi
  timeout 120 "$PY" - <<'PY'
import sys
try:
    import torch
except Exception as err:  # noqa: BLE001
    sys.exit(f"gpu_check: no CUDA GPU: {sys.executable} cannot import torch ({err})")
print(f"{sys.executable}: torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.version.cuda is None:
    sys.exit("gpu_check: no CUDA GPU: this torch is a CPU-only build (set PYTHON to a CUDA one)")
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU: torch.cuda.is_available() is False (no device, or no driver)")
print(f"gpu_check: CUDA GPU: {torch.cuda.get_device_name(0)} "
      f"(capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))}), "
      f"{torch.cuda.device_count()} device(s)")
PY
}

install_wheels() {
  local dir=$1
  banner "wheels from $dir"
  if ! ls "$dir"/*.whl >/dev/null 2>&1; then echo "no wheels in $dir"; return 1; fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site "$dir"/*.whl
  export PYTHONPATH="/tmp/gpu_check_site:$PYTHONPATH"
  echo "installed into /tmp/gpu_check_site: $(ls "$dir"/*.whl | xargs -n1 basename | tr '\n' ' ')"
}

main() {
  banner "gpu_check in $ROOT; output in $OUT; budget ${BUDGET}s"
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    install_wheels "$GPU_CHECK_WHEELS" || { echo "gpu_check: installing wheels failed"; return 1; }
  fi
  if ! preflight; then
    echo "gpu_check: nothing here can be checked without a CUDA GPU; stopping (exit status 2)"
    record preflight "no CUDA GPU" "$((SECONDS - START))"
    summary || true
    return 2
  fi
  run_step facts 60 step_facts
  run_step build 300 step_build
  if [[ ${STEPS[-1]} == *"| passed |"* ]]; then
    run_step tests 150 step_tests
    run_step pipeline 200 step_bench pipeline
    run_step memory 90 step_bench memory
    run_step micro 120 step_bench micro
    run_step zoo 200 step_bench zoo
  else
    for name in tests "${BENCHES[@]}"; do
      banner "$name: skipped, there is no CUDA build of the extension"
      record "$name" "skipped (no build)" 0
    done
  fi
  summary
}

set +e
main 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
