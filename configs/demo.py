"""The demo: train a small byte-level LM on the embedded corpus, then sweep RTN PTQ formats.

Command:
  make demo       (= .venv/bin/python -m experiments.demo --config=configs/demo.py)
Expected run time: 2-4 minutes on a 2-core CPU (training ~45 s, then 10 sweep points).
Expected metric: float validation perplexity ~6.3 (unigram baseline ~28); int8 within 0.1%
  of float; int4 g32 within ~2%; int3 per-channel ~12% worse. The measured run:
  docs/quantization.md#the-demos-rtn-sweep. Results, table, conversion records (and the plot,
  with the 'plots' extra) land in results/demo/. Rerunning resumes (finished points are
  skipped).
"""

import ml_collections

from configs import quantize as quantize_config
from configs import tiny_lm


def get_config() -> ml_collections.ConfigDict:
  c = tiny_lm.get_config()
  c.workdir = 'results/demo/train'
  c.out_dir = 'results/demo'
  c.quant = quantize_config.quant_config()
  c.eval = quantize_config.eval_config()
  return c


def sweep():
  """Precision x group size: {int8, int4, int3} x {per-channel, g128, g32}, plus asym int4."""
  points = []
  for bits in (8, 4, 3):
    for group in (0, 128, 32):
      points.append({'quant.bits': bits, 'quant.group_size': group})
  points.append({'quant.bits': 4, 'quant.group_size': 32, 'quant.symmetric': False})
  return points
