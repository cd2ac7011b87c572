"""`qeinsum(path='pallas')`: a QArray weight as the operands of `qjax.kernels.pallas_qmm`.

The kernel multiplies x (M, K) by symmetric int8 codes (K, N) or packed int4 bytes (K, N/2)
(native `jnp.int4` codes are bitcast to those bytes)
with one scale row per group of K rows. A weight fits when its spec is x (M, K) @ w (K, N)
with the weight's axes (contracted..., kept...) (`tiled_path.canonical_axes`, a free reshape
of the storage), its groups are runs of the flattened contraction (o_proj's N*H included),
and its scales are per channel or per tensor along the kept axes, at any number of rows (the
kernel blocks prefill rows). `pallas_einsum` raises for anything else; `qeinsum(path='pallas')`
asks `fits` first and gives the rest (the tied head, asymmetric or fp8 weights) to the path
'auto' takes for weight-only, as 'tiled' gives what it cannot express to 'dequant'.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from qjax.core import tiled_path
from qjax.core.qarray import QArray


def _check(xs, ws, out, w: QArray):
  """The number of contracted weight axes, or a reason `w` does not fit (shapes only)."""
  a = tiled_path.canonical_axes(xs, ws, out)
  if a is None:
    return f'spec {xs},{ws}->{out} is not x (M, K) @ w (contracted..., kept...)'
  qt, tiles, shape = w.qtype, w.tile_shape, w.shape
  if qt.is_float or w.zero_point is not None or qt.bits not in (4, 8):
    return f'{w.layout_name} is not symmetric int8 / int4'
  if qt.bits == 4 and not (qt.packed or qt.native_int4):
    return f'{w.layout_name}: int4 codes go in packed (uint8) or native (int4) for this kernel'
  if qt.bits == 4 and shape[-1] % 2:
    return f'an odd last axis ({shape[-1]}) leaves a padding nibble in each row'
  p = next((i for i in range(a) if tiles[i] != 1), a)
  if any(tiles[i] != shape[i] for i in range(p + 1, a)):
    return f'{w.layout_name}: groups are not runs of the flattened contraction'
  if any(1 < t < d for t, d in zip(tiles[a:], shape[a:])):
    return f'{w.layout_name}: scales cut a kept axis into groups'
  return a


def _operands(xs, ws, out, w: QArray):
  """(a, codes (K, ·), scales (G, N)) of `w`, or a reason it does not fit."""
  a = _check(xs, ws, out, w)
  if isinstance(a, str):
    return a
  qt, shape = w.qtype, w.shape
  k, n = math.prod(shape[:a]), math.prod(shape[a:])
  sk = math.prod(w.scale.shape[:a])  # one scale row per group of the flattened contraction
  s_gn = jnp.broadcast_to(w.scale.reshape((sk,) + w.scale.shape[a:]), (sk,) + shape[a:])
  data = w.data
  if qt.native_int4:
    # Native int4 codes are the packed bytes already: XLA stores s4 two a byte along the last
    # axis, low nibble first, which is qjax's packing (`qjax.core.packing`); the bitcast moves
    # nothing.
    data = lax.bitcast_convert_type(data.reshape(shape[:-1] + (shape[-1] // 2, 2)), jnp.uint8)
  return a, data.reshape(k, -1), s_gn.reshape(sk, n)


def kernel_out_dtype(out_dtype):
  """The dtype a Triton / Pallas qmm kernel writes for `out_dtype`: itself where the kernel
  rounds its f32 sums to it once (bf16, f16, f32: no f32 (M, N) in HBM), else float32."""
  return (out_dtype if jnp.dtype(out_dtype) in (jnp.bfloat16, jnp.float16, jnp.float32)
          else jnp.float32)


def refusal(xs: str, ws: str, out: str, x_shape, w: QArray):
  """None where the kernel takes `w` under this spec (any number of rows), else why not."""
  del x_shape
  a = _check(xs, ws, out, w)
  return a if isinstance(a, str) else None


def fits(xs: str, ws: str, out: str, x: jax.Array, w: QArray) -> bool:
  """Whether the kernel takes `w` under this spec, at x's number of rows."""
  return refusal(xs, ws, out, x.shape, w) is None


def pallas_einsum(xs: str, ws: str, out: str, x: jax.Array, w: QArray, out_dtype,
                  interpret=None) -> jax.Array:
  """Weight-only `einsum(xs,ws->out)(x, dequantize(w))` on the Pallas kernel.

  Raises:
    ValueError: a weight or spec the kernel does not take.
  """
  from qjax.kernels import pallas_qmm  # pylint: disable=import-outside-toplevel
  ops = _operands(xs, ws, out, w)
  if isinstance(ops, str):
    raise ValueError(f"qeinsum(path='pallas'): {ops}; use path='native' or 'auto'.")
  a, codes, s_gn = ops
  contracted = ws[:a]
  x_only = tuple(c for c in xs if c not in contracted)
  x2 = jnp.transpose(x, [xs.index(c) for c in x_only + tuple(contracted)])
  m_shape = tuple(x.shape[xs.index(c)] for c in x_only)
  k = codes.shape[0]
  x2 = x2.reshape(math.prod(m_shape), k)
  if x2.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    x2 = x2.astype(jnp.float32)
  y2 = pallas_qmm.qmm(x2, codes, s_gn, bits=w.qtype.bits, interpret=interpret,
                      out_dtype=kernel_out_dtype(out_dtype))
  y = y2.reshape(m_shape + tuple(w.shape[a:]))
  letters = ''.join(x_only) + ws[a:]
  return jnp.transpose(y, [letters.index(c) for c in out]).astype(out_dtype)
