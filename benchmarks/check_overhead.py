r"""What the decode step's boundary checks cost: one greedy step with and without them.

    .venv/bin/python -m benchmarks.check_overhead [--blocks=30]

The checks (`qjax.nn.validate`): ids outside the vocabulary poison the (B, D) hidden state
and the embedding, and the argmax flags non-finite logits from its own max. The worst case
for them is a small model with a large vocabulary (here D=64, V=262,144, Gemma's vocabulary),
where the head is most of the step. Both steps are jitted once, then timed in interleaved
blocks of 20 calls; prints the per-step time (min and median over blocks) and their ratio.
Takes ~30 s on 2 cores.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.nn import Transformer, TransformerConfig, init_cache, validate
from qjax.nn import generate as gen

_BLOCKS = flags.DEFINE_integer('blocks', 30, 'interleaved blocks of 20 steps per variant')


def _step(graphdef, checks: bool):
  """The greedy step; `checks=False` uses plain argmax (the caller patches the poisoning)."""
  def step(state, tok_BT, cache):
    model = nnx.merge(graphdef, state)
    logits_BV, cache = gen._last_logits(model, tok_BT, cache, 1)  # pylint: disable=protected-access
    pick = gen.argmax_or_non_finite if checks else gen.argmax_last
    return pick(logits_BV), cache.length
  return step


def main(_):
  cfg = TransformerConfig(vocab_size=262144, d_model=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=32, d_ff=128, max_len=128)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  cache = init_cache(cfg, 1, 64)
  tok_BT = jnp.asarray([[5]], jnp.int32)
  saved = validate.poison_rows, validate.poison_ids
  validate.poison_rows, validate.poison_ids = (lambda x, ok: x), (lambda x, t, v: x)
  try:
    off = jax.jit(_step(graphdef, checks=False)).lower(state, tok_BT, cache).compile()
  finally:
    validate.poison_rows, validate.poison_ids = saved
  on = jax.jit(_step(graphdef, checks=True)).lower(state, tok_BT, cache).compile()

  def block(f, n=20):
    t = time.perf_counter()
    for _ in range(n):
      out = f(state, tok_BT, cache)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e3

  times = {'without': [], 'with': []}
  for _ in range(_BLOCKS.value):
    times['without'].append(block(off))
    times['with'].append(block(on))
  w, c = np.array(times['without']), np.array(times['with'])
  print(f'ms per step: without checks min {w.min():.3f} median {np.median(w):.3f}; with checks '
        f'min {c.min():.3f} median {np.median(c):.3f}; ratio of medians '
        f'{np.median(c) / np.median(w):.3f}')


if __name__ == '__main__':
  app.run(main)
