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


def point(name, kind, method='rtn', fmt='', **kw):
  return ml_collections.ConfigDict(dict(name=name, kind=kind, method=method, format=fmt,
                                        exempt=kw.pop('exempt', ''), high=kw.pop('high', ''),
                                        threshold=kw.pop('threshold', 0.0),
                                        budget_format=kw.pop('budget_format', '')))


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.base = 'tiny'
  c.seed = 0
  c.tiny = ml_collections.ConfigDict(dict(max_len=128))
  # Tiny widths (64, 32) take no group of 128: the tiny menu uses groups of 32.
  c.tiny_formats = ml_collections.ConfigDict({'int8': (8, 0), 'int4-g32': (4, 32),
                                              'int3-g32': (3, 32)})
  c.out_dir = 'results/validate_tiny'
  c.resume = False
  c.run = 'all'                      # 'all', 'points' or 'frontier'
  c.eval = ml_collections.ConfigDict(dict(window=65, windows=2, batch=2, logit_tokens=64,
                                          prompt_len=8, greedy_prompts=2, greedy_tokens=8,
                                          long_window=0))
  c.sensitivity = ml_collections.ConfigDict(dict(tokens=64))
  c.calib = ml_collections.ConfigDict(dict(seq_len=64, num_sequences=4, batch_size=4))
  c.tasks = ml_collections.ConfigDict(dict(corpus='tinyshakespeare', n_items=8,
                                           context_tokens=48, seed=0, batch=8))
  c.memory = ml_collections.ConfigDict(dict(batch=2, context=64, prompt=16))
  c.latency = ml_collections.ConfigDict(dict(prompt_len=16, steps=0, batches=(1, 8)))
  c.context = ml_collections.ConfigDict(dict(budget_gib=0.0, max_context=0))
  c.points = [point('rtn-int8', 'uniform', fmt='int8'),
              point('fallback-int3-int8', 'fallback', fmt='int3-g32', high='int8',
                    threshold=0.01),
              point('mixed-at-int4-g32', 'mixed', budget_format='int4-g32')]
  c.frontier = ml_collections.ConfigDict(dict(formats='int8,int3-g32', windows=2, midpoints=True,
                                              fallback='int3-g32:int8:0.01'))
  return c
