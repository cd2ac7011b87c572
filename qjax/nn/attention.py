"""The `Attention` layer: projections, qk norm, RoPE, the KV cache and one attention form.

The math (`attend`, `attend_blockwise`, `online_attend`, masks and softcaps) lives in
`qjax.nn.attention_core` and is re-exported here.

A model may carry a KV format (`Attention.kv_fmt`, None by default; QAT sets it with
`prepare_qat(..., kv=...)`): its keys and values then pass through that format in every
forward, fake-quantized (straight-through) without a cache and quantized by a cache of that
format, so the full forward (training, perplexity) computes what cached serving computes.
`kv_format(model)` reads it, `with_kv_format(model, fmt)` sets it on a copy.

The dense and blockwise forms are the reference and the CPU path; on GPU/TPU
`TransformerConfig.attention_impl` ('auto' by default) selects a fused kernel where one
applies, decided in `qjax.nn.attention_forms.choose_form` (`layer_forms(model, t)` lists each
layer's form and why).
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QFormat
from qjax.nn import attention_forms
from qjax.nn import axes
from qjax.nn import kvcache
from qjax.nn import shard_hooks
from qjax.nn.attention_core import EMPTY_POSITION as EMPTY_POSITION  # re-exported
from qjax.nn.attention_core import attend
from qjax.nn.attention_core import attend_reduce
from qjax.nn.attention_core import attend_blockwise
from qjax.nn.attention_core import attention_mask as attention_mask  # re-exported
from qjax.nn.attention_core import online_attend as online_attend  # re-exported
from qjax.nn.attention_core import softcap as softcap  # re-exported
from qjax.nn.config import TransformerConfig
from qjax.nn.layers import Einsum, RMSNorm
from qjax.nn.rope import apply_rope


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
    elif form.name == 'reduce':
      out_BTNH = attend_reduce(q_BTNH, k_BSKH, v_BSKH, positions_BT, k_pos_BS, **kw)
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
