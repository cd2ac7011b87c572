"""The decoder-only transformer: `MLP`, `DecoderLayer`, `Transformer`.

Calling convention (one method, two uses):

* `model(tokens_BT)` / `model(tokens_BT, positions_BT=positions_BT)` -> logits_BTV: a full
  causal forward pass (training, scoring).
* `model(tokens_BT, cache=cache)` -> (logits_BTV, new_cache): prefill (T = prompt length)
  or incremental decode (T = 1, or more for speculative drafts) against a KV cache from
  `init_cache`; each row's positions continue from its own `cache.length[b]`.

`__call__` is the composition of three public phases, which callers that walk the model
(calibration, probes) use instead of restating them:

    x_BTD = model.embed_tokens(tokens_BT)                  # lookup, sqrt(D) scaling
    x_BTD, cache = model.run_layers(x_BTD, positions_BT, cache)   # model.layers in order
    logits_BTV = model.logits(x_BTD)                       # final norm, head, final softcap

Logits are float32 whatever the compute dtype.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.nn import axes
from qjax.nn import kvcache
from qjax.nn import shard_hooks
from qjax.nn import validate
from qjax.nn.attention import Attention, softcap
from qjax.nn.config import TransformerConfig
from qjax.nn.layers import Einsum, Embed, RMSNorm


def check_token_ids(tokens_BT, vocab_size: int) -> None:
  """Refuse token ids outside [0, vocab_size) (and non-integer ids) at the model's boundary.

  Only concrete ids are checked (`qjax.nn.validate.token_ids`, whose docstring states the
  contract under `jax.jit`; `validate.checked_forward` is the checked jitted variant).

  Raises:
    ValueError: a float dtype, or an id < 0 or >= V (names the first one and its index).
  """
  validate.token_ids(tokens_BT, vocab_size, 'Transformer')


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x)), act = silu (swiglu) or tanh-GELU (geglu)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
    self.gate_proj = Einsum('BTD,DF->BTF', (d, f), axes.WEIGHT_AXES['DF'], rngs=rngs,
                            param_dtype=pd)
    self.up_proj = Einsum('BTD,DF->BTF', (d, f), axes.WEIGHT_AXES['DF'], rngs=rngs,
                          param_dtype=pd)
    self.down_proj = Einsum('BTF,FD->BTD', (f, d), axes.WEIGHT_AXES['FD'], rngs=rngs,
                            param_dtype=pd)
    self.kind = cfg.mlp

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    gate_BTF = self.gate_proj(x_BTD)
    if self.kind == 'swiglu':
      gate_BTF = jax.nn.silu(gate_BTF)
    else:
      gate_BTF = jax.nn.gelu(gate_BTF, approximate=True)
    return self.down_proj(gate_BTF * self.up_proj(x_BTD))


class DecoderLayer(nnx.Module):
  """One pre-norm residual decoder layer (attention, then MLP); with `post_norms`, outputs
  are normed again before the add."""

  def __init__(self, cfg: TransformerConfig, layer: int, *, rngs: nnx.Rngs):
    kw = dict(eps=cfg.rms_eps, plus_one=cfg.norm_plus_one, param_dtype=cfg.param_dtype)
    self.pre_attn_norm = RMSNorm(cfg.d_model, axes.EMBED, **kw)
    self.attn = Attention(cfg, layer, rngs=rngs)
    self.pre_mlp_norm = RMSNorm(cfg.d_model, axes.EMBED, **kw)
    self.mlp = MLP(cfg, rngs=rngs)
    if cfg.post_norms:
      self.post_attn_norm = RMSNorm(cfg.d_model, axes.EMBED, **kw)
      self.post_mlp_norm = RMSNorm(cfg.d_model, axes.EMBED, **kw)
    else:
      self.post_attn_norm = self.post_mlp_norm = None

  def __call__(self, x_BTD, positions_BT, cache=None):
    x_BTD = shard_hooks.current().constrain(x_BTD, 'BTD')
    h_BTD, cache = self.attn(self.pre_attn_norm(x_BTD), positions_BT, cache)
    if self.post_attn_norm is not None:
      h_BTD = self.post_attn_norm(h_BTD)
    x_BTD = x_BTD + h_BTD
    h_BTD = self.mlp(self.pre_mlp_norm(x_BTD))
    if self.post_mlp_norm is not None:
      h_BTD = self.post_mlp_norm(h_BTD)
    return x_BTD + h_BTD, cache


class Transformer(nnx.Module):
  """Decoder-only transformer; see the module docstring for the calling convention.

  Submodule paths (what `QuantRule.pattern` matches): 'embed', 'layers/{i}/attn/
  {q,k,v,o}_proj', 'layers/{i}/mlp/{gate,up,down}_proj', and 'lm_head' when untied.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    pd = config.param_dtype
    self.embed = Embed(config.vocab_size, config.d_model, axes.WEIGHT_AXES['VD'], rngs=rngs,
                       param_dtype=pd)
    self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.d_model, axes.EMBED, eps=config.rms_eps,
                              plus_one=config.norm_plus_one, param_dtype=pd)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Einsum('BTD,DV->BTV', (config.d_model, config.vocab_size),
                            axes.WEIGHT_AXES['DV'], rngs=rngs, param_dtype=pd)

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    """The input of layer 0: the embedding rows of `tokens_BT` in the compute dtype.

    Args:
      tokens_BT: int token ids.

    Returns:
      x_BTD, scaled by sqrt(D) when `config.embed_scale` (Gemma).
    """
    cfg = self.config
    check_token_ids(tokens_BT, cfg.vocab_size)
    x_BTD = self.embed.lookup(tokens_BT, cfg.compute_dtype)
    if isinstance(tokens_BT, jax.core.Tracer):  # unknown ids: NaN for a bad one, not a clamp
      x_BTD = validate.poison_ids(x_BTD, tokens_BT, cfg.vocab_size)
    if cfg.embed_scale:
      x_BTD = x_BTD * jnp.asarray(cfg.d_model ** 0.5, cfg.compute_dtype)
    return x_BTD

  def run_layers(self, x_BTD: jax.Array, positions_BT: jax.Array,
             cache: Optional[kvcache.KVCache] = None):
    """Every layer of `self.layers` in order (`DecoderLayer`).

    Args:
      x_BTD: the input of layer 0 (`embed_tokens`).
      positions_BT: positions of the T inputs of each row.
      cache: None, or a KV cache each layer writes its new keys/values to, at each row's slot
        `cache.length[b]` (the caller advances it; `__call__` does).

    Returns:
      (x_BTD, cache): the last layer's output, and the cache (None when None was given).
    """
    for layer in self.layers:
      x_BTD, cache = layer(x_BTD, positions_BT, cache)
    return x_BTD, cache

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """The output phase: final norm, LM head (the embedding when tied), final softcap.

    Args:
      x_BTD: the last layer's output.

    Returns:
      logits_BTV in float32.
    """
    head = self.embed if self.lm_head is None else self.lm_head
    logits_BTV = head(self.final_norm(x_BTD), out_dtype=jnp.float32)
    return softcap(logits_BTV, self.config.final_logit_softcap)

  def __call__(self, tokens_BT: jax.Array, cache: Optional[kvcache.KVCache] = None,
               positions_BT: Optional[jax.Array] = None):
    """Logits of every position: `logits(run_layers(embed_tokens(tokens_BT), ...))`.

    Args:
      tokens_BT: int token ids.
      cache: None for a full forward pass, or a KV cache to prefill / decode against.
      positions_BT: positions for a cache-free pass (default 0..T-1 in every row); with a
        cache they are `cache.length[b] + 0..T-1` per row and passing them is an error.

    Returns:
      logits_BTV (float32) without a cache; (logits_BTV, new_cache) with one, every row's
      length advanced by T.
    """
    cfg = self.config
    b, t = tokens_BT.shape
    if cache is None:
      if t > cfg.max_len:
        raise ValueError(f'Transformer: a sequence of {t} tokens is longer than '
                         f'config.max_len={cfg.max_len}; truncate it or raise max_len.')
      if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      x_BTD, _ = self.run_layers(self.embed_tokens(tokens_BT), positions_BT)
      return self.logits(x_BTD)
    if positions_BT is not None:
      raise ValueError('Transformer: positions with a cache are cache.length[b] + 0..T-1 '
                       'per row; pass positions_BT=None.')
    if cache.batch != b or cache.num_layers != cfg.num_layers:
      raise ValueError(f'Transformer: cache has batch {cache.batch} and {cache.num_layers} '
                       f'layers, tokens have batch {b} and the model {cfg.num_layers} '
                       'layers; build it with init_cache(config, batch).')
    kvcache.check_fits(cache, t)
    # Under the caller's jit `check_fits` cannot raise, and a write past max_len would clamp
    # onto the last slots and run on with finite, wrong logits: the cache forward makes such
    # a row NaN instead, as an out-of-vocabulary id is.
    x_BTD, cache = kvcache.forward(self, tokens_BT, cache, t)
    return self.logits(x_BTD), cache
