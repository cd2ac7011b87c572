"""The body the fine-tuning entry points share (experiments/finetune.py, experiments/qat_gemma3.py):
the context for the config's model source, the config file's sweep filtered by `only=`, the
sweep run, its table, and a failure exit when a point failed.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from qjax import eval as qeval
from qjax.pipeline import finetune
from qjax.pipeline.sweeps import apply_overrides, load_sweep

CONTEXTS = {'gemma3_270m': finetune.gemma_context, 'tiny': finetune.tiny_context}


def make_context(c, log=print) -> finetune.FinetuneContext:
  """The FinetuneContext of `c.model_source` ('gemma3_270m' or 'tiny')."""
  make = CONTEXTS.get(c.model_source)
  if make is None:
    raise ValueError(f'model_source={c.model_source!r} is unknown; use one of {sorted(CONTEXTS)}.')
  return make(c, log)


def selected_points(c, config_path: str, point_name: Callable) -> list[dict]:
  """The config file's `sweep()` points (a ':variant' suffix of the path is dropped), only
  those named in `c.only` (comma-separated) when it is set; an unknown name is an error."""
  points = load_sweep(config_path.split(':')[0])()
  only = set(filter(None, c.only.split(',')))
  if not only:
    return points
  names = [point_name(apply_overrides(c, p)) for p in points]
  unknown = sorted(only - set(names))
  if unknown:
    raise ValueError(f'only={c.only!r}: no point named {unknown}; the sweep has {names}.')
  return [p for p, n in zip(points, names) if n in only]


def run_experiment(c, config_path: str, point_name: Callable, run_sweep: Callable,
                   columns, log=None) -> list[dict]:
  """Run a fine-tuning config's sweep end to end; prints the table, raises if a point failed.

  Args:
    c: the config (model_source, only, out_dir, ...).
    config_path: the --config file path (possibly 'file.py:variant').
    point_name: config -> point name (`finetune.point_name`, `finetune_qat.point_name`).
    run_sweep: (config, points, ctx, log) -> rows (`finetune.run_finetune_sweep`, ...).
    columns: the table's columns.
    log: progress printer (default: print, flushed).

  Returns:
    The rows.
  """
  log = log or (lambda s: print(s, flush=True))
  t0 = time.perf_counter()
  log(f'load average before the run: {os.getloadavg()}')
  ctx = make_context(c, log)
  rows = run_sweep(c, selected_points(c, config_path, point_name), ctx, log)
  log('\n' + qeval.markdown_table(rows, columns))
  log(f'\ntotal {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')
  qeval.require_success(rows)
  return rows
