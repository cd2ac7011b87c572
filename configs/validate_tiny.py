r"""Validation reports on the tiny model (tests, the notebook): the pipeline of
configs/validate_gemma3.py at toy scale.

Command:
  XLA_FLAGS= .venv/bin/python -m experiments.validate --config=configs/validate_tiny.py

The base is a randomly initialised `TransformerConfig.tiny` (vocab 256, byte tokenizer
without BOS): its numbers exercise the machinery, they say nothing about quality (its task
accuracies sit at chance). Points: RTN int8, RTN int4 g32, a fallback policy (int3 g32 ->
int8 until KL <= 0.01) and a mixed-precision policy at the bytes of uniform int4 g32; then
the frontier over {int8, int4 g32, int3 g32}.
Expected run time: ~1.5 min on 2 loaded CPU cores (mostly XLA compiles).
Expected result: weights and KV predicted = measured (ratio 1.0000), the fallback reaching its
threshold, the mixed policy at or under its budget; results in results/validate_tiny/.
"""

import ml_collections

from configs.validate_base import base, point, section


def get_config() -> ml_collections.ConfigDict:
  return base(
      base='tiny', out_dir='results/validate_tiny', resume=False,
      # Tiny widths (64, 32) take no group of 128: the tiny menu uses groups of 32.
      tiny_formats=section(**{'int8': (8, 0), 'int4-g32': (4, 32), 'int3-g32': (3, 32)}),
      eval=section(window=65, windows=2, batch=2, logit_tokens=64, prompt_len=8,
                   greedy_prompts=2, greedy_tokens=8, long_window=0),
      calib=section(seq_len=64, num_sequences=4, batch_size=4),
      tasks=section(corpus='tinyshakespeare', n_items=8, context_tokens=48, seed=0, batch=8),
      memory=section(batch=2, context=64, prompt=16),
      latency=section(prompt_len=16, steps=0, batches=(1, 8)),
      context=section(budget_gib=0.0, max_context=0),
      points=[point('rtn-int8', 'uniform', fmt='int8'),
              point('fallback-int3-int8', 'fallback', fmt='int3-g32', high='int8',
                    threshold=0.01),
              point('mixed-at-int4-g32', 'mixed', budget_format='int4-g32')],
      frontier=section(formats='int8,int3-g32', windows=2, midpoints=True,
                       fallback='int3-g32:int8:0.01'))
