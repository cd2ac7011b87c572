"""The KV cache: a small pytree and the only functions that touch its arrays.

Every read and write of cached keys and values goes through this module, so that paged,
sharded or quantized caches can replace `KVCache` without touching the attention code.

Layout: one (k_BSKH, v_BSKH) pair per layer, S = the cache's max length, keys stored after
RoPE. Slot s holds position s; `length` (an int32 scalar, shared by the batch) is the number
of positions written. A step writes T new positions at slot `length` of every layer
(`write`), then the model advances `length` by T once (`advance`). Slots at or beyond
`length + T` hold zeros; they sit at positions later than every query, so the causal mask
already hides them.

Every layer keeps S slots, local ones too (a ring buffer of the window is a later
optimisation; it changes only this module).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from qjax.nn.config import TransformerConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Cached keys and values.

  Attributes:
    k: per layer, keys k_BSKH (after RoPE), in the cache dtype.
    v: per layer, values v_BSKH.
    length: int32 scalar, positions written so far (the next write goes to this slot).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  length: jax.Array

  @property
  def max_len(self) -> int:
    return int(self.k[0].shape[1])

  @property
  def batch(self) -> int:
    return int(self.k[0].shape[0])

  @property
  def num_layers(self) -> int:
    return len(self.k)


def init_cache(config: TransformerConfig, batch: int, max_len: Optional[int] = None,
               dtype=None) -> KVCache:
  """An empty cache.

  Args:
    config: the model's config (layers, K, H).
    batch: B.
    max_len: S, the longest prompt + generation the cache holds (default `config.max_len`).
    dtype: storage dtype (default `config.dtype`).

  Returns:
    A KVCache of zeros with length 0.
  """
  max_len = config.max_len if max_len is None else max_len
  if not 1 <= max_len <= config.max_len:
    raise ValueError(f'init_cache: max_len={max_len} must be in [1, config.max_len='
                     f'{config.max_len}]; the model is not defined beyond config.max_len.')
  if batch < 1:
    raise ValueError(f'init_cache: batch={batch} must be >= 1.')
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  dtype = jnp.dtype(dtype or config.dtype)
  def zeros():  # distinct buffers per leaf, so that the cache can be donated
    return tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  return KVCache(k=zeros(), v=zeros(), length=jnp.zeros((), jnp.int32))


def check_fits(cache: KVCache, num_new: int) -> None:
  """Raise if `num_new` more positions cannot fit (checked on lengths known in Python)."""
  if num_new > cache.max_len:
    raise ValueError(f'KV cache: a prompt of {num_new} tokens is longer than the cache '
                     f'max_len={cache.max_len}; build the cache with init_cache(..., '
                     f'max_len>={num_new}) or shorten the prompt.')
  if not isinstance(cache.length, jax.core.Tracer):
    length = int(cache.length)
    if length + num_new > cache.max_len:
      raise ValueError(f'KV cache: {length} cached + {num_new} new tokens exceed the cache '
                       f'max_len={cache.max_len}; build a longer cache or stop generating.')


def write(cache: KVCache, layer: int, k_BTKH: jax.Array, v_BTKH: jax.Array) -> KVCache:
  """Write T new keys/values of `layer` at slot `cache.length` (does not advance)."""
  def put(arrs, new):
    upd = jax.lax.dynamic_update_slice_in_dim(arrs[layer], new.astype(arrs[layer].dtype),
                                              cache.length, axis=1)
    return arrs[:layer] + (upd,) + arrs[layer + 1:]
  return dataclasses.replace(cache, k=put(cache.k, k_BTKH), v=put(cache.v, v_BTKH))


def read(cache: KVCache, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(k_BSKH, v_BSKH, positions_1S) of `layer`; slot s holds position s."""
  pos_1S = jnp.arange(cache.max_len, dtype=jnp.int32)[None]
  return cache.k[layer], cache.v[layer], pos_1S


def next_positions(cache: KVCache, num_new: int) -> jax.Array:
  """Positions of the next `num_new` tokens, shape (B, T)."""
  pos_T = cache.length + jnp.arange(num_new, dtype=jnp.int32)
  return jnp.broadcast_to(pos_T, (cache.batch, num_new))


def advance(cache: KVCache, num_new: int) -> KVCache:
  """The cache after a step that wrote `num_new` positions to every layer."""
  return dataclasses.replace(cache, length=cache.length + num_new)


def nbytes(cache: KVCache) -> int:
  """Bytes the device holds for the cache."""
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(cache))
