r"""PTQ algorithms on a trained run: {RTN, GPTQ, AWQ} x {int4, int3} x {per-channel, g128},
plus W8A8 {plain, SmoothQuant} and LLM.int8(), each evaluated against the float model.

Command (train the model first, ~2 min on 2 cores):
  XLA_FLAGS= .venv/bin/python -m experiments.train --config=configs/tiny_lm.py \
      --config.workdir=/tmp/ptq_lm \
      --config.data.source=qjax/data/corpora/tinyshakespeare/input.txt --config.train.steps=300
  XLA_FLAGS= .venv/bin/python -m experiments.sweep --config=configs/ptq_algorithms.py \
      --config.workdir=/tmp/ptq_lm
Every point is a `python -m experiments.quantize` point (`quant.method` set by the sweep):
saved with its conversion record (calibration set hash, procedure, per-layer errors, folds),
reloaded and checked bit for bit. Resumable: rerunning skips finished points.
Expected run time: 2.5 min on an idle 2-core CPU (each point quantizes twice: the second,
  warm, time is the algorithm's own cost; the first includes XLA compiles).
Expected metric (measured: float ppl 6.785): Δppl int3 per-channel RTN +0.63, GPTQ +0.10,
  AWQ +0.26 (the papers' ordering); int4 +0.14 / +0.016 / +0.043; W8A8 plain +2.7e-3,
  SmoothQuant +4e-6, LLM.int8() +5.8e-4.
  Results: <out_dir>/table.md, results.jsonl, ppl_vs_bytes.png, points/*/.
"""

import ml_collections

from configs import quantize as quantize_config


def get_config() -> ml_collections.ConfigDict:
  c = quantize_config.get_config()
  c.workdir = '/tmp/ptq_lm'          # a finished `python -m experiments.train` run
  c.out_dir = 'results/ptq_algorithms'
  c.warm_repeat = True               # quantize every point twice: the second time is warm
  return c


def sweep() -> list[dict]:
  """Method x bits x grouping, W8A8, and ablations, as overrides of get_config()."""
  points = []
  for bits in (4, 3):
    for group in (0, 128):
      for method in ('rtn', 'gptq', 'awq'):
        points.append({'quant.method': method, 'quant.bits': bits, 'quant.group_size': group})
  w8a8 = {'quant.bits': 8, 'quant.group_size': 0, 'quant.act': 'int8'}
  points += [{**w8a8, 'quant.method': 'rtn'}, {**w8a8, 'quant.method': 'smoothquant'},
             {'quant.bits': 8, 'quant.group_size': 0, 'quant.method': 'llm_int8'}]
  # Ablations at 3 bits per channel: calibration from the float model, GPTQ's act-order,
  # AWQ with o_proj / down_proj scales as explicit multiplies (no shared-head constraint).
  int3 = {'quant.bits': 3, 'quant.group_size': 0}
  points += [{**int3, 'quant.method': 'gptq', 'calib.sequential': False},
             {**int3, 'quant.method': 'gptq', 'options.gptq.act_order': True},
             {**int3, 'quant.method': 'awq', 'calib.sequential': False},
             {**int3, 'quant.method': 'awq', 'options.awq.fold_linear': False}]
  return points
