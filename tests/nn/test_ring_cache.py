"""Sliding-window layers as a ring of window + slack slots: the same logits as a full cache.

The reference is the cache-free forward (`model(tokens)`), whose window mask is independent
of any cache; the ring runs well past its window (40 tokens, window 8, ring 12 slots), with
a prefill longer than the ring, ragged rows, a multi-token step and a rollback.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.nn import Transformer, TransformerConfig, init_cache, kvcache, logits_step
from qjax.nn import with_kv_format

WINDOW, SLACK, MAX_LEN = 8, 4, 48
CFG = TransformerConfig.tiny(num_layers=2, sliding_window=WINDOW, global_every=2,
                             max_len=MAX_LEN)  # layer 0 local, layer 1 global


@pytest.fixture(scope='module')
def model_and_tokens():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
  return model, tokens, np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))


def test_the_ring_holds_window_plus_slack_slots():
  cache = init_cache(CFG, 2, MAX_LEN, ring_slack=SLACK)
  assert cache.k[0].shape == (2, WINDOW + SLACK, CFG.num_kv_heads, CFG.head_dim)
  assert cache.k[1].shape == (2, MAX_LEN, CFG.num_kv_heads, CFG.head_dim)  # global layer
  assert cache.max_len == MAX_LEN
  dense = init_cache(CFG, 2, MAX_LEN, ring=False)
  assert dense.k[0].shape[1] == MAX_LEN and dense.max_len == MAX_LEN
  assert kvcache.nbytes(cache) < kvcache.nbytes(dense)
  with pytest.raises(ValueError, match='ring_slack=0'):
    init_cache(CFG, 2, MAX_LEN, ring_slack=0)


def _drive(model, tokens, cache):
  """(row, position) -> logits: a 20-token prefill, ragged rows, a 4-token step, rollbacks."""
  out = {}
  logits, cache = logits_step(model, tokens[:, :20], cache)  # longer than the 12-slot ring
  out.update({(b, p): np.asarray(logits[b, p]) for b in range(2) for p in range(20)})
  pos = [20, 17]  # row 1 rolled back by 3 (<= slack): a ragged batch from here on
  for step in range(12):
    width = 4 if step == 4 else 1  # a draft-sized step, then every row rolled back by 3
    feed = jnp.stack([tokens[b, pos[b]:pos[b] + width] for b in range(2)])
    cache = dataclasses.replace(cache, length=jnp.asarray(pos, jnp.int32))
    logits, cache = logits_step(model, feed, cache)
    for b in range(2):
      out[(b, pos[b])] = np.asarray(logits[b, 0])
      pos[b] += 1
  assert min(pos) >= 2 * (WINDOW + SLACK)  # well past the ring: it wrapped several times
  return out


@pytest.mark.parametrize('fmt', [None, 'int8'])
def test_ring_logits_equal_the_full_forward_past_the_window(model_and_tokens, fmt):
  model, tokens, full_forward = model_and_tokens
  if fmt is not None:  # the full forward then passes K/V through the cache's storage format
    model = with_kv_format(model, fmt)
    full_forward = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))
  got = _drive(model, tokens, init_cache(CFG, 2, MAX_LEN, fmt=fmt, ring_slack=SLACK))
  for k, logits in got.items():
    np.testing.assert_allclose(logits, full_forward[k], rtol=2e-4, atol=2e-4, err_msg=str(k))
