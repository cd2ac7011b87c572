#!/usr/bin/env bash
# Runs the suite as several pytest processes, one after another: one per tests/ subdirectory
# (tests/test_*.py together as one more), with tests/integration/test_ptq_methods_pipeline.py
# in a process of its own. Every test runs; only the process a test runs in changes. Used by
# `make test-py312`: a single process running the whole suite segfaulted inside jaxlib after
# ~550-630 tests, when the live executables jax keeps had used up vm.max_map_count (~9 map
# entries each; docs/py312_crash.md). tests/conftest.py now clears jax's caches near that
# limit; the split keeps each process far from it as well. Fails (after running every part) if any part
# failed, and names the parts that did.
# QJAX_PARTS_DEADLINE (seconds since the epoch, optional): a part is not started after it; the
# parts left are listed as not run (CI sets it so the whole CI run stays inside its time limit
# on a slow machine; see .ci/run). Unset, every part runs.
#   usage: tests/run_parts.sh PYTHON [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
py=$1; shift
isolated=tests/integration/test_ptq_methods_pipeline.py
parts=()
for d in tests/*/; do
  d=${d%/}
  compgen -G "$d/test_*.py" >/dev/null || continue
  if [ "$d" = tests/integration ]; then
    parts+=("$d --ignore=$isolated" "$isolated")
  else
    parts+=("$d")
  fi
done
parts+=("$(ls tests/test_*.py | tr '\n' ' ')")
failed=()
skipped=()
start=$SECONDS
for part in "${parts[@]}"; do
  if [ -n "${QJAX_PARTS_DEADLINE:-}" ] && [ "$(date +%s)" -ge "$QJAX_PARTS_DEADLINE" ]; then
    skipped+=("$part")
    continue
  fi
  t0=$SECONDS
  echo "=== part: $part"
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 "$py" -X faulthandler -m pytest $part "$@"
  rc=$?
  echo "=== part: $part: exit $rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$part (exit $rc)")
done
echo "=== all parts: $((SECONDS - start)) s"
if [ ${#skipped[@]} -gt 0 ]; then
  printf '=== not run (QJAX_PARTS_DEADLINE passed): %s\n' "${skipped[@]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf '=== failed part: %s\n' "${failed[@]}"
  exit 1
fi
