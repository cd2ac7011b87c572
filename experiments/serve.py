r"""Serve a synthetic batch of prompts with `qjax.infer.Engine` and print a table.

  python -m experiments.serve --config=configs/engine_tiny.py

One row per (KV format, prefix caching): throughput of the second (compiled) run, steps,
prefill tokens computed, prefix-hit tokens, preemptions, compilations, and cache waste
(allocated minus used slots) of the paged cache next to a contiguous max_len-per-request one.
"""

from absl import app
from flax import nnx
from ml_collections import config_flags

from qjax import infer
from qjax.nn import Transformer, TransformerConfig

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/engine_tiny.py', lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  cfg = TransformerConfig(**c.model)
  model = Transformer(cfg, rngs=nnx.Rngs(c.seed))
  prompts, params = infer.synthetic_workload(vocab_size=cfg.vocab_size, **c.workload)
  rows = []
  for fmt in c.kv_formats:
    for caching in c.prefix_caching:
      ecfg = infer.EngineConfig(kv_format=None if fmt == 'float' else fmt,
                                prefix_caching=caching, **c.engine)
      engine = infer.Engine(model, ecfg)
      infer.serve(engine, prompts, params)  # compiles the step buckets
      engine = infer.Engine(model, ecfg)  # fresh pages and prefix cache, same executables
      row = infer.serve(engine, prompts, params)
      rows.append(dict(kv=fmt, prefix_caching=caching, **row))
      print(rows[-1], flush=True)
  keys = ['kv', 'prefix_caching', 'generated', 'tokens_per_s', 'steps', 'prefill_tokens',
          'prefix_hit_tokens', 'preemptions', 'compilations', 'paged_waste', 'contiguous_waste']
  print('\n| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys))
  for r in rows:
    print('| ' + ' | '.join(str(r[k]) for k in keys) + ' |')


if __name__ == '__main__':
  app.run(main)
