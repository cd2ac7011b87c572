#!/usr/bin/env bash
# Runs the suite as several pytest processes, one after another: one per tests/ subdirectory
# (tests/test_*.py together as one more), with tests/integration/test_ptq_methods_pipeline.py
# in a process of its own. Every test runs; only the process a test runs in changes. Used by
# `make test-py312`: under jaxlib 0.12.0.1 a single process running the whole suite segfaults
# inside jaxlib after ~550-630 tests (a native crash that depends on the process's history,
# not on one test); see docs/py312_crash.md. Fails (after running every part) if any part
# failed, and names the parts that did.
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
start=$SECONDS
for part in "${parts[@]}"; do
  t0=$SECONDS
  echo "=== part: $part"
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 "$py" -X faulthandler -m pytest $part "$@"
  rc=$?
  echo "=== part: $part: exit $rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$part (exit $rc)")
done
echo "=== all parts: $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  printf '=== failed part: %s\n' "${failed[@]}"
  exit 1
fi
