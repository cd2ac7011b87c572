"""Causal / sliding-window attention through jax's Pallas splash attention kernel (TPU).

A thin wrapper: grouped query heads become splash's multi-query form (one call per kv head
serves its G query heads, vmapped over K and the batch), the causal or local mask is a lazy
splash mask (no T x S array), and sequences are padded to whole kernel blocks. The kernel
module is imported on first use, so importing qjax never loads it. Off TPU it runs only in
Pallas interpret mode (`interpret=True`), which is how the tests check it on CPU.

The mask is over indices (query i sees keys j <= i, and j > i - window): the caller passes
keys that are the queries' own, at consecutive positions (`qjax.nn.attention_forms`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target

# Query / key rows per kernel block (splash needs multiples of 128 lanes); T is padded to it.
BLOCK = 128


@functools.lru_cache(maxsize=64)
def _kernel(group: int, length: int, window: Optional[int], softcap: Optional[float],
            block: int, interpret: bool, compile_only: bool):
  """A splash MQA kernel of `group` heads over `length` (padded) tokens; cached per shape."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  shape = (length, length)
  if window is None:
    head_mask = sm.CausalMask(shape)
  else:
    head_mask = sm.LocalMask(shape, window_size=(window - 1, 0), offset=0)
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  # The kernel holds its mask tables as arrays: make them concrete (this runs while a caller
  # is being traced), so a cached kernel never keeps a tracer of another trace. A compile-only
  # device (`qjax.aot`) holds no buffers: the tables are then built on the host and become
  # constants of the compiled program.
  host = jax.default_device(jax.devices('cpu')[0]) if compile_only else contextlib.nullcontext()
  with jax.ensure_compile_time_eval(), host:
    return sk.make_splash_mqa_single_device(
        sm.MultiHeadMask([head_mask] * group), block_sizes=sizes,
        attn_logits_soft_cap=softcap, interpret=interpret)


def splash_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *,
                     window: Optional[int] = None, logit_softcap: Optional[float] = None,
                     interpret: bool = False) -> jax.Array:
  """Causal self-attention of T queries over their own T keys (queries already scaled).

  Args:
    q_BTNH: queries; N a multiple of K.
    k_BTKH: keys at the queries' positions.
    v_BTKH: values.
    window: sliding window (query i sees keys i - window < j <= i), or None.
    logit_softcap: softcap of the attention logits, or None.
    interpret: run the kernel in Pallas interpret mode (any backend; slow).

  Returns:
    out_BTNH in q's dtype. Gradients flow through splash's own backward kernels.
  """
  b, t, n, h = q_BTNH.shape
  kh = k_BTKH.shape[2]
  if n % kh:
    raise ValueError(f'splash_attention: {n} query heads are not a multiple of {kh} kv heads.')
  block = BLOCK
  pad = -t % block
  widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
  # Padding sits after every real token, so the causal mask hides it from real queries.
  q_BKGTH = widen(q_BTNH).reshape(b, t + pad, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
  k_BKSH = widen(k_BTKH).transpose(0, 2, 1, 3)
  v_BKSH = widen(v_BTKH.astype(k_BTKH.dtype)).transpose(0, 2, 1, 3)
  kernel = _kernel(n // kh, t + pad, window, logit_softcap, block, interpret,
                   qjax_target.current().compile_only)
  per_head = lambda q_GTH, k_SH, v_SH: kernel(q_GTH, k_SH, v_SH)
  out_BKGTH = jax.vmap(jax.vmap(per_head))(q_BKGTH, k_BKSH.astype(q_BKGTH.dtype),
                                           v_BKSH.astype(q_BKGTH.dtype))
  out_BTNH = out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t + pad, n, h)[:, :t]
  return out_BTNH.astype(q_BTNH.dtype)
