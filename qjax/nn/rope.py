"""Rotary position embedding (RoPE), split-halves convention (Llama / Gemma / HF).

Feature i < H/2 pairs with feature i + H/2 and the pair rotates by angle
`pos * inv_freq[i]`, with `inv_freq[i] = base**(-2i/H)` for plain RoPE. Rotations preserve
norms, and `rope(q, m) . rope(k, n)` depends on positions only through `m - n`.

Long-context checkpoints rescale the frequencies (`RopeScaling`): 'linear' divides every
frequency by `factor` (position interpolation); 'llama3' (Llama 3.1+) divides only the low
frequencies, leaves the high ones and blends in between; 'yarn' (Qwen 2.5, ...) blends
interpolated and original frequencies over a ramp of dimensions and multiplies cos/sin by an
attention factor. The frequencies are computed once per layer, in numpy float32 as HF
transformers does, so they are compile-time constants.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

SCALING_KINDS = ('linear', 'llama3', 'yarn')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How a checkpoint rescales RoPE frequencies (HF config.json's `rope_parameters`).

  Attributes:
    kind: 'linear', 'llama3' or 'yarn'.
    factor: context extension factor (> 0).
    original_max_len: context length of pre-training ('llama3', 'yarn').
    low_freq_factor, high_freq_factor: 'llama3' band edges (wavelengths original_max_len /
      low_freq_factor and original_max_len / high_freq_factor).
    beta_fast, beta_slow: 'yarn' ramp ends, in rotations over original_max_len.
    truncate: 'yarn' rounds the ramp ends to whole dimensions.
    attention_factor: multiplier of cos and sin ('yarn'; 1 otherwise).
  """

  kind: str
  factor: float = 1.0
  original_max_len: Optional[int] = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 1.0

  def __post_init__(self):
    if self.kind not in SCALING_KINDS:
      raise ValueError(f'RopeScaling: kind={self.kind!r} is unknown; use one of '
                       f'{SCALING_KINDS}.')
    if not self.factor > 0 or not self.attention_factor > 0:
      raise ValueError(f'RopeScaling: factor={self.factor} and attention_factor='
                       f'{self.attention_factor} must be > 0.')
    if self.kind in ('llama3', 'yarn') and not (self.original_max_len or 0) > 0:
      raise ValueError(f'RopeScaling: kind={self.kind!r} needs original_max_len (the '
                       'pre-training context, original_max_position_embeddings).')
    if self.kind == 'llama3' and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f'RopeScaling: high_freq_factor={self.high_freq_factor} must exceed '
                       f'low_freq_factor={self.low_freq_factor}.')


def inv_frequencies(head_dim: int, base: float,
                    scaling: Optional[RopeScaling] = None) -> np.ndarray:
  """RoPE inverse frequencies, float32 (H/2,), with `scaling` applied (HF's formulas)."""
  exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
  if scaling is None:
    return inv
  s = scaling
  if s.kind == 'linear':
    return (inv / np.float32(s.factor)).astype(np.float32)
  if s.kind == 'llama3':
    low_wavelen = s.original_max_len / s.low_freq_factor
    high_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)
  # yarn: dimensions rotating fewer than beta_slow times over the original context are
  # interpolated, more than beta_fast times kept, a linear ramp in between.
  def correction_dim(rotations):
    return (head_dim * math.log(s.original_max_len / (rotations * 2 * math.pi))) / (
        2 * math.log(base))
  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)
  pos_freqs = np.float32(base) ** exponent
  return ((1 / (s.factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep).astype(np.float32)


def yarn_attention_factor(factor: float, mscale: Optional[float] = None,
                          mscale_all_dim: Optional[float] = None) -> float:
  """YaRN's cos/sin multiplier `0.1 * m * ln(factor) + 1` (ratio of two with both m's set)."""
  def get(m=1.0):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
  if mscale and mscale_all_dim:
    return float(get(mscale) / get(mscale_all_dim))
  return get()


def rope_angles(positions_BT: jax.Array, head_dim: int, base: float,
                scaling: Optional[RopeScaling] = None) -> jax.Array:
  """Rotation angles, float32, shape positions + (H/2,)."""
  if scaling is None:
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  else:
    inv_freq = jnp.asarray(inv_frequencies(head_dim, base, scaling))
  return positions_BT.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, base: float,
               scaling: Optional[RopeScaling] = None) -> jax.Array:
  """Rotate `x_BTNH` (any number of head axes between T and H) by its positions.

  Args:
    x_BTNH: queries or keys, shape (B, T, ..., H) with H even.
    positions_BT: integer positions, shape (B, T).
    base: RoPE base (e.g. 1e4 local, 1e6 global for Gemma 3).
    scaling: the checkpoint's frequency rescaling, or None (plain RoPE).

  Returns:
    The rotated tensor, x's shape and dtype (the rotation runs in float32).
  """
  h = x_BTNH.shape[-1]
  if h % 2:
    raise ValueError(f'apply_rope: head dim {h} must be even; RoPE rotates feature pairs.')
  angles = rope_angles(positions_BT, h, base, scaling)
  angles = angles.reshape(angles.shape[:2] + (1,) * (x_BTNH.ndim - 3) + angles.shape[-1:])
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if scaling is not None and scaling.attention_factor != 1.0:
    sin, cos = sin * scaling.attention_factor, cos * scaling.attention_factor
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)
