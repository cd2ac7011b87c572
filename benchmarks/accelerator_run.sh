#!/usr/bin/env bash
# Everything qjax checks on a GPU or TPU, in one command whose results land under $OUT:
#   1. the test suite on the accelerator (`JAX_PLATFORMS=cuda` by default; tpu on a TPU VM),
#      the test directories that have not run on a GPU first, bounded by $SUITE_S seconds and
#      interrupted with SIGINT so pytest still writes its junit XML and summary: suite.log,
#      suite.xml;
#   2. the device check (benchmarks/device_check.sh) with the serving engine's rows and the
#      compiler's prediction beside every timed program, bounded by its --budget_s ($CHECK_S):
#      device_check/device_check.{json,md,png}. $CHECK_ARGS go to the check.
# The whole run takes $SUITE_S + $CHECK_S seconds and the start-up of both (240 + 300 s and
# about 30 s with the defaults). jax's persistent compilation cache sits in $CACHE_DIR
# (results/compile_cache, outside $OUT), so a second run on the same machine compiles nothing
# the first one compiled.
#
#   bash benchmarks/accelerator_run.sh [all|suite|check] [--dry-run]
#
# The exit status is 0 when both parts passed: else the suite's (pytest's; 124 where $SUITE_S
# cut it short) or'd with the check's.
#
# TESTS (default: the directories that have not run on a GPU yet, then the rest) picks what the
# suite runs; WORKERS its pytest-xdist workers (default 14). --dry-run prints the commands and
# runs nothing (tests/benchmarks/test_accelerator_run.py checks that every path it names
# exists). Wheels in .whl/ (ml-collections, gguf, ...) are installed as device_check.sh does.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=all
DRY=0
for arg in "$@"; do
  case "$arg" in
    all|suite|check) WHAT=$arg ;;
    --dry-run) DRY=1 ;;
    *) echo "accelerator_run.sh: unknown argument '$arg' (use all, suite, check, --dry-run)" >&2
       exit 2 ;;
  esac
done
OUT=${OUT:-results/accelerator_run}
SUITE_S=${SUITE_S:-240}
CHECK_S=${CHECK_S:-300}
CHECK_ARGS=${CHECK_ARGS:-}
CACHE_DIR=${CACHE_DIR-results/compile_cache}
WORKERS=${WORKERS:-14}
PY=${PYTHON:-python3}
# Not yet run on a GPU: every directory before tests/core; run on an H200 (about half of
# them): tests/core and after.
TESTS=${TESTS:-"tests/aot tests/checkpoints tests/train tests/algorithms tests/integration \
tests/reliability tests/kernels tests/pipeline tests/benchmarks tests/costmodel tests/data \
tests/core tests/nn tests/infer tests/eval tests/sharding tests/test_backends.py"}

run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
if ls .whl/*.whl >/dev/null 2>&1; then
  run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/qjax-site .whl/*.whl
  export PYTHONPATH=/tmp/qjax-site:$PWD
else
  export PYTHONPATH=$PWD
fi

status=0
if [ "$WHAT" != check ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths
  run timeout -s INT "$SUITE_S" "$PY" -m pytest $TESTS -q -n "$WORKERS" --dist loadscope \
    --max-worker-restart=0 -p no:cacheprovider --junitxml="$OUT/suite.xml" --durations=20 \
    -o console_output_style=classic 2>&1 | tee "$OUT/suite.log" | tail -40
  rc=${PIPESTATUS[0]}  # pytest's (timeout's: 124 when $SUITE_S cut it), read before any test
  [ "$DRY" = 1 ] || status=$rc
fi
if [ "$WHAT" != suite ]; then
  # shellcheck disable=SC2086  # CHECK_ARGS is a list of arguments
  OUT="$OUT/device_check" CACHE_DIR="$CACHE_DIR" run bash benchmarks/device_check.sh \
    --budget_s="$CHECK_S" $CHECK_ARGS
  rc=$?
  [ "$DRY" = 1 ] || status=$(( status | rc ))
fi
exit "$status"
