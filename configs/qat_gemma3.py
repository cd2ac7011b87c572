r"""QAT + distillation of Gemma 3 270M: int4 g128 from RTN (or GPTQ), LSQ scales, distilled from the
frozen float model, against the same steps of plain fine-tuning of the float model.

Points (`sweep()`, `qjax.pipeline.finetune_qat`; resumable): float; the RTN int4 g128 start
(GPTQ's with --config.quant.method=gptq; tied embedding / head float, as in the PTQ sweep);
QAT + distillation from it (`qat.steps` steps, alpha 0.5, T 2, LSQ scales with their own
relative-Adam lr, the embedding frozen); the float model fine-tuned with cross entropy for
the same steps; and the KV-int4 variant (the same start served with an int4 KV cache, and
QAT that trains through it).
Data: WikiText-2 valid (vendored) with the PTQ sweep's protocol: the first
  `data.eval_windows` windows (BOS + 511 scored tokens) are scored; training windows of
  `qat.seq_len` tokens (BOS first) and GPTQ's calibration windows come from the tokens after
  them, never scored.
Memory: one Gemma process: the float teacher (f32; its last hidden states computed in their
  own jitted call), the student's f32 weights (its embedding shares the teacher's buffer),
  AdamW states for the ~100M non-embedding weights. The step (`qjax.train.lean_step`)
  donates the trained weights and optimizer state, and the loss forms [chunk, V] logits
  `qat.loss_chunk` positions at a time (`chunked_distill_loss`); peak RSS while training is
  measured (VmHWM reset before the first step).

Command (`pip install -e .[gemma]`):
  XLA_FLAGS= .venv/bin/python -m experiments.qat_gemma3 --config=configs/qat_gemma3.py \
      --config.qat.steps=20 --config.out_dir=results/qat_gemma3_rtn20 \
      --config.only=float,rtn-int4-g128,qat+distill-20steps-from-rtn-int4-g128,float-ft-20steps
  (--config=configs/qat_gemma3.py:tiny runs the same points on a random tiny model;
   --config.only=<point names> runs some points; reruns skip finished points)
Results, run times and peak memory of the 200-step run from GPTQ (--config.quant.method=gptq
  --config.qat.steps=200 --config.qat.warmup=10), with its date, machine and commands:
  docs/training.md.
"""

import ml_collections

from configs import quantize as quantize_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model_source = 'gemma3_270m'
  c.out_dir = 'results/qat_gemma3'
  c.only = ''
  c.seed = 0
  c.point = ml_collections.ConfigDict()
  c.point.kind = 'qat'             # float, ptq, qat, float_ft (sweep() sets it)

  c.data = ml_collections.ConfigDict()
  c.data.corpus = 'wikitext2_valid'
  c.data.scored = 'head'           # the first windows are scored, the rest trains
  c.data.valid_fraction = 0.1      # (unused with scored='head')
  c.data.eval_window = 511         # scored tokens per window (BOS + these = 512)
  c.data.eval_windows = 4
  c.data.eval_batch = 1

  c.quant = quantize_config.quant_config()
  c.quant.method = 'rtn'           # the PTQ start: 'rtn', 'gptq' or 'awq'
  c.quant.bits = 4
  c.quant.group_size = 128
  c.quant.exempt = 'embed'
  c.calib = quantize_config.calib_config()
  c.calib.num_sequences = 16
  c.calib.seq_len = 512
  c.calib.batch_size = 4
  c.options = quantize_config.method_options()

  c.qat = ml_collections.ConfigDict()
  c.qat.steps = 16
  c.qat.batch = 1
  c.qat.seq_len = 128
  c.qat.lr = 5e-5
  c.qat.scale_lr = 1e-3
  c.qat.warmup = 2
  c.qat.weight_decay = 0.0
  c.qat.clip_norm = 1.0
  c.qat.alpha = 0.5
  c.qat.temperature = 2.0
  c.qat.kv = ''                    # '' float KV cache, or 'int4' (the KV-int4 variant)
  c.qat.freeze = 'embed'           # modules not trained (the tied embedding / float head)
  c.qat.remat = True
  c.qat.loss_chunk = 32             # positions whose [chunk, V] logits exist at once
  c.qat.seed = 1
  c.qat.log_every = 5

  if arg == 'tiny':  # the same points on a random tiny model, for tests and notebooks
    c.model_source = 'tiny'
    c.out_dir = 'results/qat_tiny'
    c.model = ml_collections.ConfigDict(dict(
        d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, d_ff=128,
        mlp='swiglu', tie_embeddings=True))
    c.data.eval_window = 64
    c.data.eval_windows = 8
    c.data.eval_batch = 8
    c.quant.bits = 3
    c.quant.group_size = 64
    c.calib.num_sequences = 8
    c.calib.seq_len = 64
    c.qat.steps = 8
    c.qat.batch = 4
    c.qat.seq_len = 64
    c.qat.lr = 1e-3
    c.qat.scale_lr = 1e-2
    c.qat.log_every = 0
    c.qat.remat = False
    c.qat.loss_chunk = 16
  return c


def sweep() -> list[dict]:
  return [{'point.kind': 'float'}, {'point.kind': 'ptq'}, {'point.kind': 'qat'},
          {'point.kind': 'float_ft'},
          {'point.kind': 'ptq', 'qat.kv': 'int4'}, {'point.kind': 'qat', 'qat.kv': 'int4'}]
