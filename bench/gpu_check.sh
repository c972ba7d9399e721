#!/usr/bin/env bash
# bench/gpu_check.sh: the GPU check of the project, one script for a machine with one CUDA GPU
# (a bare image whose `python3` holds a CUDA build of torch, plus nvcc, ninja and pytest; no
# network needed). It needs 5-8 minutes on one H200 and stops itself within
# GPU_CHECK_BUDGET_S (default 540 s).
#
#   bash bench/gpu_check.sh          # from anywhere; it works in the repository root
#
# Steps, each with a banner, a clock and a time limit of its own (a hung step is killed and
# the next one runs; a failed step does not stop the rest, except that a failed build skips
# the steps that need the extension):
#   preflight  nvidia-smi -L and torch.cuda.is_available(): without a CUDA GPU (no torch, a
#              CPU-only torch, no device or driver) it prints "no CUDA GPU: <why>" and exits 2
#              at once; no other step runs.
#   facts      nvidia-smi (read-only queries), nvcc --version, Python, torch, CUDA, cuDNN,
#              NCCL, the packages the tests need, CPU and memory.
#   build      the CUDA extension, built there (a build made here cannot travel: it is CPU-only
#              or for another Python): FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
#              python3 setup.py build_ext --inplace --build-temp build/gpu-temp, which puts
#              pipedream_fast/_C.cpython-<ver>-x86_64-linux-gnu.so next to the package (both
#              are git-ignored: nothing comes back into the tree); then it asserts
#              pipedream_fast._C.cuda_enabled. A warm machine keeps build/ and the .so, so a
#              rerun only relinks what changed.
#   tests      python3 -m pytest -q -m cuda tests/ (the CUDA-marked tests; the 2-GPU NCCL
#              test skips on one GPU); fails when no test passed.
#   pipeline   bench/gpu_pipeline.py: model A, 2-stage 1f1b on cuda:0 against a single-process
#              reference (weights within the test tolerance) and samples/s. Two ranks as
#              processes need NCCL, which refuses two ranks on one GPU (reported, expected);
#              the two ranks as threads (LocalPipeline) carry the check.
#   memory     bench/gpu_memory.py: every rank's peak memory counted at its tensors
#              (measure_memory) against the simulator's prediction (within 10%) and the CUDA
#              allocator's peak for the device (max_memory_allocated; at least the tensors),
#              model A and the char LM, 2 rank threads on cuda:0.
#   micro      bench/gpu_micro.py: WeightRing offload vs plain copies into pageable and pinned
#              host memory (256 MB stage, GB/s); ActivationQueue hand-off between CUDA streams
#              vs wait_stream + copy_.
#   zoo        bench/gpu_zoo.py: the zoo's transformers (nanoGPT, Llama, GPT-2, BERT, unedited,
#              loss_fn=None) through Pipeline with NCCL, 1f1b, split before the second layer,
#              chunks=2, 3 steps each; every step's loss against a one-process CUDA loop with
#              the same gradient accumulation (rtol 1e-4, no TF32), tied embedding and head
#              identical on both ranks. With 2+ GPUs: one rank per GPU. With one GPU NCCL
#              refuses two ranks ("Duplicate GPU detected"): the check then runs on 1 rank,
#              stages=1, cuda:0, and what Pipeline does with two ranks there is recorded
#              (device="cuda:0" on both: refused, reported, not failed; the default device,
#              cuda:LOCAL_RANK: rank 1 has no cuda:1). Models whose packages are missing
#              (transformers, torchvision) are skipped; nanoGPT runs from tests/zoo/gpt.py.
#
# Output: everything printed goes to $OUT/gpu_check.log too; $OUT/gpu_pipeline.md,
# $OUT/gpu_memory.md, $OUT/gpu_micro.md and $OUT/gpu_zoo.md are the benchmarks' reports; $OUT/gpu_check.md puts the
# facts, the step table and the reports together, ready to copy into
# bench/results/gpu_check.md. Without
# OUT (run by hand), a fresh /tmp/gpu_check.* folder is used and named.
# Exit status: 0 when every step passed, 1 when one failed or timed out, 2 without a CUDA GPU.
#
# Knobs (environment):
#   PYTHON=path              the interpreter (default python3), e.g. a venv's python
#   GPU_CHECK_WHEELS=dir     wheels to install first (pip --no-index --no-deps --target into
#                            /tmp/gpu_check_site, put on PYTHONPATH): for a package missing on
#                            the machine
#   GPU_CHECK_BUDGET_S=540   the whole script's time; each step gets at most what is left
#   MAX_JOBS=16              parallel compile jobs of the build
#   GPU_CHECK_ALLOW_NO_GPU=1 run every step even without a GPU (to try this script itself)
#
# Record what it printed: copy $OUT/gpu_check.md into bench/results/gpu_check.md.
set -euo pipefail
export PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
if [ -z "${OUT:-}" ]; then
  OUT="$(mktemp -d /tmp/gpu_check.XXXXXX)"
fi
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/gpu_check_work.XXXXXX)"
export PY ROOT OUT WORK
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-16}"
START=$SECONDS
STEP_NAMES=()
STEP_RESULTS=()
STEP_SECONDS=()

banner() { printf '\n==== [%s, +%ds] %s\n' "$(date +%H:%M:%S)" "$((SECONDS - START))" "$*"; }

# ---- the steps: each runs as `bash -c` under timeout, with the variables exported above ----

step_facts() {
  # Also into $WORK/facts.txt, for gpu_check.md. Every probe is read-only and may fail alone.
  {
    echo "-- nvidia-smi -L"; nvidia-smi -L || echo "(nvidia-smi failed)"
    echo "-- nvidia-smi (query)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,temperature.gpu,utilization.gpu,compute_mode --format=csv \
      || echo "(nvidia-smi query failed)"
    echo "-- nvcc --version"; nvcc --version || echo "(nvcc not on PATH)"
    echo "-- Python and torch"
    "$PY" - <<'PY' || echo "(the Python probe failed)"
import platform, sys
print("python", platform.python_version(), sys.executable)
import torch
def probe(what, get):
    try:
        print(what, get())
    except Exception as err:  # noqa: BLE001
        print(what, f"({type(err).__name__}: {err})")
probe("torch", lambda: torch.__version__)
probe("torch.version.cuda", lambda: torch.version.cuda)
probe("cuDNN", lambda: torch.backends.cudnn.version())
probe("NCCL", lambda: ".".join(map(str, torch.cuda.nccl.version())))
probe("cuda available", lambda: torch.cuda.is_available())
probe("devices", lambda: torch.cuda.device_count())
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, capability {p.major}.{p.minor}, "
          f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
probe("arch list", lambda: torch.cuda.get_arch_list())
def cuda_home():
    from torch.utils import cpp_extension
    return cpp_extension.CUDA_HOME
probe("CUDA_HOME (torch.utils.cpp_extension)", cuda_home)
PY
    echo "-- packages"
    "$PY" -m pip list 2>/dev/null \
      | grep -iE '^(torch|numpy|pytest|pytest-timeout|hypothesis|rich|scikit-learn|ninja|setuptools|pybind11|matplotlib|transformers|torchvision) ' \
      || echo "(pip list failed)"
    echo "-- machine"; uname -srm; echo "cores: $(nproc)"; free -g | head -2 || true
  } 2>&1 | tee "$WORK/facts.txt"
}

step_build() {
  # The interpreter's folder first on PATH: torch's extension builder runs `ninja` from there.
  PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
  if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
    elif command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
    fi
  fi
  export PATH CUDA_HOME="${CUDA_HOME:-}" FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0
  echo "CUDA_HOME=$CUDA_HOME FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$MAX_JOBS"
  echo "ninja $(ninja --version 2>/dev/null || echo 'not found: the build falls back to one job at a time')"
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

step_pipeline() {
  "$PY" bench/gpu_pipeline.py --device cuda --out "$OUT/gpu_pipeline.md"
}

step_micro() {
  "$PY" bench/gpu_micro.py --out "$OUT/gpu_micro.md"
}

step_memory() {
  "$PY" bench/gpu_memory.py --device cuda --out "$OUT/gpu_memory.md"
}

step_zoo() {
  NCCL_DEBUG="${NCCL_DEBUG:-WARN}" "$PY" bench/gpu_zoo.py --device cuda --out "$OUT/gpu_zoo.md"
}

# ---- the runner --------------------------------------------------------------------------------

record() { STEP_NAMES+=("$1"); STEP_RESULTS+=("$2"); STEP_SECONDS+=("$3"); }

# run_step NAME LIMIT_S FUNCTION: the function in its own bash under `timeout` (which signals
# the whole process group it starts: python, the ranks, the compiler), at most what the budget
# has left. Never fails itself: the outcome goes into the step table.
run_step() {
  local name=$1 limit=$2 fn=$3 left rc=0 began
  left=$((BUDGET - (SECONDS - START) - 10))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 20 ]; then
    banner "$name: skipped, the budget of ${BUDGET}s is spent"
    record "$name" "skipped (budget spent)" 0
    return 0
  fi
  banner "$name (limit ${limit}s)"
  began=$SECONDS
  timeout --kill-after=15 "$limit" bash -c "set -euo pipefail; $(declare -f "$fn"); $fn" || rc=$?
  local took=$((SECONDS - began)) result
  case $rc in
    0) result="passed" ;;
    124|137) result="TIMED OUT after ${limit}s" ;;
    *) result="FAILED (exit status $rc)" ;;
  esac
  banner "$name: $result in ${took}s"
  record "$name" "$result" "$took"
}

summary() {
  banner "summary"
  local i md="$OUT/gpu_check.md" failed=0
  printf '%-10s %-32s %s\n' step result seconds
  for i in "${!STEP_NAMES[@]}"; do
    printf '%-10s %-32s %s\n' "${STEP_NAMES[$i]}" "${STEP_RESULTS[$i]}" "${STEP_SECONDS[$i]}"
    [ "${STEP_RESULTS[$i]}" = passed ] || failed=1
  done
  {
    echo "# GPU check ($(date -u +%Y-%m-%d), bench/gpu_check.sh)"
    echo
    echo "Made by \`bash bench/gpu_check.sh\` on a machine with one CUDA GPU; the full log is"
    echo "gpu_check.log beside this file. $((SECONDS - START)) s in all."
    echo
    echo "| step | result | seconds |"
    echo "| --- | --- | ---: |"
    for i in "${!STEP_NAMES[@]}"; do
      echo "| ${STEP_NAMES[$i]} | ${STEP_RESULTS[$i]} | ${STEP_SECONDS[$i]} |"
    done
    if [ -s "$WORK/facts.txt" ]; then
      echo; echo "## Machine"; echo; echo '```'; cat "$WORK/facts.txt"; echo '```'
    fi
    for part in gpu_pipeline gpu_memory gpu_micro gpu_zoo; do
      if [ -s "$OUT/$part.md" ]; then echo; sed 's/^#/##/' "$OUT/$part.md"; fi
    done
  } > "$md"
  echo "written: $OUT/gpu_check.log, $md$( [ -s "$OUT/gpu_pipeline.md" ] && echo ", $OUT/gpu_pipeline.md")$( [ -s "$OUT/gpu_micro.md" ] && echo ", $OUT/gpu_micro.md")$( [ -s "$OUT/gpu_zoo.md" ] && echo ", $OUT/gpu_zoo.md")"
  return "$failed"
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
    install_wheels "$GPU_CHECK_WHEELS" || { echo "gpu_check: installing the wheels failed"; return 1; }
  fi
  if ! preflight; then
    if [ "${GPU_CHECK_ALLOW_NO_GPU:-0}" != 1 ]; then
      echo "gpu_check: nothing here can be checked without a CUDA GPU; stopping (exit status 2)"
      record preflight "no CUDA GPU" "$((SECONDS - START))"
      summary || true
      return 2
    fi
    echo "gpu_check: GPU_CHECK_ALLOW_NO_GPU=1: running the steps anyway"
  fi
  run_step facts 60 step_facts
  run_step build 300 step_build
  if [ "${STEP_RESULTS[-1]}" = passed ]; then
    run_step tests 150 step_tests
    run_step pipeline 200 step_pipeline
    run_step memory 90 step_memory
    run_step micro 120 step_micro
    run_step zoo 200 step_zoo
  else
    for name in tests pipeline memory micro zoo; do
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
