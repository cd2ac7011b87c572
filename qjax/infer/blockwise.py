"""Exact blockwise attention for long prefills and perplexity: selection and measurement.

The math lives with the attention layer (`qjax.nn.attention.attend_blockwise`, an online
softmax over key blocks, FlashAttention-style, Dao et al. 2022), because the layer calls it
when `TransformerConfig.attention_impl == 'blockwise'`; `nn` never imports `infer`. This
module switches a built model to it and measures what it saves:

    model = with_attention_impl(model, 'blockwise', block_size=512)   # a copy
    nll = model(tokens_BT)          # cache-free forward: temp memory O(T), not O(T^2)
    attention_temp_bytes(2048, 'blockwise')   # compiled temp bytes of one attention call
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.nn.attention import Attention, attend, attend_blockwise
from qjax.nn.config import ATTENTION_IMPLS


def with_attention_impl(model: nnx.Module, impl: str,
                        block_size: Optional[int] = None) -> nnx.Module:
  """A copy of `model` whose attention layers use `impl` ('dense' or 'blockwise').

  Args:
    model: a `Transformer` (float or quantized).
    impl: one of `qjax.nn.config.ATTENTION_IMPLS`.
    block_size: keys per block (default: the config's `attention_block`).

  Returns:
    The copy; its `config` names the implementation too, so records and caches built from it
    agree with what it runs.
  """
  cfg = model.config.replace(attention_impl=impl, **(
      {} if block_size is None else {'attention_block': block_size}))  # validates both
  model = nnx.clone(model)
  model.config = cfg
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
  if not layers:
    raise ValueError(f'with_attention_impl: {type(model).__name__} has no Attention layer.')
  for m in layers:
    m.impl, m.block_size = cfg.attention_impl, cfg.attention_block
  return model


def attention_temp_bytes(seq_len: int, impl: str, *, num_heads: int = 4, num_kv_heads: int = 1,
                         head_dim: int = 256, block_size: int = 512,
                         window: Optional[int] = None) -> int:
  """Compiled temp memory (bytes, XLA's memory analysis) of one causal attention call.

  Args:
    seq_len: T = S (a prefill, or a cache-free forward), batch 1.
    impl: 'dense' or 'blockwise'.
    num_heads, num_kv_heads, head_dim: N, K, H (defaults: Gemma 3 270M).
    block_size: keys per block of the blockwise path.
    window: sliding window, or None.

  Returns:
    `temp_size_in_bytes` of the compiled function: O(T^2) dense, O(T * block) blockwise.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f'attention_temp_bytes: impl={impl!r} is unknown; use one of '
                     f'{ATTENTION_IMPLS}.')
  q = jax.ShapeDtypeStruct((1, seq_len, num_heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, seq_len, num_kv_heads, head_dim), jnp.float32)
  pos = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  if impl == 'dense':
    fn = lambda q, k, v, p: attend(q, k, v, p, p, window=window)
  else:
    fn = lambda q, k, v, p: attend_blockwise(q, k, v, p, p, window=window,
                                             block_size=block_size)
  compiled = jax.jit(fn).lower(q, kv, kv, pos).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)
