"""A resumable sweep runner: one JSON line per finished point, appended atomically.

Rerunning a sweep skips every point whose latest line has status 'ok' (a killed sweep loses
nothing already finished), retries points that failed, and a point that raises is recorded
with its error while the sweep goes on to the next one.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Callable, Iterable


def read_results(path: str) -> list[dict]:
  """Result lines of `path` (a trailing partial line from a kill is ignored)."""
  if not os.path.isfile(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # the torn last line of a killed writer
  return rows


def append_result(path: str, row: dict) -> None:
  """Append one line with a single write + fsync (a reader never sees half of it)."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  data = (json.dumps(row, default=str, sort_keys=True) + '\n').encode()
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, data)
    os.fsync(fd)
  finally:
    os.close(fd)


def latest_by_name(rows: Iterable[dict]) -> dict[str, dict]:
  out = {}
  for r in rows:
    out[r['name']] = r
  return out


def run_sweep(points: list[tuple[str, dict]], run_point: Callable[[str, dict], dict],
              results_path: str, log: Callable[[str], None] = print) -> list[dict]:
  """Run the sweep's points that are not finished yet.

  Args:
    points: (name, overrides) per point; names must be unique.
    run_point: computes one point's result row (a dict) from (name, overrides).
    results_path: the JSONL results file (appended to).
    log: progress printer.

  Returns:
    The latest row of every point, in sweep order (finished earlier or now).
  """
  names = [n for n, _ in points]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f'sweep: point names {dup} are repeated; every point needs a unique name '
                     '(it is the key that lets a rerun skip finished points).')
  done = latest_by_name(read_results(results_path))
  for i, (name, overrides) in enumerate(points):
    prev = done.get(name)
    if prev is not None and prev.get('status') == 'ok':
      log(f'[{i + 1}/{len(points)}] {name}: finished earlier, skipped')
      continue
    t0 = time.perf_counter()
    try:
      row = dict(run_point(name, overrides))
      row.update(name=name, status='ok', overrides=overrides)
      log(f'[{i + 1}/{len(points)}] {name}: ok ({time.perf_counter() - t0:.1f}s)')
    except Exception as e:  # pylint: disable=broad-except
      row = {'name': name, 'status': 'error', 'overrides': overrides,
             'error': f'{type(e).__name__}: {e}', 'traceback': traceback.format_exc(limit=5)}
      log(f'[{i + 1}/{len(points)}] {name}: FAILED: {row["error"]}')
    append_result(results_path, row)
    done[name] = row
  return [done[n] for n in names]
