"""Shared by the sharding tests and the two-process worker: a small model, tokens, runs."""

import functools

import jax
import numpy as np
from flax import nnx

from qjax import costmodel
from qjax.nn import Transformer, TransformerConfig, init_cache

B, T, STEPS = 8, 6, 16   # batch (divisible by 8 chips), prompt length, decode steps
S = T + STEPS            # cache length


def config(num_kv_heads: int) -> TransformerConfig:
  """D=64, F=4D, N=8 heads of 16, 2 layers; K=1 (multiquery) or K=8 (multihead)."""
  return TransformerConfig(vocab_size=96, d_model=64, num_layers=2, num_heads=8,
                           num_kv_heads=num_kv_heads, head_dim=16, d_ff=256, max_len=32)


def kv_heads(layout) -> int:
  return 8 if costmodel.as_layout(layout).attn == 'multihead' else 1


def model(num_kv_heads: int = 1) -> Transformer:
  return Transformer(config(num_kv_heads), rngs=nnx.Rngs(0))


def model_shape(num_kv_heads: int) -> costmodel.ModelShape:
  """The same model for the analytic cost model."""
  c = config(num_kv_heads)
  return costmodel.ModelShape('toy', n_layers=c.num_layers, d_model=c.d_model, d_ff=c.d_ff,
                              n_heads=c.num_heads, head_dim=c.head_dim,
                              n_kv_heads=c.num_kv_heads, vocab=c.vocab_size, glu=True)


def tokens() -> np.ndarray:
  return np.random.RandomState(0).randint(0, 96, size=(B, S)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT, cache):
  return nnx.merge(graphdef, state)(tokens_BT, cache=cache)


def reference(m, toks, steps: int = STEPS, fmt=None) -> list:
  """Logits of prefill and `steps` decode steps of `m` on one device (teacher-forced)."""
  graphdef, state = nnx.split(m)
  logits, cache = _forward(graphdef, state, toks[:, :T], init_cache(m.config, B, S, fmt=fmt))
  out = [np.asarray(logits)]
  for i in range(steps):
    logits, cache = _forward(graphdef, state, toks[:, T + i:T + i + 1], cache)
    out.append(np.asarray(logits))
  return out


def sharded(sm, toks, steps: int = STEPS, fmt=None) -> tuple:
  """The same run on a `ShardedTransformer`: (logits list, final cache)."""
  cache = sm.init_cache(B, S, fmt=fmt)
  logits, cache = sm.prefill(toks[:, :T], cache)
  out = [np.asarray(logits)]
  for i in range(steps):
    logits, cache = sm.decode(toks[:, T + i:T + i + 1], cache)
    out.append(np.asarray(logits))
  return out, cache
