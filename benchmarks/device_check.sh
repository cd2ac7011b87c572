#!/usr/bin/env bash
# The device check from a shell: `python -m benchmarks.device_check` (its docstring says what
# it measures) with its results under $OUT (default results/device_check): device_check.json,
# device_check.md, device_check.png. --budget_s (340 s) bounds the whole check: rows, the
# serving engine's rows and the attention section together (a row starts only if one as long
# as the longest so far still fits). jax's persistent compilation cache lives in $CACHE_DIR
# (default results/compile_cache), outside $OUT, so $OUT holds only results and a second run
# on the same machine loads every executable the first one compiled. Extra arguments go to
# the Python entry point.
#
# A machine without a package index may lack ml-collections (qjax's configs import it); bring
# it as a wheel in .whl/, made once on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl ml-collections==1.1.0
set -uo pipefail
OUT=${OUT:-results/device_check}
CACHE_DIR=${CACHE_DIR-results/compile_cache}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/qjax-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/qjax-site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi 2>/dev/null | head -15
$PY -m benchmarks.device_check --out="$OUT" --cache_dir="$CACHE_DIR" "$@"
