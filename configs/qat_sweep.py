"""QAT and distillation of the small trained model, swept against round-to-nearest PTQ.

Points: precision {8, 4, 3, 2} x group size {per-channel, 128, 32} x method {rtn (PTQ),
qat (LSQ learned scales, from the RTN point), qat+distill (the same, plus Hinton distillation
from the float model restored from the checkpoint)}: 36 points, appended to
<out_dir>/results.jsonl in the PTQ sweeps' row format, with table.md and ppl_vs_bytes.png
(one line per method). Rerunning skips finished points.
--config.qat.kv=int4 (or int8, fp8) makes the QAT points train and serve with that KV cache
format (points named '...-kvint4'; see experiments/qat.py and qjax.pipeline.qat).

Command (base model first, ~2-4 minutes):
  XLA_FLAGS= .venv/bin/python -m experiments.train --config=configs/tiny_lm.py \
      --config.workdir=/tmp/qat_base \
      --config.data.source=qjax/data/corpora/tinyshakespeare/input.txt
  XLA_FLAGS= .venv/bin/python -m experiments.qat --config=configs/qat_sweep.py \
      --config.workdir=/tmp/qat_base --config.out_dir=/tmp/qat_sweep  [--config.qat.steps=200]
Expected run time: ~10 minutes on an idle 2-core CPU (24 QAT points of 40 steps, compiles
  dominate; 14 minutes measured with the machine shared, load ~6).
Expected metric (measured, float ppl 6.785): RTN int8 6.78-6.79, int4 6.86-6.93, int3
  7.20-7.42, int2 16.4-31.9; QAT int3 6.75-6.84 and int2 7.8-8.4 (recovers 0.89-1.08 of
  RTN's loss; QAT + distillation 0.92-1.07), 40 steps, 12-40 s of training per point. The
  base model is briefly trained, so the same 40 steps also lower the float model's ppl to
  6.66 (benchmarks/qat_bench.py reports recovery against that too)."""

import ml_collections

from configs import quantize as quantize_config

METHODS = ('rtn', 'qat', 'qat+distill')


def qat_config() -> ml_collections.ConfigDict:
  """QAT / distillation training of one point (the base model's data and sequence length)."""
  q = ml_collections.ConfigDict()
  q.steps = 40                     # optimizer steps per QAT point
  q.batch = 16
  q.lr = 1e-3                      # peak lr of the weights (warm-up + cosine, AdamW)
  q.warmup = 4
  q.weight_decay = 0.0
  q.clip_norm = 1.0
  q.learn_scales = True            # LSQ step sizes (+ zero points when asymmetric)
  q.init = 'rtn'                   # start from this PTQ result: 'rtn', 'gptq' or 'awq'
                                   # (calibrated on the config's calib set)
  q.pact = 0.0                     # > 0: PACT clip [-a, a] of quantized activations, learned,
                                   # initialised at a (needs quant.act='int8' or 'e4m3')
  q.kv = ''                        # KV cache format to train and serve with ('int8', 'int4',
                                   # 'fp8', 'fp8_e5m2'); '' = a float cache
  q.scale_lr = 1e-2                # their own lr (Adam, relative to their size: multi_transform)
  q.alpha = 0.5                    # distillation: weight of the label cross entropy
  q.temperature = 2.0              # distillation temperature T
  q.seed = 1                       # batch stream (the base model trained on seed 0's)
  q.log_every = 0                  # 0: quiet
  q.save = True                    # save each converted point with a conversion record
  return q


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = '/tmp/qat_base'      # a finished `python -m experiments.train` run (the teacher)
  c.out_dir = 'results/qat_sweep'
  c.allow_unfinished = False       # use a run stopped before train.steps (records the step)
  c.quant = quantize_config.quant_config()
  c.calib = quantize_config.calib_config()     # for qat.init = 'gptq' / 'awq'
  c.options = quantize_config.method_options()
  c.eval = quantize_config.eval_config()
  c.qat = qat_config()
  return c


def sweep():
  """Precision x group size x method (quant.method in METHODS)."""
  points = []
  for bits in (8, 4, 3, 2):
    for group in (0, 128, 32):
      for method in METHODS:
        points.append({'quant.bits': bits, 'quant.group_size': group, 'quant.method': method})
  return points
