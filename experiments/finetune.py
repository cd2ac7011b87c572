r"""Fine-tuning sweep: QLoRA on a frozen quantized base vs the base and a full fine-tune.

  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_gemma3.py
  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_tiny.py

The config's docstring states the points; `qjax.pipeline.finetune` runs them (resumable),
writing <out_dir>/results.jsonl and table.md; each QLoRA point also leaves its adapters
(points/<name>/adapters) and its merged, re-quantized model with a conversion record
(points/<name>/merged).
"""

import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline
from qjax.pipeline import finetune

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/qlora_gemma3.py', lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  t0 = time.perf_counter()
  print(f'load average before the run: {os.getloadavg()}', flush=True)
  log = lambda s: print(s, flush=True)
  make = finetune.gemma_context if c.model_source == 'gemma3_270m' else finetune.tiny_context
  ctx = make(c, log)
  points = pipeline.load_sweep(config_flags.get_config_filename(flags.FLAGS['config']))()
  only = set(filter(None, c.only.split(',')))
  if only:
    points = [p for p in points
              if finetune.point_name(pipeline.apply_overrides(c, p)) in only]
  rows = finetune.run_finetune_sweep(c, points, ctx, log)
  print('\n' + qeval.markdown_table(rows, finetune.COLUMNS))
  print(f'\ntotal {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')
  qeval.require_success(rows)


if __name__ == '__main__':
  app.run(main)
