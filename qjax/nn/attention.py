"""Grouped-query attention: `attend` (pure math on arrays) and the `Attention` layer.

Query heads are grouped by the kv head they share, N = K * G, so MHA (G = 1), GQA and MQA
(K = 1) are one einsum, 'BTKGH,BSKH->BKGTS', with no repeated keys in memory.

A model may carry a KV format (`Attention.kv_fmt`, None by default; QAT sets it with
`prepare_qat(..., kv=...)`): its keys and values then pass through that format in every
forward, fake-quantized (straight-through) without a cache and quantized by a cache of that
format, so the full forward (training, perplexity) computes what cached serving computes.
`kv_format(model)` reads it, `with_kv_format(model, fmt)` sets it on a copy.

Two exact implementations in plain jnp: `attend` (dense: the T x S logits at once) and
`attend_blockwise` (FlashAttention's online softmax, Dao et al. 2022, as a `lax.scan` over
key blocks: a running max, normaliser and weighted sum per query, so temp memory is O(T *
block) instead of O(T * S)). `online_attend` is the scan itself over any sequence of key
blocks; a paged cache (`qjax.infer.PagedKVCache`) feeds it its pages. They are the reference
and the CPU path; on GPU/TPU `TransformerConfig.attention_impl` ('auto' by default) selects a
fused kernel where one applies, decided in `qjax.nn.attention_forms.choose_form`
(`layer_forms(model, t)` lists each layer's form and why).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QFormat
from qjax.nn import attention_forms
from qjax.nn import axes
from qjax.nn import kvcache
from qjax.nn import shard_hooks
from qjax.nn.config import TransformerConfig
from qjax.nn.layers import Einsum, RMSNorm
from qjax.nn.rope import apply_rope

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
  out_BTKGH = jnp.einsum('BKGTS,BSKH->BTKGH', probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h).astype(q_BTNH.dtype)


def online_attend(q_BTNH: jax.Array, blocks: Any, fetch: Callable, q_pos_BT: jax.Array, *,
                  window: Optional[int] = None,
                  logit_softcap: Optional[float] = None) -> jax.Array:
  """Exact attention as an online softmax over key blocks (a `lax.scan` over `blocks`).

  Args:
    q_BTNH: queries (already scaled); N a multiple of K.
    blocks: a pytree whose leaves have a leading axis of length num_blocks (scanned over).
    fetch: one block's leaves -> (k_BPKH, v_BPKH, k_pos_BP), P keys of every row (B of the
      positions may be 1); empty slots at `EMPTY_POSITION`.
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
    k_BPKH, v_BPKH, k_pos_BP = fetch(block)
    k = k_BPKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
    logits_BKGTP = jnp.einsum('BTKGH,BPKH->BKGTP', q_BTKGH, k_BPKH.astype(q_BTNH.dtype),
                              preferred_element_type=jnp.float32)
    logits_BKGTP = softcap(logits_BKGTP, logit_softcap)
    mask_BTP = attention_mask(q_pos_BT, k_pos_BP, window)
    logits_BKGTP = jnp.where(mask_BTP[:, None, None], logits_BKGTP, _MASKED)
    m_new = jnp.maximum(m_BKGT, logits_BKGTP.max(-1))
    # A block before the first unmasked key leaves m at _MASKED; the first real logit then
    # rescales what it summed by exp(_MASKED - m) = 0, so only real keys remain.
    p_BKGTP = jnp.exp(logits_BKGTP - m_new[..., None])
    rescale = jnp.exp(m_BKGT - m_new)
    l_BKGT = l_BKGT * rescale + p_BKGTP.sum(-1)
    pv_BKGTH = jnp.einsum('BKGTP,BPKH->BKGTH', p_BKGTP.astype(q_BTNH.dtype),
                          v_BPKH.astype(q_BTNH.dtype), preferred_element_type=jnp.float32)
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


class Attention(nnx.Module):
  """Self-attention of one layer: projections, optional qk norm, RoPE, cache, `attend`."""

  def __init__(self, cfg: TransformerConfig, layer: int, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.param_dtype
    self.q_proj = Einsum('BTD,DNH->BTNH', (d, n, h), axes.WEIGHT_AXES['DNH'], rngs=rngs,
                         param_dtype=pd)
    self.k_proj = Einsum('BTD,DKH->BTKH', (d, k, h), axes.WEIGHT_AXES['DKH'], rngs=rngs,
                         param_dtype=pd)
    self.v_proj = Einsum('BTD,DKH->BTKH', (d, k, h), axes.WEIGHT_AXES['DKH'], rngs=rngs,
                         param_dtype=pd)
    self.o_proj = Einsum('BTNH,NHD->BTD', (n, h, d), axes.WEIGHT_AXES['NHD'], rngs=rngs,
                         param_dtype=pd)
    if cfg.qk_norm:
      kw = dict(eps=cfg.rms_eps, plus_one=cfg.norm_plus_one, param_dtype=pd)
      self.q_norm = RMSNorm(h, axes.HEAD_DIM, **kw)
      self.k_norm = RMSNorm(h, axes.HEAD_DIM, **kw)
    else:
      self.q_norm = self.k_norm = None
    if cfg.qkv_bias:
      zeros = lambda *shape: jnp.zeros(shape, jnp.dtype(pd))
      self.q_bias = nnx.Param(zeros(n, h), out_sharding=(axes.Q_HEADS, axes.HEAD_DIM),
                              eager_sharding=False)
      self.k_bias = nnx.Param(zeros(k, h), out_sharding=(axes.KV_HEADS, axes.HEAD_DIM),
                              eager_sharding=False)
      self.v_bias = nnx.Param(zeros(k, h), out_sharding=(axes.KV_HEADS, axes.HEAD_DIM),
                              eager_sharding=False)
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    self.layer = layer
    self.head_dim = h  # the projections may be wrapped (LoRA) and so lack weight_shape
    self.window = cfg.window(layer)
    self.rope_base, self.rope_scaling = cfg.rope_for(layer)
    self.scale_q = cfg.scale_q
    self.logit_softcap = cfg.attn_logit_softcap
    self.impl = cfg.attention_impl
    self.block_size = cfg.attention_block
    # The KV cache format K/V pass through in every forward (module docstring), or None.
    self.kv_fmt: Optional[QFormat] = None

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               cache: Optional[kvcache.KVCache] = None):
    """Attention output x_BTD, and the cache with this layer's new keys/values written.

    Args:
      x_BTD: normed inputs.
      positions_BT: positions of the T inputs of each row.
      cache: None (keys are the inputs themselves) or the KV cache; the new keys/values go to
        the slots of their positions.

    Returns:
      (out_BTD, cache); cache is None when None was given.
    """
    q_BTNH = self.q_proj(x_BTD)
    k_BTKH = self.k_proj(x_BTD)
    v_BTKH = self.v_proj(x_BTD)
    if self.q_bias is not None:
      q_BTNH = q_BTNH + self.q_bias[...].astype(q_BTNH.dtype)
      k_BTKH = k_BTKH + self.k_bias[...].astype(k_BTKH.dtype)
      v_BTKH = v_BTKH + self.v_bias[...].astype(v_BTKH.dtype)
    if self.q_norm is not None:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    q_BTNH = apply_rope(q_BTNH, positions_BT, self.rope_base, self.rope_scaling) * jnp.asarray(
        self.scale_q, q_BTNH.dtype)
    k_BTKH = apply_rope(k_BTKH, positions_BT, self.rope_base, self.rope_scaling)
    out_BTNH, cache = shard_hooks.current().attention(self.core, q_BTNH, k_BTKH, v_BTKH,
                                                      positions_BT, cache)
    return self.o_proj(out_BTNH), cache

  def core(self, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache):
    """Write the new keys/values to the cache, read it back, attend: (out_BTNH, cache)."""
    k_BTKH, v_BTKH = kvcache.through_format(self.kv_fmt, k_BTKH, v_BTKH, cache)
    kw = dict(window=self.window, logit_softcap=self.logit_softcap)
    if cache is not None and not isinstance(cache, kvcache.KVCache):
      # Another cache type (a paged cache) writes and attends over its own storage.
      cache = kvcache.write(cache, self.layer, k_BTKH, v_BTKH, positions_BT)
      return cache.attend(self.layer, q_BTNH, positions_BT, **kw), cache
    if cache is None:
      k_BSKH, v_BSKH, k_pos_BS = k_BTKH, v_BTKH, positions_BT
    else:  # a ring layer may return its old slots plus the new keys (kvcache docstring)
      cache, k_BSKH, v_BSKH, k_pos_BS = kvcache.write_and_read(cache, self.layer, k_BTKH,
                                                               v_BTKH, positions_BT)
    k_BSKH, v_BSKH = k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype)
    form = self.form(q_BTNH.shape[1], q_BTNH.dtype)
    if form.name == 'blockwise':
      out_BTNH = attend_blockwise(q_BTNH, k_BSKH, v_BSKH, positions_BT, k_pos_BS,
                                  block_size=self.block_size, **kw)
    elif form.name == 'dense':
      out_BTNH = attend(q_BTNH, k_BSKH, v_BSKH, positions_BT, k_pos_BS, **kw)
    else:
      own = None  # a quantized cache rounds what it stores: attend over what it read back
      if cache is not None and cache.qformat is None:
        stored = lambda x: x.astype(cache.k[self.layer].dtype).astype(q_BTNH.dtype)
        own = (stored(k_BTKH), stored(v_BTKH))
      out_BTNH = attention_forms.fused_attend(form.name, q_BTNH, k_BSKH, v_BSKH, positions_BT,
                                              k_pos_BS, own=own, block_size=self.block_size,
                                              **kw)
    return out_BTNH, cache

  def form(self, t: int, dtype) -> attention_forms.Form:
    """The form a call of T queries runs on this platform (`attention_forms.choose_form`)."""
    return attention_forms.choose_form(self.impl, t=t, dtype=dtype,
                                       head_dim=self.head_dim,
                                       logit_softcap=self.logit_softcap)


def _attention_layers(model: nnx.Module) -> list[Attention]:
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]


def layer_forms(model: nnx.Module, t: int, dtype=None) -> list[attention_forms.Form]:
  """The form each attention layer of `model` runs for T queries on this platform, and why.

  Args:
    model: a model with `Attention` layers.
    t: T, queries per row (1: decode; > 1: prefill or a full forward).
    dtype: the queries' dtype (default: the model config's compute dtype).
  """
  dtype = dtype or model.config.compute_dtype
  return [m.form(t, dtype) for m in _attention_layers(model)]


def kv_format(model: nnx.Module) -> Optional[QFormat]:
  """The KV format every attention layer of `model` stores K/V in, or None (float)."""
  fmts = {m.kv_fmt for m in _attention_layers(model)}
  if len(fmts) > 1:
    raise ValueError(f'kv_format: the attention layers use different KV formats '
                     f'{sorted(f.name if f else "float" for f in fmts)}; one cache holds one '
                     'format, so set one with with_kv_format(model, fmt).')
  return fmts.pop() if fmts else None


def set_kv_format(model: nnx.Module, fmt: Union[None, str, QFormat],
                  what: str = 'set_kv_format: fmt') -> Optional[QFormat]:
  """Make every attention layer of `model` (in place) store K/V in `fmt`; returns the QFormat.

  Args:
    model: a model with `Attention` layers.
    fmt: None (float), a name in `kvcache.KV_FORMATS` ('int8', 'int4', 'fp8', 'fp8_e5m2') or a
      QFormat with a scale per token and kv head (as `init_cache` takes).
    what: how the caller names `fmt`, for the error message.
  """
  layers = _attention_layers(model)
  if not layers:
    raise ValueError(f'{what}: {type(model).__name__} has no Attention layer to give a KV '
                     'format; pass a Transformer.')
  fmt = kvcache.check_format(fmt, layers[0].k_proj.weight_shape[-1], what)
  for m in layers:
    m.kv_fmt = fmt
  return fmt


def with_kv_format(model: nnx.Module, fmt: Union[None, str, QFormat]) -> nnx.Module:
  """A copy of `model` whose attention stores K/V in `fmt` (see `set_kv_format`)."""
  model = nnx.clone(model)
  set_kv_format(model, fmt, 'with_kv_format: fmt')
  return model
