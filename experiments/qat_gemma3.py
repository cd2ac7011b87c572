r"""QAT + distillation on the real model, against plain fine-tuning of the float model.

  XLA_FLAGS= .venv/bin/python -m experiments.qat_gemma3 --config=configs/qat_gemma3.py
  XLA_FLAGS= .venv/bin/python -m experiments.qat_gemma3 --config=configs/qat_gemma3.py:tiny

The config's docstring states the points; `qjax.pipeline.finetune_qat` runs them
(resumable), writing <out_dir>/results.jsonl and table.md with the fraction of the PTQ
start's perplexity gap each QAT point recovers.
"""

import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline
from qjax.pipeline import finetune, finetune_qat

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/qat_gemma3.py', lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  t0 = time.perf_counter()
  print(f'load average before the run: {os.getloadavg()}', flush=True)
  log = lambda s: print(s, flush=True)
  make = finetune.gemma_context if c.model_source == 'gemma3_270m' else finetune.tiny_context
  ctx = make(c, log)
  path = config_flags.get_config_filename(flags.FLAGS['config']).split(':')[0]
  points = pipeline.load_sweep(path)()
  only = set(filter(None, c.only.split(',')))
  if only:
    points = [p for p in points
              if finetune_qat.point_name(pipeline.apply_overrides(c, p)) in only]
  rows = finetune_qat.run_qat_gemma_sweep(c, points, ctx, log)
  print('\n' + qeval.markdown_table(rows, finetune_qat.COLUMNS))
  print(f'\ntotal {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')
  qeval.require_success(rows)


if __name__ == '__main__':
  app.run(main)
