"""Decode with the loop on the host or on the device: ms per token, one process, interleaved.

    python -m benchmarks.decode_dispatch [--layers=6] [--steps=32] [--reps=5]

'host': a Python loop of `generate.greedy_step` (one dispatch per token); 'device':
`generate.greedy_generate`, which runs every step after the prefill in one jitted
`lax.while_loop` (`generate.decode_loop`). A Gemma 3 270M-shaped model with `--layers`
layers and random weights, batch 1, a 64-token prompt; the two are timed in turn, median of
`--reps` (prefill included in both).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.nn import Transformer, TransformerConfig, generate, init_cache


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--layers', type=int, default=6)
  ap.add_argument('--steps', type=int, default=32)
  ap.add_argument('--reps', type=int, default=5)
  a = ap.parse_args(argv)
  cfg = TransformerConfig.gemma3_270m(num_layers=a.layers, max_len=512)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  prompt = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 64)), jnp.int32)
  size = generate.bucket_length(64 + a.steps)

  def host():
    cache = init_cache(cfg, 1, size)
    tok, cache = generate.greedy_step(model, prompt, cache)
    for _ in range(a.steps - 1):
      tok, cache = generate.greedy_step(model, tok[:, None], cache)
    return jax.block_until_ready(tok)

  def device():
    return jax.block_until_ready(generate.greedy_generate(model, prompt, a.steps))

  runs = {'host': host, 'device': device}
  for f in runs.values():
    f()  # compile
  times = {k: [] for k in runs}
  for _ in range(a.reps):
    for k, f in runs.items():
      t = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - t)
  out = {k: 1e3 * statistics.median(v) / a.steps for k, v in times.items()}
  print(f"{jax.devices()[0].device_kind}: ms per token, host loop {out['host']:.2f}, "
        f"device loop {out['device']:.2f}")
  return out


if __name__ == '__main__':
  main()
