"""A Pallas (Triton) GPU kernel for the tied head's layout: x (M, D) @ w.T with w (F, D) int8
or int4 codes, group scales along D, at decode shapes (F is the head's V).

`qjax.kernels.pallas_qmm` multiplies weights stored (D, F); the tied head stores its table
(V, D) with the contraction last ('BTD,VD->BTV'), which XLA:GPU dequantizes to a bf16 table
before its dot when the scales are grouped along D (without the subchannel dequantisation
fusion flag). Here each program computes bf output columns: it walks D in (bf, bd) blocks of
codes (bd = one group of D, or up to 512 columns per channel), widens each in registers,
multiplies it as x_blk @ w_blk.T with f32 accumulation and scales the block's partial sum by
its group's scales; the block is written once, in the caller's dtype. int4 codes arrive as
the bytes XLA stores (two a byte along D, low nibble first): the low nibbles multiply the even
columns of x and the high nibbles the odd ones, so nothing is interleaved. Activations are
padded to 16 rows (Triton's smallest dot operand) and the padding rows are masked out of the
write: the logits are (M, V), not (16, V) (at batch 8 on a compile-only H200 the padded f32
output was an 8.2 MB temporary that the sampler read twice). On CPU it runs in interpret mode.
This module imports nothing from qjax but the target and `pallas_qmm.int4_fields` (the one
int4 unpacking).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target
from qjax.kernels.pallas_qmm import int4_fields

MAX_ROWS = 64
_ROW_PAD = 16


def _block(size: int, limit: int) -> Optional[int]:
  """The largest power of two in [16, limit] dividing size, or None."""
  b = limit
  while b >= 16:
    if size % b == 0:
      return b
    b //= 2
  return None


def _kernel(*refs, bits: int, bd: int, group: int, m: int):
  """One (mp, bf) block of x @ w.T: the D loop in the program, one masked write of m rows."""
  if bits == 8:
    x_ref, w_ref, s_ref, o_ref = refs
  else:
    x_ref, xo_ref, w_ref, s_ref, o_ref = refs
  d = w_ref.shape[1] * (2 if bits == 4 else 1)
  mp, bf = x_ref.shape[0], w_ref.shape[0]
  dims = (((1,), (1,)), ((), ()))

  def step(i, acc):
    if bits == 8:
      x, w = x_ref[:, pl.ds(i * bd, bd)], w_ref[:, pl.ds(i * bd, bd)]
      part = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    else:  # low nibbles multiply the even columns of x, high nibbles the odd ones
      half = bd // 2
      xe, xo = x_ref[:, pl.ds(i * half, half)], xo_ref[:, pl.ds(i * half, half)]
      lo, hi = int4_fields(w_ref[:, pl.ds(i * half, half)])
      part = (jax.lax.dot_general(xe, lo.astype(xe.dtype), dims,
                                  preferred_element_type=jnp.float32)
              + jax.lax.dot_general(xo, hi.astype(xo.dtype), dims,
                                    preferred_element_type=jnp.float32))
    if group < d:
      part = part * s_ref[:, pl.ds(i * bd // group, 1)].reshape(1, bf)
    return acc + part

  acc = jax.lax.fori_loop(0, d // bd, step, jnp.zeros((mp, bf), jnp.float32))
  if group == d:
    acc = acc * s_ref[...].reshape(1, bf)
  y = acc.astype(o_ref.dtype)
  if mp == m:
    o_ref[...] = y
  else:  # the padding rows stay in registers: the output holds the m rows asked for
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    pl_triton.store(o_ref, y, mask=jax.lax.broadcasted_iota(jnp.int32, (mp, bf), 0) < m)


def refusal(m: int, f: int, d: int, group: int, bits: int) -> Optional[str]:
  """None where the kernel takes (M rows, F, D, group, bits), else why not."""
  if bits not in (4, 8):
    return f'{bits}-bit codes: the kernel takes int8 and int4'
  if m > MAX_ROWS:
    return f'{m} rows > {MAX_ROWS} (decode shapes only)'
  if _block(f, 128) is None:
    return f'F = {f} has no power-of-two block of 16 to 128 rows'
  bd = group if group < d else _block(d, 512)
  if bd is None or bd % (32 if bits == 4 else 16) or d % bd:
    return f'D = {d} in groups of {group} has no power-of-two block'
  return None


def qmm_nk(x_MD, w, scale_FQ, *, bits: int, interpret: Optional[bool] = None,
           platform: Optional[str] = None, out_dtype=jnp.float32):
  """`x @ dequantize(w).T` for codes w (F, D) int8, or (F, D/2) uint8 int4 bytes.

  Args:
    x_MD: activations (bf16, f16 or f32), at most MAX_ROWS rows.
    w: int8 codes (F, D), or int4 codes two a byte along D (low nibble first), (F, D/2).
    scale_FQ: scales, one per row of w and group of D/Q columns.
    bits: 8 or 4.
    interpret: run the Pallas interpreter (default: on CPU).
    platform: the platform to lower for (default: the target's backend).
    out_dtype: the result's dtype (f32 sums rounded once, in the kernel).

  Returns:
    (M, F) in `out_dtype`: the kernel writes the M rows only, not its padding to 16.
  """
  platform = platform or qjax_target.current().backend
  return _qmm_nk(x_MD, w, scale_FQ, bits=bits,
                 interpret=platform == 'cpu' if interpret is None else bool(interpret),
                 out_dtype=jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnames=('bits', 'interpret', 'out_dtype'))
def _qmm_nk(x_MD, w, scale_FQ, *, bits: int, interpret: bool, out_dtype):
  m, d = x_MD.shape
  f = w.shape[0]
  if (w.shape[1] * (2 if bits == 4 else 1)) != d:
    raise ValueError(f'gpu_qmm_head: codes {w.shape} do not contract D = {d} ({bits}-bit).')
  q = scale_FQ.shape[1]
  why = refusal(m, f, d, d // q, bits)
  if why:
    raise ValueError(f"gpu_qmm_head: {why}; use XLA's dot (qeinsum path 'native').")
  group = d // q
  bd = group if group < d else _block(d, 512)
  bf = _block(f, 128)
  mp = -(-m // _ROW_PAD) * _ROW_PAD
  x = jnp.pad(x_MD, ((0, mp - m), (0, 0))) if mp != m else x_MD
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    x = x.astype(jnp.float32)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
  cols = w.shape[1]  # code columns: D, or D/2 bytes of int4
  x_args = (x,) if bits == 8 else (x[:, 0::2], x[:, 1::2])
  x_spec = pl.BlockSpec((mp, cols), lambda j: (0, 0))
  return pl.pallas_call(
      functools.partial(_kernel, bits=bits, bd=bd, group=group, m=m), grid=(f // bf,),
      in_specs=[x_spec] * len(x_args) + [pl.BlockSpec((bf, cols), lambda j: (j, 0)),
                                         pl.BlockSpec((bf, q), lambda j: (j, 0))],
      out_specs=pl.BlockSpec((mp, bf), lambda j: (0, j)),
      out_shape=jax.ShapeDtypeStruct((m, f), out_dtype),
      interpret=interpret, compiler_params=params)(*x_args, w, scale_FQ.astype(jnp.float32))
