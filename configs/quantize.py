"""PTQ of a trained run (RTN, GPTQ, AWQ, SmoothQuant, LLM.int8()), evaluated against float.

Command:
  .venv/bin/python -m experiments.quantize --config=configs/quantize.py \
      --config.workdir=results/tiny_lm --config.quant.bits=4 --config.quant.group_size=128
  ... --config.quant.method=gptq --config.calib.num_sequences=64   (calibrated methods)
Expected run time: ~20 s on a 2-core CPU for the tiny_lm model (RTN; GPTQ/AWQ ~1 min).
Expected metric: int8 per-channel: val ppl within 0.5% of float, greedy agreement ~1.0;
  int4 g128: ppl within a few %; weight bytes of quantized layers ~0.53x (int4) of float/4...
  see results/.../result.json and conversion_record.json.
"""

import ml_collections


def quant_config() -> ml_collections.ConfigDict:
  """One PTQ point: the policy `qjax.pipeline.make_policy` builds (sweeps override these)."""
  q = ml_collections.ConfigDict()
  q.method = 'rtn'                 # 'rtn' (no calibration data), 'gptq', 'awq',
                                   # 'smoothquant' (needs act='int8'), 'llm_int8' (int8 weights)
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
  q.kv = ''                        # KV cache format to serve with: '' float, or 'int8', 'int4',
                                   # 'fp8', 'fp8_e5m2' (qjax.nn.kvcache.KV_FORMATS)
  return q


def calib_config() -> ml_collections.ConfigDict:
  """The calibration set of GPTQ / AWQ / SmoothQuant / LLM.int8() (RTN reads none).

  Its token ids are hashed into the conversion record with this description.
  """
  c = ml_collections.ConfigDict()
  c.source = ''                    # '': the run's training split; else a text file, tokenized
                                   # with the run's tokenizer
  c.num_sequences = 32             # random windows ...
  c.seq_len = 128                  # ... of this many tokens
  c.seed = 0
  c.batch_size = 8                 # sequences per calibration forward pass
  c.sequential = True              # block l calibrated on quantized blocks 0..l-1 (GPTQ)
  return c


def method_options() -> ml_collections.ConfigDict:
  """Per-method options of `qjax.algorithms.apply_method`, at their defaults.

  Options whose default is None (AWQ's fixed `alpha`: None searches the grid) are left out:
  a config field cannot change type later.
  """
  from qjax.algorithms.apply import METHOD_OPTIONS  # pylint: disable=g-import-not-at-top
  return ml_collections.ConfigDict(
      {m: {k: v for k, v in opts.items() if v is not None} for m, opts in METHOD_OPTIONS.items()})


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
  c.workdir = 'results/tiny_lm'    # a finished `python -m experiments.train` run
  c.out_dir = ''                   # default: <workdir>/quantized/<format name>
  c.allow_unfinished = False       # quantize a run stopped before train.steps (the record
                                   # states the step)
  c.quant = quant_config()
  c.calib = calib_config()
  c.options = method_options()
  c.eval = eval_config()
  return c
