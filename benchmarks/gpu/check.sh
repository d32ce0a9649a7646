#!/usr/bin/env bash
# The GPU check, in ONE device call of at most ~8 minutes (see benchmarks/gpu/README.md):
#   1. env      what the machine is (nvidia-smi, python, torch, triton)
#   2. install  the wheels the image lacks (benchmarks/gpu/wheels, from prepare.sh: no network there), then
#               kvoffload itself, built in place with the machine's compiler (the native CPU kernel)
#   3. cuda     the CUDA tests: pytest -m cuda
#   4. bench    benchmarks/transfer.py --device cuda (tables in bench.log, summary in bench.json)
#   5. cpu      the copy engine's CPU tests on the GPU machine (host pools are registered there)
# Every stage runs under `timeout`, clamped to what is left of the overall budget, and its output is teed
# into $OUT (7 files: summary.txt, env.log, cuda-tests.log, cuda-tests.xml, bench.log, bench.json,
# cpu-tests.log). Exits non-zero when a stage failed; summary.txt says which.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/kvoffload-gpu-check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=benchmarks/gpu/wheels
BUDGET=${CHECK_BUDGET_S:-470}
START=$SECONDS
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# stage NAME LIMIT LOG COMMAND...: COMMAND under timeout (never past the budget), output teed into LOG.
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START)))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    note "$name: SKIPPED (budget spent)"
    FAILED=1
    return 1
  fi
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local how=""
  ((rc == 124 || rc == 137)) && how=" (TIMED OUT)"
  note "$name: rc=$rc in $((SECONDS - t0))s$how"
  ((rc == 0)) || FAILED=1
  return "$rc"
}

pip_install() { # PEP 668 images refuse plain installs: retry with --break-system-packages
  "$PY" -m pip install --no-input --disable-pip-version-check "$@" ||
    "$PY" -m pip install --no-input --disable-pip-version-check --break-system-packages "$@"
}

environment() {
  nvidia-smi || true
  "$PY" -c 'import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  "$PY" -c 'import triton; print("triton", triton.__version__)' || echo "triton: missing"
  echo "cores: $(nproc)"
  free -g
}

install() {
  local missing=() pair module wheel
  # module:distribution of everything check.sh needs beyond the image
  for pair in msgspec:msgspec hypothesis:hypothesis sortedcontainers:sortedcontainers \
    pytest_timeout:pytest-timeout setuptools:setuptools; do
    module=${pair%%:*}
    wheel=${pair#*:}
    if [[ $module == setuptools ]]; then # PEP 660 editable builds without the wheel package: >= 70.1
      "$PY" -c "import setuptools, sys; v = tuple(map(int, setuptools.__version__.split('.')[:2])); sys.exit(v < (70, 1))" \
        2>/dev/null || missing+=("$wheel")
    else
      "$PY" -c "import $module" 2>/dev/null || missing+=("$wheel")
    fi
  done
  echo "missing from the image: ${missing[*]:-nothing}"
  if [[ ${SKIP_INSTALL:-0} == 1 ]]; then # a dry run of the script elsewhere: leave that environment alone
    echo "SKIP_INSTALL=1: not installing"
  else
    if ((${#missing[@]})); then
      pip_install --no-index --find-links "$WHEELS" "${missing[@]}" || return 1
    fi
    if ! pip_install --no-deps --no-build-isolation -e .; then
      echo "editable install failed: building the native kernel in place, kvoffload from src/ on PYTHONPATH"
      "$PY" setup.py build_ext --inplace || true
    fi
  fi
  "$PY" -c 'import kvoffload
from kvoffload.offload.worker.copy import _native
from kvoffload.offload.worker.copy._cuda_kernel import load_kernel
print("kvoffload from", kvoffload.__file__)
print("native kernel:", _native.KERNEL.path.name if _native.KERNEL else "NOT BUILT")
print("zero-copy kernel (Triton):", "loaded" if load_kernel() is not None else "NOT AVAILABLE")'
}

export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} # the fallback path; harmless after the editable install
export PYTHONUNBUFFERED=1 PY WHEELS
export -f pip_install environment install # stages run under `timeout`, in a child bash

note "kvoffload GPU check, budget ${BUDGET}s, results in $OUT"
stage env 30 "$OUT/env.log" bash -c environment
stage install 120 "$OUT/env.log" bash -c install || note "install failed: the stages below will tell what still runs"

mapfile -t CUDA_TESTS < <(grep -rlE "pytest\.mark\.cuda|needs_cuda" tests --include='test_*.py' | sort)
note "cuda test files: ${CUDA_TESTS[*]}"
stage cuda 150 "$OUT/cuda-tests.log" "$PY" -m pytest -m cuda -rs -q -p no:cacheprovider --timeout 120 \
  --junitxml="$OUT/cuda-tests.xml" "${CUDA_TESTS[@]}"
grep -E "^(SKIPPED|FAILED|ERROR)|passed|failed" "$OUT/cuda-tests.log" | tail -20 >>"$SUMMARY"

stage bench 240 "$OUT/bench.log" "$PY" benchmarks/transfer.py --device cuda --json "$OUT/bench.json" \
  --budget-s 150

stage cpu 90 "$OUT/cpu-tests.log" "$PY" -m pytest -q -p no:cacheprovider --timeout 60 -m "not cuda" \
  tests/offload/test_copy_engine.py tests/offload/test_integrity.py tests/offload/test_host_pool.py \
  tests/offload/test_worker.py tests/offload/test_cuda_plan.py tests/offload/test_cuda_backend.py \
  tests/offload/test_pinning.py
tail -3 "$OUT/cpu-tests.log" >>"$SUMMARY"

note "total $((SECONDS - START))s; $([[ $FAILED == 0 ]] && echo 'ALL STAGES PASSED' || echo 'SOME STAGE FAILED')"
exit "$FAILED"
