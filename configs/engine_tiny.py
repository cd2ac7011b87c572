"""Serve a synthetic workload with the continuous-batching engine on a tiny random model.

Command:
  python -m experiments.serve --config=configs/engine_tiny.py
Expected run time: ~1-2 minutes on a 2-core CPU (mostly compilation: a few step buckets per
  engine; each configuration is run twice and the second, compiled, run is timed).
With a checkpoint written by experiments.convert (`model` is then ignored):
  python -m experiments.serve --config.checkpoint=OUT [--config.chat=True]
  serves `prompts` together (greedy, `max_tokens` each, stopping at the tokenizer's end of
  turn) and prints each completion and the run's throughput row.
Expected result: a table with one row per configuration (float / int8 KV, prefix caching
  off / on): every configuration generates the same number of tokens; paged waste a few
  percent against ~80% for a contiguous cache of max_len slots per request; with prefix
  caching, prefix_hit_tokens > 0 and fewer prefill tokens computed; compilations <= 3 per
  engine (T buckets 1, 8, 32).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, d_ff=128, max_len=256, sliding_window=32, global_every=2)
  c.seed = 0
  c.checkpoint = ''                # an experiments.convert output, served instead of `model`
  c.chat = False                   # wrap each prompt in the checkpoint's chat template
  c.prompts = ('The capital of France is', 'Once upon a time', 'def fibonacci(n):')
  c.max_tokens = 24
  c.max_len = 256                  # the checkpoint's engine: longest prompt + output
  c.engine = dict(max_batch=8, page_size=16, num_pages=96, chunk_size=32,
                  decode_block=8)  # decode steps per dispatch (1: one step per dispatch)
  c.workload = dict(num_requests=24, prompt_len=(8, 64), output_len=(8, 32), system_len=48,
                    shared_fraction=0.5, seed=0)
  c.kv_formats = ('float', 'int8')
  c.prefix_caching = (False, True)
  return c
