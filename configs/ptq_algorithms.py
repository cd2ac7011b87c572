r"""PTQ algorithms on a trained run: {RTN, GPTQ, AWQ} x {int4, int3} x {per-channel, g128},
plus W8A8 {plain, SmoothQuant, LLM.int8()}, each evaluated against the float model.

Command (train the model first, ~2 min on 2 cores):
  XLA_FLAGS= .venv/bin/python experiments/train.py --config=configs/tiny_lm.py \
      --config.workdir=/tmp/ptq_lm \
      --config.data.source=/work/shared/data/tinyshakespeare/input.txt --config.train.steps=300
  .venv/bin/python benchmarks/ptq_sweep.py --config=configs/ptq_algorithms.py \
      --config.workdir=/tmp/ptq_lm
Expected run time: ~10-20 min on a loaded 2-core CPU (most of it XLA compiles; the warm
  quantization times in the table are the algorithms' own cost).
Expected metric: at 3 bits GPTQ and AWQ below RTN in perplexity (the papers' ordering);
  at 4 bits all within a few % of float; W8A8 within ~1% of float. Results:
  results/ptq_sweep/table.md and results.json (rows + calibration records).
"""

import ml_collections

from configs import quantize as quantize_config


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = '/tmp/ptq_lm'          # a finished experiments/train.py run
  c.out_dir = 'results/ptq_sweep'
  c.warm_repeat = True               # quantize every point twice: the second time is warm

  c.calib = ml_collections.ConfigDict()
  c.calib.num_sequences = 32         # random windows of the run's *training* split
  c.calib.seq_len = 128
  c.calib.seed = 0
  c.calib.batch_size = 8
  c.calib.sequential = True

  c.options = ml_collections.ConfigDict()   # per-method options of apply_method
  c.options.gptq = {'damp': 0.01, 'block_size': 128, 'act_order': False}
  c.options.awq = {'alpha_grid': 20, 'clip_search': True}
  c.options.smoothquant = {'alpha': 0.5}
  c.options.llm_int8 = {'threshold': 6.0, 'outlier_weights': 'float'}
  c.options.rtn = {}

  c.quant = quantize_config.quant_config()  # template of every point
  c.eval = quantize_config.eval_config()
  c.points = sweep()
  return c


def sweep() -> list:
  """(method, overrides of the quant template, overrides of the method's options) per point."""
  points = []
  for bits in (4, 3):
    for group in (0, 128):
      for method in ('rtn', 'gptq', 'awq'):
        points.append((method, {'bits': bits, 'group_size': group}, {}))
  w8 = {'bits': 8, 'group_size': 0}
  points += [('rtn', {**w8, 'act': 'int8'}, {}), ('smoothquant', {**w8, 'act': 'int8'}, {}),
             ('llm_int8', w8, {})]
  # Ablations at 3 bits per channel: calibration from the float model, GPTQ's act-order,
  # AWQ with o_proj / down_proj scales as explicit multiplies (no shared-head constraint).
  int3 = {'bits': 3, 'group_size': 0}
  points += [('gptq', int3, {'sequential': False}), ('gptq', int3, {'act_order': True}),
             ('awq', int3, {'sequential': False}), ('awq', int3, {'fold_linear': False})]
  return points
