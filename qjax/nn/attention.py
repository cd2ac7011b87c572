"""Grouped-query attention: `attend` (pure math on arrays) and the `Attention` layer.

Query heads are grouped by the kv head they share, N = K * G, so MHA (G = 1), GQA and MQA
(K = 1) are one einsum, 'BTKGH,BSKH->BKGTS', with no repeated keys in memory.

A model may carry a KV format (`Attention.kv_fmt`, None by default; QAT sets it with
`prepare_qat(..., kv=...)`): its keys and values then pass through that format in every
forward, fake-quantized (straight-through) without a cache and quantized by a cache of that
format, so the full forward (training, perplexity) computes what cached serving computes.
`kv_format(model)` reads it, `with_kv_format(model, fmt)` sets it on a copy.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QFormat
from qjax.nn import axes
from qjax.nn import kvcache
from qjax.nn import shard_hooks
from qjax.nn.config import TransformerConfig
from qjax.nn.layers import Einsum, RMSNorm
from qjax.nn.rope import apply_rope

# Finite, so a fully masked row (never produced by the model) gives a uniform softmax, not NaN.
_MASKED = -1e30


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
    self.window = cfg.window(layer)
    self.rope_base = cfg.rope_base_for(layer)
    self.scale_q = cfg.scale_q
    self.logit_softcap = cfg.attn_logit_softcap
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
    q_BTNH = apply_rope(q_BTNH, positions_BT, self.rope_base) * jnp.asarray(
        self.scale_q, q_BTNH.dtype)
    k_BTKH = apply_rope(k_BTKH, positions_BT, self.rope_base)
    out_BTNH, cache = shard_hooks.current().attention(self.core, q_BTNH, k_BTKH, v_BTKH,
                                                      positions_BT, cache)
    return self.o_proj(out_BTNH), cache

  def core(self, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache):
    """Write the new keys/values to the cache, read it back, attend: (out_BTNH, cache)."""
    k_BTKH, v_BTKH = kvcache.through_format(self.kv_fmt, k_BTKH, v_BTKH, cache)
    if cache is None:
      k_BSKH, v_BSKH, k_pos_BS = k_BTKH, v_BTKH, positions_BT
    else:
      cache = kvcache.write(cache, self.layer, k_BTKH, v_BTKH, positions_BT)
      k_BSKH, v_BSKH, k_pos_BS = kvcache.read(cache, self.layer)
    out_BTNH = attend(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype),
                      positions_BT, k_pos_BS, window=self.window,
                      logit_softcap=self.logit_softcap)
    return out_BTNH, cache


def _attention_layers(model: nnx.Module) -> list[Attention]:
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]


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
