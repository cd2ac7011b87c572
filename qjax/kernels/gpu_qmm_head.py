"""A Pallas (Triton) GPU kernel for the tied head's layout: x (M, K) @ w.T with w (N, K) int8
or int4 codes, group scales along K, at decode shapes.

`qjax.kernels.pallas_qmm` multiplies weights stored (K, N); the tied head stores its table
(V, D) with the contraction last ('BTD,VD->BTV'), which XLA:GPU dequantizes to a bf16 table
before its dot when the scales are grouped along D (without the subchannel dequantisation
fusion flag). Here each grid step loads a (bn, bk) block of codes (bk = one group of K, or up
to 512 columns per channel), widens it in registers, multiplies it as x_blk @ w_blk.T with f32
accumulation and scales the block's partial sum by its group's scales. int4 codes arrive as
the bytes XLA stores (two a byte along K, low nibble first): the low nibbles multiply the even
columns of x and the high nibbles the odd ones, so nothing is interleaved. Activations are
padded to 16 rows (Triton's smallest dot operand). On CPU it runs in interpret mode.
This module imports nothing from qjax but the target.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target

MAX_ROWS = 64
_ROW_PAD = 16


def _block(n: int, limit: int) -> Optional[int]:
  """The largest power of two in [16, limit] dividing n, or None."""
  b = limit
  while b >= 16:
    if n % b == 0:
      return b
    b //= 2
  return None


def _fields(b):
  b = b.astype(jnp.int32)
  lo, hi = b & 15, (b >> 4) & 15
  return lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)


def _kernel8(x_ref, w_ref, s_ref, o_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  x = x_ref[...]
  w = w_ref[...].astype(x.dtype)
  part = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  o_ref[...] += part * s_ref[...].reshape(1, -1)


def _kernel4(xe_ref, xo_ref, w_ref, s_ref, o_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  xe, xo = xe_ref[...], xo_ref[...]
  lo, hi = _fields(w_ref[...])
  dims = (((1,), (1,)), ((), ()))
  part = (jax.lax.dot_general(xe, lo.astype(xe.dtype), dims, preferred_element_type=jnp.float32)
          + jax.lax.dot_general(xo, hi.astype(xo.dtype), dims,
                                preferred_element_type=jnp.float32))
  o_ref[...] += part * s_ref[...].reshape(1, -1)


def refusal(m: int, n: int, k: int, group: int, bits: int) -> Optional[str]:
  """None where the kernel takes (M rows, N, K, group, bits), else why not."""
  if bits not in (4, 8):
    return f'{bits}-bit codes: the kernel takes int8 and int4'
  if m > MAX_ROWS:
    return f'{m} rows > {MAX_ROWS} (decode shapes only)'
  if _block(n, 128) is None:
    return f'N = {n} has no power-of-two block of 16 to 128 rows'
  bk = group if group < k else _block(k, 512)
  if bk is None or bk % (32 if bits == 4 else 16) or k % bk:
    return f'K = {k} in groups of {group} has no power-of-two block'
  return None


def qmm_nk(x_MK, w, scale_NG, *, bits: int, interpret: Optional[bool] = None,
           platform: Optional[str] = None):
  """`x @ dequantize(w).T` for codes w (N, K) int8, or (N, K/2) uint8 int4 bytes; f32 result.

  Args:
    x_MK: activations (bf16, f16 or f32), at most MAX_ROWS rows.
    w: int8 codes (N, K), or int4 codes two a byte along K (low nibble first), (N, K/2).
    scale_NG: scales, one per row of w and group of K/G columns.
    bits: 8 or 4.
    interpret: run the Pallas interpreter (default: on CPU).
    platform: the platform to lower for (default: the target's backend).

  Returns:
    (M, N) float32.
  """
  platform = platform or qjax_target.current().backend
  return _qmm_nk(x_MK, w, scale_NG, bits=bits,
                 interpret=platform == 'cpu' if interpret is None else bool(interpret))


@functools.partial(jax.jit, static_argnames=('bits', 'interpret'))
def _qmm_nk(x_MK, w, scale_NG, *, bits: int, interpret: bool):
  m, k = x_MK.shape
  n = w.shape[0]
  if (w.shape[1] * (2 if bits == 4 else 1)) != k:
    raise ValueError(f'gpu_qmm_head: codes {w.shape} do not contract K = {k} ({bits}-bit).')
  g = scale_NG.shape[1]
  why = refusal(m, n, k, k // g, bits)
  if why:
    raise ValueError(f"gpu_qmm_head: {why}; use XLA's dot (qeinsum path 'native').")
  group = k // g
  bk = group if group < k else _block(k, 512)
  bn = _block(n, 128)
  mp = -(-m // _ROW_PAD) * _ROW_PAD
  x = jnp.pad(x_MK, ((0, mp - m), (0, 0))) if mp != m else x_MK
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    x = x.astype(jnp.float32)
  s = scale_NG.astype(jnp.float32)
  grid = (n // bn, k // bk)
  s_spec = pl.BlockSpec((bn, 1), lambda j, i: (j, i * bk // group))
  o_spec = pl.BlockSpec((mp, bn), lambda j, i: (0, j))
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
  call = functools.partial(pl.pallas_call, grid=grid, interpret=interpret,
                           compiler_params=params,
                           out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32))
  if bits == 8:
    y = call(_kernel8, in_specs=[pl.BlockSpec((mp, bk), lambda j, i: (0, i)),
                                 pl.BlockSpec((bn, bk), lambda j, i: (j, i)), s_spec],
             out_specs=o_spec)(x, w, s)
  else:
    half = bk // 2
    x_spec = pl.BlockSpec((mp, half), lambda j, i: (0, i))
    y = call(_kernel4, in_specs=[x_spec, x_spec, pl.BlockSpec((bn, half), lambda j, i: (j, i)),
                                 s_spec],
             out_specs=o_spec)(x[:, 0::2], x[:, 1::2], w, s)
  return y[:m]
