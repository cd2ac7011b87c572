#!/usr/bin/env bash
# Everything qjax checks on a lent accelerator, in one command whose results land under $OUT:
#   1. the test suite on the accelerator (`JAX_PLATFORMS=cuda` by default; tpu on a TPU VM),
#      bounded by $SUITE_S seconds and interrupted with SIGINT so pytest still writes its
#      junit XML and summary: suite.log, suite.xml;
#   2. the device check (benchmarks/device_check.sh), rows and attention section together
#      bounded by its --budget_s ($CHECK_S; with SUITE_S, under a 600 s call):
#      device_check/device_check.{json,md,png}.
# A time-limited machine should run it once, with a timeout that leaves room for a second try.
#
#   bash benchmarks/accelerator_run.sh [all|suite|check] [--dry-run]
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
SUITE_S=${SUITE_S:-300}
CHECK_S=${CHECK_S:-240}
WORKERS=${WORKERS:-14}
PY=${PYTHON:-python3}
TESTS=${TESTS:-"tests/checkpoints tests/train tests/algorithms tests/integration \
tests/reliability tests/kernels tests/pipeline tests/benchmarks tests/core tests/nn tests/infer tests/eval \
tests/sharding tests/costmodel tests/data tests/test_backends.py"}

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
  [ "$DRY" = 1 ] || status=${PIPESTATUS[0]}
fi
if [ "$WHAT" != suite ]; then
  OUT="$OUT/device_check" run bash benchmarks/device_check.sh --budget_s="$CHECK_S"
  [ "$DRY" = 1 ] || status=$(( status | $? ))
fi
exit "$status"
