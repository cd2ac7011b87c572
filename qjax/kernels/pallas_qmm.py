"""A Pallas kernel for weight-only int8 / int4 matmuls at decode shapes (M = 1..64 rows).

`y_MN = x_MK @ dequantize(w_KN)` with the dequantize inside the kernel: each grid step loads
a (bk, bn) block of codes (int8, or two 4-bit codes per uint8 byte in qjax's packing: the low
nibble is column 2i, the high nibble column 2i+1), widens it in registers to the activation
dtype, multiplies it with the matching (M, bk) activation block with f32 accumulation, and
applies that block's scales. No float copy of the weight exists anywhere. Groups: a block of
rows is one group (bk = group size), so its scales are one row of `scale_GN`; per-channel
weights are one group of K rows.

Packed int4 is multiplied as two half-width products, even and odd columns, each with its
own scales, and the two (M, N/2) results are interleaved after the kernel (the output is
small at decode shapes, the weight is not): the codes are never interleaved.

Backends: Triton (GPU) and Mosaic (TPU) lower the same kernel; on CPU it runs with
`interpret=True` (the tests' reference check). Activations are padded to a multiple of 16
rows, the smallest operand Triton's `tl.dot` takes. Block shapes: bn a power of two up to 256
dividing N, bk the group size (or up to 512 rows for per-channel scales). TPU wants multiples
of 128 in a block's last two dims: groups of 32 or 64 rows do not lower there. Not a default
path until measured on a device (docs/quantized_matmul.md).
From qjax it imports only `qjax.target` (the platform it lowers for), like the rest of
`qjax.kernels`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target

MAX_ROWS = 64   # decode shapes; more rows are a prefill, which XLA's own dot serves
_ROW_PAD = 16   # Triton's smallest dot operand


def _block(n: int, limit: int) -> int:
  """The largest power of two <= limit dividing n (n itself when none does)."""
  b = limit
  while b >= 8:
    if n % b == 0:
      return b
    b //= 2
  return n


def _int4_fields(b):
  """Signed low and high nibbles of uint8 bytes, as int32."""
  b = b.astype(jnp.int32)
  lo, hi = b & 15, (b >> 4) & 15
  return lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)


# Scale blocks are (1, 1, bn) of a (G, 1, N) array: a block's last two dims must be whole or
# multiples of (8, 128) on TPU, and one scale row of (G, N) would be neither.
def _kernel_int8(x_ref, w_ref, s_ref, o_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  x = x_ref[...]
  w = w_ref[...].astype(x.dtype)
  o_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32) * s_ref[0]


def _kernel_int4(x_ref, w_ref, se_ref, so_ref, oe_ref, oo_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    oe_ref[...] = jnp.zeros_like(oe_ref)
    oo_ref[...] = jnp.zeros_like(oo_ref)

  x = x_ref[...]
  lo, hi = _int4_fields(w_ref[...])
  oe_ref[...] += jnp.dot(x, lo.astype(x.dtype), preferred_element_type=jnp.float32) * se_ref[0]
  oo_ref[...] += jnp.dot(x, hi.astype(x.dtype), preferred_element_type=jnp.float32) * so_ref[0]


def _compiler_params(platform: str):
  """Triton on NVIDIA/AMD GPUs, Mosaic on TPU (K, the grid's last axis, accumulates)."""
  if platform in ('gpu', 'cuda', 'rocm'):
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    return pl_triton.CompilerParams(num_warps=4, num_stages=2)
  if platform == 'tpu':
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
    return pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary'))
  return None


def check_operands(x_MK, w, scale_GN, bits: int) -> tuple[int, int, int, int]:
  """(M, K, N, group rows) of the operands; raises naming the bad shape or dtype."""
  if x_MK.ndim != 2 or w.ndim != 2 or scale_GN.ndim != 2:
    raise ValueError(f'pallas_qmm: expected x (M, K), codes (K, N or N/2) and scales (G, N), '
                     f'got {x_MK.shape}, {w.shape}, {scale_GN.shape}.')
  m, k = x_MK.shape
  if bits == 8:
    if w.dtype != jnp.int8:
      raise ValueError(f'pallas_qmm: int8 codes must be int8, got {w.dtype}.')
    n = w.shape[1]
  elif bits == 4:
    if w.dtype != jnp.uint8:
      raise ValueError(f'pallas_qmm: int4 codes must be packed two per uint8 byte along N, got '
                       f'{w.dtype}; pass the packed layout (QArray.data of a packed QArray).')
    n = 2 * w.shape[1]
  else:
    raise ValueError(f'pallas_qmm: bits={bits} has no kernel; use 8 or 4.')
  if w.shape[0] != k:
    raise ValueError(f'pallas_qmm: x has K={k} columns but the codes have {w.shape[0]} rows.')
  if not (m and k and n):
    raise ValueError(f'pallas_qmm: an empty operand (M={m}, K={k}, N={n}: x {x_MK.shape}, '
                     f'codes {w.shape}); every dimension must be at least 1 (an empty product '
                     'needs no kernel: skip the call).')
  g = scale_GN.shape[0]
  if not g or scale_GN.shape[1] != n or k % g:
    raise ValueError(f'pallas_qmm: scales {scale_GN.shape} must be (G, N={n}) with G >= 1 '
                     f'dividing K={k}.')
  if m > MAX_ROWS:
    raise ValueError(f'pallas_qmm: {m} rows is not a decode shape (at most {MAX_ROWS}); use '
                     "XLA's dot (path='native' or 'dequant') for prefill.")
  return m, k, n, k // g


def qmm(x_MK, w, scale_GN, *, bits: int, interpret: Optional[bool] = None,
        block_n: int = 256, platform: Optional[str] = None):
  """`x @ dequantize(codes, scales)` for symmetric int8 / packed int4 codes, f32 result.

  Args:
    x_MK: activations (bf16, f16 or f32), M <= 64 rows.
    w: codes (K, N) int8 for bits=8; (K, N/2) uint8 bytes for bits=4 (qjax's packing).
    scale_GN: f32-castable scales, one row per group of K/G consecutive rows.
    bits: 8 or 4.
    interpret: run the Pallas interpreter (default: on CPU, where nothing else lowers).
    block_n: the widest block of output columns.
    platform: the platform to lower for: 'cpu', 'gpu' (or 'cuda', 'rocm') or 'tpu' (default:
      the target's, `qjax.target`); 'cuda' or 'tpu' lets `jax.export` check the lowering on a
      machine without that device.

  Returns:
    (M, N) float32.
  """
  # Resolved before the jit, so its cache keys on the platform the kernel is built for.
  platform = platform or qjax_target.current().backend
  return _qmm(x_MK, w, scale_GN, bits=bits, interpret=interpret, block_n=block_n,
              platform=platform)


@functools.partial(jax.jit, static_argnames=('bits', 'interpret', 'block_n', 'platform'))
def _qmm(x_MK, w, scale_GN, *, bits: int, interpret: Optional[bool], block_n: int,
         platform: str):
  """`qmm` for a resolved platform."""
  m, k, n, gk = check_operands(x_MK, w, scale_GN, bits)
  if interpret is None:
    interpret = platform == 'cpu'
  params = None if interpret else _compiler_params(platform)
  mp = -(-m // _ROW_PAD) * _ROW_PAD
  x = jnp.pad(x_MK, ((0, mp - m), (0, 0))) if mp != m else x_MK
  cols = n if bits == 8 else n // 2
  bn = _block(cols, block_n if bits == 8 else block_n // 2)
  # One group per block of rows; one scale row for all of K is applied per block of 512 rows
  # (a sum of scaled partial products: the same numbers up to summation order).
  bk = gk if gk < k else _block(k, 512)
  grid = (cols // bn, k // bk)
  x_spec = pl.BlockSpec((mp, bk), lambda j, i: (0, i))
  w_spec = pl.BlockSpec((bk, bn), lambda j, i: (i, j))
  s_spec = pl.BlockSpec((1, 1, bn), lambda j, i: (i * bk // gk, 0, j))
  o_spec = pl.BlockSpec((mp, bn), lambda j, g: (0, j))
  s = scale_GN.astype(jnp.float32)[:, None, :]
  call = functools.partial(pl.pallas_call, grid=grid, interpret=interpret,
                           compiler_params=params)
  if bits == 8:
    y = call(_kernel_int8, in_specs=[x_spec, w_spec, s_spec], out_specs=o_spec,
             out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32))(x, w, s)
    return y[:m]
  ye, yo = call(_kernel_int4, in_specs=[x_spec, w_spec, s_spec, s_spec],
                out_specs=[o_spec, o_spec],
                out_shape=[jax.ShapeDtypeStruct((mp, cols), jnp.float32)] * 2)(
                    x, w, s[..., 0::2], s[..., 1::2])
  return jnp.stack([ye[:m], yo[:m]], axis=-1).reshape(m, n)
