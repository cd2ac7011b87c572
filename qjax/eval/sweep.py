"""A resumable sweep runner: one JSON line per finished point, appended atomically.

Rerunning a sweep skips every point whose latest line has status 'ok' and the same key (a
killed sweep loses nothing already finished), retries points that failed, and a point that
raises is recorded with its error while the sweep goes on to the next one. A key (point
name, base model content hash, point config hash) ties a row to what produced it: a rerun
with another config recomputes the point, and a directory holding another base model's rows
is refused. A torn last line (a killed writer) is cut off before the next append.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Callable, Iterable

from qjax.eval import process


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


def repair_tail(path: str) -> bool:
  """Cut a torn last line (no trailing newline) off `path`; True when one was cut.

  Without this the next appended row would continue the torn line and be lost with it.
  """
  if not os.path.isfile(path) or os.path.getsize(path) == 0:
    return False
  with open(path, 'rb+') as f:
    f.seek(-1, os.SEEK_END)
    if f.read(1) == b'\n':
      return False
    f.seek(0)
    data = f.read()
    f.truncate(data.rfind(b'\n') + 1)
    f.flush()
    os.fsync(f.fileno())
  return True


def append_result(path: str, row: dict) -> None:
  """Append one line with a single write + fsync (a reader never sees half of it); a torn
  tail left by a killed writer is cut off first."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  repair_tail(path)
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


def check_base(rows: Iterable[dict], base: str, results_path: str) -> None:
  """Refuse results of another base model (rows whose key names another base hash)."""
  for r in rows:
    other = (r.get('key') or {}).get('base')
    if other is None:
      raise ValueError(f'{results_path} holds row {r.get("name")!r} without a key (written by '
                       'an older qjax), so which base model it measured is unknown. Use a new '
                       'out_dir, or move the old results away.')
    if other != base:
      raise ValueError(f'{results_path} holds results of another base model (row {r.get("name")!r}'
                       f' has base {other!r}, this sweep\'s base is {base!r}); mixing them '
                       'would put one model\'s float perplexity beside another\'s quantized '
                       'ones. Use a new out_dir, or move the old results away.')


def run_sweep(points: list[tuple[str, dict]], run_point: Callable[[str, dict], dict],
              results_path: str, log: Callable[[str], None] = print,
              keys: dict[str, dict] | None = None) -> list[dict]:
  """Run the sweep's points that are not finished yet.

  Args:
    points: (name, overrides) per point; names must be unique.
    run_point: computes one point's result row (a dict) from (name, overrides).
    results_path: the JSONL results file (appended to).
    log: progress printer.
    keys: {name: key} with key = {'base': the base model's content hash, 'config': the
      point's config hash}; a finished row counts only with an equal key, and rows of
      another base are refused. None: rows are matched by name alone.

  Returns:
    The latest row of every point, in sweep order (finished earlier or now).

  Raises:
    ValueError: repeated names, or (with keys) results of another base model.
  """
  names = [n for n, _ in points]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f'sweep: point names {dup} are repeated; every point needs a unique name '
                     '(it is the key that lets a rerun skip finished points).')
  if repair_tail(results_path):
    log(f'{results_path}: cut off a torn last line (a killed writer)')
  existing = read_results(results_path)
  if keys is not None:
    bases = {k['base'] for k in keys.values()}
    for base in bases:
      check_base(existing, base, results_path)
  done = latest_by_name(existing)
  for i, (name, overrides) in enumerate(points):
    prev = done.get(name)
    key = None if keys is None else keys[name]
    if prev is not None and prev.get('status') == 'ok' and (key is None or
                                                             prev.get('key') == key):
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
    if key is not None:
      row['key'] = key
    append_result(results_path, row)
    if process.release_executables():  # a long sweep would otherwise exhaust the map table
      log(f'[{i + 1}/{len(points)}] released compiled executables (memory-map table 3/4 full)')
    done[name] = row
  return [done[n] for n in names]


def require_success(rows: list[dict]) -> None:
  """Raise when no point of a sweep succeeded (an entry point then exits non-zero).

  Args:
    rows: the sweep's point rows (a 'float' row, if present, is not a point).

  Raises:
    RuntimeError: every point failed; names them and their first error.
  """
  points = [r for r in rows if r.get('name') != 'float']
  if points and all(r.get('status') != 'ok' for r in points):
    raise RuntimeError(f'every point of the sweep failed ({len(points)}): '
                       f'{[r.get("name") for r in points][:6]}; first error: '
                       f'{points[0].get("error")}')
