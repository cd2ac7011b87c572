"""Paged KV pools for the kernel tests: a pool stored as a kind (float, bf16, int8, int4, fp8)
with per-token scales, beside the float64 values it stands for."""

import jax.numpy as jnp
import numpy as np


def pool_and_reference(kind, rng, num_pages, p, kh, h):
  """A pool stored as `kind` and the float64 values it stands for: (data, scales, values)."""
  if kind == 'float':
    x = rng.standard_normal((num_pages, p, kh, h)).astype(np.float32)
    return jnp.asarray(x), None, x.astype(np.float64)
  if kind == 'bf16':
    x = jnp.asarray(rng.standard_normal((num_pages, p, kh, h)), jnp.bfloat16)
    return x, None, np.asarray(x.astype(jnp.float32), np.float64)
  scale = rng.uniform(0.01, 0.1, (num_pages, p, kh, 1)).astype(np.float32)
  if kind == 'int8':
    codes = rng.integers(-127, 128, (num_pages, p, kh, h)).astype(np.int8)
    return jnp.asarray(codes), jnp.asarray(scale), codes.astype(np.float64) * scale
  if kind == 'int4':
    codes = rng.integers(-8, 8, (num_pages, p, kh, h))
    packed = ((codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)).astype(np.uint8)
    return jnp.asarray(packed), jnp.asarray(scale), codes.astype(np.float64) * scale
  codes = jnp.asarray(rng.standard_normal((num_pages, p, kh, h)) * 4, jnp.float8_e4m3fn)
  return codes, jnp.asarray(scale), np.asarray(codes.astype(jnp.float32), np.float64) * scale
