"""The engine's host share of a decode step: one step per dispatch vs K steps per dispatch.

    python -m benchmarks.engine_host [--layers=18] [--rows=8] [--tokens=32] [--block=8]

A Gemma 3 270M-shaped model (random weights, float32, `--layers` layers) serves `--rows`
greedy requests of 16-token prompts and `--tokens` new tokens each on an engine of
`--rows` rows, after `compile_buckets()` and one warm-up run (steady state: nothing
compiles). Both engines (EngineConfig.decode_block = 1 and `--block`) run in turn, twice
each; the second run of each is printed: tokens/s, steps, dispatches, and per decode step
the host planning, dispatch and device-wait milliseconds (`EngineStats.timing`) with the
host share (host + dispatch over host + dispatch + wait). Compare ratios within one run
only: a shared machine's absolute times vary run to run. Results: docs/engine.md.
Expected run time: ~2-3 minutes on 2 CPU cores.
"""

import argparse
import os

import numpy as np
from flax import nnx

from qjax.infer import Engine, EngineConfig
from qjax.nn import Transformer, TransformerConfig
from qjax.pipeline import workload


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--layers', type=int, default=18)
  ap.add_argument('--rows', type=int, default=8)
  ap.add_argument('--tokens', type=int, default=32)
  ap.add_argument('--block', type=int, default=8)
  a = ap.parse_args(argv)
  print(f'load average: {os.getloadavg()}', flush=True)
  cfg = TransformerConfig.gemma3_270m(num_layers=a.layers, max_len=256)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  prompts, params = workload.synthetic_workload(
      num_requests=a.rows, vocab_size=cfg.vocab_size, prompt_len=(16, 16),
      output_len=(a.tokens, a.tokens))
  pages = a.rows * -(-(16 + a.tokens + a.block) // 16) + 1
  engines = {k: Engine(model, EngineConfig(max_batch=a.rows, page_size=16, num_pages=pages,
                                           chunk_size=16, max_len=128, decode_block=k))
             for k in (1, a.block)}
  for engine in engines.values():
    engine.compile_buckets()
    workload.serve(engine, prompts, params)  # warm-up
  rows = []
  for _ in range(2):
    rows = [dict(decode_block=k, **workload.serve(e, prompts, params))
            for k, e in engines.items()]
  keys = ('decode_block', 'tokens_per_s', 'steps', 'dispatches', 'host_ms_per_step',
          'dispatch_ms_per_step', 'wait_ms_per_step', 'host_share', 'compilations')
  print('| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys))
  for r in rows:
    print('| ' + ' | '.join(str(r[k]) for k in keys) + ' |')
  base, blocked = rows
  print(f"tokens/s ratio (block {a.block} / 1): "
        f"{blocked['tokens_per_s'] / base['tokens_per_s']:.2f}; host ms per step ratio: "
        f"{blocked['host_ms_per_step'] / max(base['host_ms_per_step'], 1e-9):.2f}")
  assert np.isfinite(base['tokens_per_s'])
  return rows


if __name__ == '__main__':
  main()
