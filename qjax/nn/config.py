"""`TransformerConfig`: one frozen dataclass that spans Llama, Qwen2, Mistral and Gemma 3.

Layer kinds. A layer is *local* (sliding-window attention, RoPE base `local_rope_base`) or
*global* (full causal attention, RoPE base `rope_base`):

* `sliding_window=None`: every layer is global.
* `sliding_window=W, global_every=k`: layers k-1, 2k-1, ... (every k-th, 1-indexed) are
  global, the rest local (Gemma 3: W=512, k=6).
* `sliding_window=W, global_every=None`: every layer is local (Mistral 7B v0.1).

A local layer attends to keys at positions p with `q_pos - W < p <= q_pos`.

RoPE (`rope_for`): a local layer with `local_rope_base` set rotates by plain RoPE at that
base; every other layer by `rope_base` with `rope_scaling` (Gemma 3 scales only its global
layers; Llama 3.x, whose layers are all global, scales every layer).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from qjax.nn.rope import RopeScaling

MLP_KINDS = ('swiglu', 'geglu')
ATTENTION_IMPLS = ('dense', 'blockwise')
_DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture of a decoder-only transformer.

  Attributes:
    vocab_size: V.
    d_model: D.
    num_layers: number of blocks.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (K = N: MHA; 1 < K < N: GQA; K = 1: MQA); N % K == 0.
    head_dim: H (even, for RoPE).
    d_ff: F, hidden width of the gated MLP.
    max_len: longest sequence the model accepts (forward pass and KV cache).
    mlp: 'swiglu' (silu gate) or 'geglu' (tanh-approximate GELU gate).
    tie_embeddings: the LM head reuses the embedding table ('BTD,VD->BTV').
    embed_scale: multiply embeddings by sqrt(D) (Gemma).
    qk_norm: RMSNorm over H on queries and keys before RoPE (Gemma 3, Qwen3).
    rope_base: RoPE base of global layers.
    local_rope_base: RoPE base of local layers (None: `rope_base`).
    rope_scaling: frequency rescaling of the layers that use `rope_base` (`RopeScaling`; a
      dict of its fields is accepted, as a JSON round trip gives), or None.
    sliding_window: window of local layers (see the module docstring), or None.
    global_every: every k-th layer is global when a window is set (module docstring).
    post_norms: extra RMSNorm on the attention and MLP outputs before the residual add.
    rms_eps: RMSNorm epsilon.
    norm_plus_one: RMSNorm computes x * (1 + w) with w initialised to 0 (Gemma), not x * w.
    final_logit_softcap: c in `c * tanh(logits / c)` on the output logits, or None.
    attn_logit_softcap: the same on attention logits, or None.
    query_scale: multiplier of queries (None: 1 / sqrt(H)).
    dtype: compute dtype name; softmax and norms run in float32 regardless.
    param_dtype: parameter dtype name.
    qkv_bias: learned biases on the q/k/v projections (Qwen2), added before qk norm and RoPE.
    attention_impl: 'dense' (materialise the T x S logits) or 'blockwise' (exact online
      softmax over key blocks of `attention_block` keys: temp memory O(T), not O(T * S));
      used by cache-free forwards (perplexity) and by prefill against a contiguous cache.
    attention_block: keys per block of the blockwise path.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  max_len: int = 2048
  mlp: str = 'swiglu'
  tie_embeddings: bool = True
  embed_scale: bool = False
  qk_norm: bool = False
  rope_base: float = 10_000.0
  local_rope_base: Optional[float] = None
  rope_scaling: Optional[RopeScaling] = None
  sliding_window: Optional[int] = None
  global_every: Optional[int] = None
  post_norms: bool = False
  rms_eps: float = 1e-6
  norm_plus_one: bool = False
  final_logit_softcap: Optional[float] = None
  attn_logit_softcap: Optional[float] = None
  query_scale: Optional[float] = None
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  qkv_bias: bool = False
  attention_impl: str = 'dense'
  attention_block: int = 512

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):  # asdict / JSON gives the fields as a dict
      object.__setattr__(self, 'rope_scaling', RopeScaling(**self.rope_scaling))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f'TransformerConfig: rope_scaling={self.rope_scaling!r} must be a '
                       'qjax.nn.rope.RopeScaling (or a dict of its fields) or None.')
    for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads',
                 'head_dim', 'd_ff', 'max_len'):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f'TransformerConfig: {name}={v!r} must be a positive integer.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'TransformerConfig: num_heads={self.num_heads} is not a multiple of '
          f'num_kv_heads={self.num_kv_heads}; each kv head serves a whole group of query '
          f'heads. Use num_kv_heads in {_divisors(self.num_heads)}.')
    if self.head_dim % 2:
      raise ValueError(f'TransformerConfig: head_dim={self.head_dim} must be even (RoPE '
                       'rotates pairs of features).')
    if self.mlp not in MLP_KINDS:
      raise ValueError(f'TransformerConfig: mlp={self.mlp!r} is unknown; use one of '
                       f'{MLP_KINDS}.')
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f'TransformerConfig: attention_impl={self.attention_impl!r} is unknown; '
                       f'use one of {ATTENTION_IMPLS}.')
    if not isinstance(self.attention_block, int) or self.attention_block < 1:
      raise ValueError(f'TransformerConfig: attention_block={self.attention_block!r} must be a '
                       'positive integer (keys per block of blockwise attention).')
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f'TransformerConfig: {name}={getattr(self, name)!r} is not a float '
                         f'dtype name; use one of {_DTYPES}.')
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f'TransformerConfig: sliding_window={self.sliding_window} must be >= 1 '
                       'or None (full attention).')
    if self.global_every is not None:
      if self.global_every < 1:
        raise ValueError(f'TransformerConfig: global_every={self.global_every} must be >= 1 '
                         '(every k-th layer is global) or None.')
      if self.sliding_window is None:
        raise ValueError(f'TransformerConfig: global_every={self.global_every} needs '
                         'sliding_window (the window of the other, local layers); set '
                         'sliding_window or drop global_every.')
    for name in ('rope_base', 'rms_eps'):
      if not getattr(self, name) > 0:
        raise ValueError(f'TransformerConfig: {name}={getattr(self, name)} must be > 0.')
    for name in ('local_rope_base', 'final_logit_softcap', 'attn_logit_softcap',
                 'query_scale'):
      v = getattr(self, name)
      if v is not None and not v > 0:
        raise ValueError(f'TransformerConfig: {name}={v} must be > 0 or None.')

  # ---- derived facts -------------------------------------------------------------------
  @property
  def group_size(self) -> int:
    """G, query heads per kv head."""
    return self.num_heads // self.num_kv_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def scale_q(self) -> float:
    return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

  def is_local(self, layer: int) -> bool:
    """Whether `layer` (0-indexed) uses sliding-window attention."""
    if self.sliding_window is None:
      return False
    return self.global_every is None or (layer + 1) % self.global_every != 0

  def window(self, layer: int) -> Optional[int]:
    return self.sliding_window if self.is_local(layer) else None

  def rope_base_for(self, layer: int) -> float:
    return self.rope_for(layer)[0]

  def rope_for(self, layer: int) -> tuple[float, Optional[RopeScaling]]:
    """(RoPE base, frequency scaling or None) of `layer` (module docstring)."""
    if self.is_local(layer) and self.local_rope_base is not None:
      return self.local_rope_base, None
    return self.rope_base, self.rope_scaling

  def replace(self, **kw) -> 'TransformerConfig':
    return dataclasses.replace(self, **kw)

  # ---- presets -------------------------------------------------------------------------
  @classmethod
  def tiny(cls, **overrides) -> 'TransformerConfig':
    """A model small enough for unit tests (about 0.1M parameters); GQA with N=4, K=2."""
    base = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=32, d_ff=128, max_len=64)
    return cls(**{**base, **overrides})

  @classmethod
  def gemma3_270m(cls, **overrides) -> 'TransformerConfig':
    """Gemma 3 270M (268,098,176 parameters)."""
    base = dict(vocab_size=262_144, d_model=640, num_layers=18, num_heads=4, num_kv_heads=1,
                head_dim=256, d_ff=2048, max_len=32_768, mlp='geglu', tie_embeddings=True,
                embed_scale=True, qk_norm=True, post_norms=True, norm_plus_one=True,
                sliding_window=512, global_every=6, rope_base=1_000_000.0,
                local_rope_base=10_000.0, query_scale=256 ** -0.5)
    return cls(**{**base, **overrides})

  @classmethod
  def llama_like(cls, **overrides) -> 'TransformerConfig':
    """A Llama / Qwen2 / Mistral-style model: swiglu, untied head, no qk norm, GQA 32/8."""
    base = dict(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                head_dim=64, d_ff=8192, max_len=8192, mlp='swiglu', tie_embeddings=False,
                rope_base=500_000.0, rms_eps=1e-5)
    return cls(**{**base, **overrides})


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def num_params(cfg: TransformerConfig) -> int:
  """Analytic parameter count (no model built); matches `param_count` of a float model."""
  d, h = cfg.d_model, cfg.head_dim
  attn = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  norms = d * (4 if cfg.post_norms else 2) + (2 * h if cfg.qk_norm else 0)
  bias = h * (cfg.num_heads + 2 * cfg.num_kv_heads) if cfg.qkv_bias else 0
  layer = attn + 3 * d * cfg.d_ff + norms + bias
  head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
  return cfg.vocab_size * d + cfg.num_layers * layer + d + head
