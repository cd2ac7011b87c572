"""Round-to-nearest PTQ of a trained run, evaluated against the float model.

Command:
  .venv/bin/python experiments/quantize.py --config=configs/quantize.py \
      --config.workdir=results/tiny_lm --config.quant.bits=4 --config.quant.group_size=128
Expected run time: ~20 s on a 2-core CPU for the tiny_lm model.
Expected metric: int8 per-channel: val ppl within 0.5% of float, greedy agreement ~1.0;
  int4 g128: ppl within a few %; weight bytes of quantized layers ~0.53x (int4) of float/4...
  see results/.../result.json and conversion_record.json.
"""

import ml_collections


def quant_config() -> ml_collections.ConfigDict:
  """One PTQ point: the policy `experiments/quantize.py` builds (sweeps override these)."""
  q = ml_collections.ConfigDict()
  q.method = 'rtn'                 # round-to-nearest; no calibration data
  q.kind = 'int'                   # 'int', 'e4m3' or 'e5m2'
  q.bits = 8
  q.group_size = 0                 # 0: no groups (per-channel / per-tensor)
  q.granularity = 'channel'        # 'channel' (per output channel) or 'tensor'
  q.symmetric = True
  q.calibration = 'absmax'         # 'absmax', 'percentile', 'mse'
  q.calibration_arg = 0.0          # percentile or MSE grid size (0: default)
  q.scale_dtype = 'float32'
  q.act = 'none'                   # 'none' (weight-only), 'int8' (W8A8) or 'e4m3'
  q.exempt = 'embed|lm_head'       # regex of module paths kept in float
  q.path = 'auto'                  # qeinsum compute path (see qjax/core/qdot.py)
  return q


def eval_config() -> ml_collections.ConfigDict:
  e = ml_collections.ConfigDict()
  e.windows = 64                   # validation windows for perplexity
  e.batch = 16
  e.ref_batch = 4                  # windows whose logits are compared position by position
  e.greedy_prompts = 4
  e.prompt_len = 32
  e.greedy_tokens = 32
  return e


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = 'results/tiny_lm'    # a finished experiments/train.py run
  c.out_dir = ''                   # default: <workdir>/quantized/<format name>
  c.quant = quant_config()
  c.eval = eval_config()
  return c
