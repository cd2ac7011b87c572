"""Rotary position embedding (RoPE), split-halves convention (Llama / Gemma / HF).

Feature i < H/2 pairs with feature i + H/2 and the pair rotates by angle
`pos * base**(-2i/H)`. Rotations preserve norms, and `rope(q, m) . rope(k, n)` depends on
positions only through `m - n`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions_BT: jax.Array, head_dim: int, base: float) -> jax.Array:
  """Rotation angles, float32, shape positions + (H/2,)."""
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  return positions_BT.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, base: float) -> jax.Array:
  """Rotate `x_BTNH` (any number of head axes between T and H) by its positions.

  Args:
    x_BTNH: queries or keys, shape (B, T, ..., H) with H even.
    positions_BT: integer positions, shape (B, T).
    base: RoPE base (e.g. 1e4 local, 1e6 global for Gemma 3).

  Returns:
    The rotated tensor, x's shape and dtype (the rotation runs in float32).
  """
  h = x_BTNH.shape[-1]
  if h % 2:
    raise ValueError(f'apply_rope: head dim {h} must be even; RoPE rotates feature pairs.')
  angles = rope_angles(positions_BT, h, base)
  angles = angles.reshape(angles.shape[:2] + (1,) * (x_BTNH.ndim - 3) + angles.shape[-1:])
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)
