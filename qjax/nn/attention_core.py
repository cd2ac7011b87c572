"""Grouped-query attention as pure math on arrays: `attend` and its online-softmax forms.

Query heads are grouped by the kv head they share, N = K * G, so MHA (G = 1), GQA and MQA
(K = 1) are one einsum, 'BTKGH,BSKH->BKGTS', with no repeated keys in memory.

Two exact forms in plain jnp: `attend` (dense: the T x S logits at once) and
`attend_blockwise` (FlashAttention's online softmax, Dao et al. 2022, as a `lax.scan` over
key blocks: a running max, normaliser and weighted sum per query, so temp memory is O(T *
block) instead of O(T * S)). `online_attend` is the scan itself over any sequence of key
blocks; a paged cache (`qjax.infer.PagedKVCache`) feeds it its pages. They are the reference
and the CPU path. The `Attention` layer (`qjax.nn.attention`) and the fused forms
(`qjax.nn.attention_forms`) both build on this module, which imports neither.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from qjax.nn import kvcache

# Finite, so a fully masked row (never produced by the model) gives a uniform softmax, not NaN.
_MASKED = -1e30
# Position of a key slot that holds nothing: later than every query, so the causal mask hides it.
EMPTY_POSITION = kvcache.EMPTY_POSITION


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
  """`cap * tanh(x / cap)`, or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def attention_mask(q_pos_BT: jax.Array, k_pos_BS: jax.Array,
                   window: Optional[int] = None) -> jax.Array:
  """Boolean mask_BTS: causal, and within `window` positions when given."""
  diff_BTS = q_pos_BT[:, :, None] - k_pos_BS[:, None, :]
  mask = diff_BTS >= 0
  if window is not None:
    mask &= diff_BTS < window
  return mask


def weighted_values(probs_BKGTS: jax.Array, v_BSKH: jax.Array, mask_BTS: jax.Array,
                    **einsum_kw) -> jax.Array:
  """out_BKGTH = sum over S of probs * v, with masks that select, never multiply.

  A masked slot's weight is 0, and 0 x NaN is NaN: a stale page another request left, or a
  draft token the target rejects later in the same row, would turn every query NaN. Here a
  slot whose value is not finite adds nothing to a query that cannot see it, and makes a
  query that can see it NaN (the failure stays with the request it belongs to).
  """
  bad_BSK = ~jnp.all(jnp.isfinite(v_BSKH), axis=-1)
  clean_BSKH = jnp.where(bad_BSK[..., None], jnp.zeros((), v_BSKH.dtype), v_BSKH)
  out_BKGTH = jnp.einsum('BKGTS,BSKH->BKGTH', probs_BKGTS, clean_BSKH, **einsum_kw)
  sees_bad_BKT = jnp.einsum('BTS,BSK->BKT', mask_BTS.astype(jnp.float32),
                            bad_BSK.astype(jnp.float32)) > 0
  return jnp.where(sees_bad_BKT[:, :, None, :, None], jnp.asarray(jnp.nan, out_BKGTH.dtype),
                   out_BKGTH)


def attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_BT: jax.Array,
           k_pos_BS: jax.Array, *, window: Optional[int] = None,
           logit_softcap: Optional[float] = None) -> jax.Array:
  """Masked softmax attention with grouped query heads (queries already scaled).

  Args:
    q_BTNH: queries; N must be a multiple of K.
    k_BSKH: keys.
    v_BSKH: values.
    q_pos_BT: query positions.
    k_pos_BS: key positions (B may be 1 to broadcast).
    window: sliding window (keys with q_pos - window < k_pos <= q_pos), or None.
    logit_softcap: softcap of the attention logits, or None.

  Returns:
    out_BTNH in q's dtype; logits and softmax run in float32.
  """
  b, t, n, h = q_BTNH.shape
  k = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  logits_BKGTS = jnp.einsum('BTKGH,BSKH->BKGTS', q_BTKGH, k_BSKH,
                            preferred_element_type=jnp.float32)
  logits_BKGTS = softcap(logits_BKGTS, logit_softcap)
  mask_BTS = attention_mask(q_pos_BT, k_pos_BS, window)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _MASKED)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BKGTH = weighted_values(probs_BKGTS, v_BSKH, mask_BTS)
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BTNH.dtype)


def attend_reduce(q_B1NH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                  q_pos_B1: jax.Array, k_pos_BS: jax.Array, *, window: Optional[int] = None,
                  logit_softcap: Optional[float] = None) -> jax.Array:
  """`attend` for one query per row, as products summed over H and then over S.

  The dense form's dots take (B, K) as batch dims, which XLA:GPU wants major-most: it
  transposes a (B, S, K, H) cache to (B, K, S, H) and back in every decode step (four copies
  of the cache per layer). Products summed in place read the cache once, in its own layout.
  Same arguments and result as `attend` with T = 1; logits, softmax and the weighted sum run
  in float32. A slot the query cannot see is zeroed before the sum (masks select).
  """
  b, t, n, h = q_B1NH.shape
  if t != 1:
    raise ValueError(f'attend_reduce: T={t}; it takes one query per row (decode).')
  k = k_BSKH.shape[2]
  q_BKGH = q_B1NH.reshape(b, k, n // k, h).astype(jnp.float32)
  logits_BSKG = jnp.sum(q_BKGH[:, None] * k_BSKH[:, :, :, None, :].astype(jnp.float32),
                        axis=-1)
  logits_BSKG = softcap(logits_BSKG, logit_softcap)
  mask_BS = attention_mask(q_pos_B1, k_pos_BS, window)[:, 0]
  logits_BSKG = jnp.where(mask_BS[:, :, None, None], logits_BSKG, _MASKED)
  probs_BSKG = jax.nn.softmax(logits_BSKG, axis=1)
  clean_BSKH = jnp.where(mask_BS[:, :, None, None], v_BSKH, jnp.zeros((), v_BSKH.dtype))
  out_BKGH = jnp.sum(probs_BSKG[..., None] * clean_BSKH[:, :, :, None, :].astype(jnp.float32),
                     axis=1)
  return out_BKGH.reshape(b, 1, n, h).astype(q_B1NH.dtype)


def online_attend(q_BTNH: jax.Array, blocks: Any, fetch: Callable, q_pos_BT: jax.Array, *,
                  window: Optional[int] = None,
                  logit_softcap: Optional[float] = None) -> jax.Array:
  """Exact attention as an online softmax over key blocks (a `lax.scan` over `blocks`).

  Args:
    q_BTNH: queries (already scaled); N a multiple of K.
    blocks: a pytree whose leaves have a leading axis J of length num_blocks (scanned
      over).
    fetch: one block's leaves -> (k_BSKH, v_BSKH, k_pos_BS), the block's S keys of every row
      (B of the positions may be 1); empty slots at `EMPTY_POSITION`.
    q_pos_BT: query positions.
    window: sliding window, or None.
    logit_softcap: softcap of the attention logits, or None.

  Returns:
    out_BTNH in q's dtype, equal to `attend` over the concatenated blocks up to float
    rounding (logits, running max and sums in float32).
  """
  b, t, n, h = q_BTNH.shape

  def body(carry, block):
    m_BKGT, l_BKGT, acc_BKGTH = carry
    k_BSKH, v_BSKH, k_pos_BS = fetch(block)
    k = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
    logits_BKGTS = jnp.einsum('BTKGH,BSKH->BKGTS', q_BTKGH, k_BSKH.astype(q_BTNH.dtype),
                              preferred_element_type=jnp.float32)
    logits_BKGTS = softcap(logits_BKGTS, logit_softcap)
    mask_BTS = attention_mask(q_pos_BT, k_pos_BS, window)
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _MASKED)
    m_new = jnp.maximum(m_BKGT, logits_BKGTS.max(-1))
    # A block before the first unmasked key leaves m at _MASKED; the first real logit then
    # rescales what it summed by exp(_MASKED - m) = 0, so only real keys remain.
    p_BKGTS = jnp.exp(logits_BKGTS - m_new[..., None])
    rescale = jnp.exp(m_BKGT - m_new)
    l_BKGT = l_BKGT * rescale + p_BKGTS.sum(-1)
    pv_BKGTH = weighted_values(p_BKGTS.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype),
                               mask_BTS, preferred_element_type=jnp.float32)
    return (m_new, l_BKGT, acc_BKGTH * rescale[..., None] + pv_BKGTH), None

  k_abs = jax.eval_shape(fetch, jax.tree.map(lambda x: x[0], blocks))[0]
  kh = k_abs.shape[2]
  g = n // kh
  init = (jnp.full((b, kh, g, t), _MASKED, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
          jnp.zeros((b, kh, g, t, h), jnp.float32))
  (_, l_BKGT, acc_BKGTH), _ = jax.lax.scan(body, init, blocks)
  out_BKGTH = acc_BKGTH / l_BKGT[..., None]
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_BTNH.dtype)


def attend_blockwise(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                     q_pos_BT: jax.Array, k_pos_BS: jax.Array, *,
                     window: Optional[int] = None, logit_softcap: Optional[float] = None,
                     block_size: int = 512) -> jax.Array:
  """`attend` with O(T * block_size) temp memory: an online softmax over key blocks.

  Args:
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, window, logit_softcap: as `attend`.
    block_size: keys per block (S is padded to a multiple with empty slots).

  Returns:
    out_BTNH, equal to `attend` within float rounding.
  """
  b, s, kh, h = k_BSKH.shape
  block = min(block_size, s)
  pad = -s % block
  k_pos_BS = jnp.broadcast_to(k_pos_BS, (k_pos_BS.shape[0], s))
  if pad:
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k_BSKH, v_BSKH = widen(k_BSKH), widen(v_BSKH)
    k_pos_BS = jnp.pad(k_pos_BS, ((0, 0), (0, pad)), constant_values=EMPTY_POSITION)
  nb = (s + pad) // block
  split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], nb, block, *x.shape[2:]), 1, 0)
  return online_attend(q_BTNH, (split(k_BSKH), split(v_BSKH), split(k_pos_BS)),
                       lambda kvp: kvp, q_pos_BT, window=window, logit_softcap=logit_softcap)
