#!/usr/bin/env bash
# Run HERE (this machine has PyPI), before the device call: downloads into benchmarks/gpu/wheels/ the wheels
# that the GPU machine's image lacks (it has Python 3.12, torch+CUDA, Triton, CuPy, xxhash, prometheus_client,
# numpy and pytest, and no network). Only what check.sh needs: msgspec for `import kvoffload`; hypothesis
# (+ sortedcontainers) and pytest-timeout for the tests (tests/conftest.py, pyproject's `timeout`);
# setuptools for building kvoffload in place. The folder is git-ignored; the device call carries it.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=benchmarks/gpu/wheels
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi

# Versions: those this project is developed and tested with here.
PACKAGES=(
  "msgspec==0.23.0"
  "hypothesis==6.170.17"
  "sortedcontainers==2.4.0"
  "pytest-timeout==2.4.0"
  "setuptools==78.1.1"
)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any \
  --dest "$WHEELS" "${PACKAGES[@]}"
ls -l "$WHEELS"
du -ch "$WHEELS"/*.whl | tail -1
