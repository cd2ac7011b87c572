"""A Pallas kernel for weight-only int8 / int4 matmuls: codes in, any number of rows.

`y_MN = x_MK @ dequantize(w_KN)` with the dequantize inside the kernel. Each program computes
one (bm, bn) output block: it walks K in blocks of bk rows, loads a (bk, bn) block of codes
(int8, or two 4-bit codes per uint8 byte in qjax's packing: the low nibble is column 2i, the
high nibble column 2i+1), widens it in registers to the activation dtype, multiplies it with
the (bm, bk) activation block with f32 accumulation and scales that block's partial sum by its
group's scale row; per-channel scales are applied once after the last block. The output is
written once, in the caller's dtype. No float copy of the weight exists anywhere. A block of
K never spans two groups (bk divides the group size), so any group of 16 rows or more works.

int4 bytes are split into their two nibbles and interleaved back into one (bk, bn) block of
codes in registers (Triton's join and reshape, as Pallas's own int4 loads do), so one dot per
block covers both halves: neither the scales nor the output are split into even and odd
columns.

Rows: at decode (M <= 64) one block of all rows, rounded up to 16 (the smallest operand
Triton's `tl.dot` takes) by masked loads and a masked write, so neither x nor y is padded in
HBM; at prefill blocks of `PREFILL_ROWS` rows, so each code tile is read once per
such block (four times for 512 rows; the grid walks the row blocks of one column block
together, so the re-reads can come from L2). Block shapes are powers of two dividing the axes:
bn up to 256 output columns (128 at prefill), bk up to 128 contraction rows.

Backends: Triton on GPU; on CPU the same kernel runs with `interpret=True` (the tests' float64
reference check). For a TPU the kernel of the same name keeps K on the grid (Mosaic's blocks,
the (8, 128) rule: groups of 32 or 64 rows do not lower there); qjax's TPU path is
`qjax.kernels.tpu_qmm`. Its speed on a device is unmeasured (docs/quantized_matmul.md has the
compiler's predictions). From qjax it imports only `qjax.target` (the platform it lowers
for), like the rest of `qjax.kernels`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target

MAX_ROWS = 64        # decode shapes: one block of all rows
PREFILL_ROWS = 128   # rows per block beyond MAX_ROWS: each code tile is read once per block
_ROW_PAD = 16        # Triton's smallest dot operand
_BK = 128            # contraction rows per block (at most)


def _block(n: int, limit: int) -> int:
  """The largest power of two <= limit dividing n (n itself when none does)."""
  b = limit
  while b >= 8:
    if n % b == 0:
      return b
    b //= 2
  return n


def int4_fields(b):
  """Signed low and high nibbles of uint8 bytes, as int32."""
  b = b.astype(jnp.int32)
  lo, hi = b & 15, (b >> 4) & 15
  return lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, bits: int, bk: int, group: int, m: int):
  """One (bm, bn) output block: the K loop in the program, f32 accumulation, one write. Rows
  past the m real ones are masked out of the loads and the write (x and y are never padded
  in HBM)."""
  k = x_ref.shape[1]
  bm, bn = o_ref.shape
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
  row = pl.program_id(1) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

  def step(i, acc):
    x_blk = x_ref.at[:, pl.ds(i * bk, bk)]
    x = x_blk[...] if m % bm == 0 else pl_triton.load(x_blk, mask=row < m, other=0)
    w = w_ref[pl.ds(i * bk, bk), :]
    if bits == 4:  # the two nibbles of each byte back to adjacent columns, in registers
      lo, hi = int4_fields(w)
      w = jnp.stack([lo, hi], axis=-1).reshape(bk, bn)
    part = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if group < k:  # this block's group: its partial sum times its scale row
      part = part * s_ref[pl.ds(i * bk // group, 1), :].astype(jnp.float32)
    return acc + part

  acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((bm, bn), jnp.float32))
  if group == k:
    acc = acc * s_ref[...].astype(jnp.float32)
  y = acc.astype(o_ref.dtype)
  if m % bm == 0:
    o_ref[...] = y
  else:
    pl_triton.store(o_ref, y, mask=row < m)


# The TPU form. Scale blocks are (1, 1, bn) of a (G, 1, N) array: a block's last two dims must
# be whole or multiples of (8, 128) on TPU, and one scale row of (G, N) would be neither.
def _tpu_kernel_int8(x_ref, w_ref, s_ref, o_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  x = x_ref[...]
  w = w_ref[...].astype(x.dtype)
  o_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32) * s_ref[0]


def _tpu_kernel_int4(x_ref, w_ref, se_ref, so_ref, oe_ref, oo_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    oe_ref[...] = jnp.zeros_like(oe_ref)
    oo_ref[...] = jnp.zeros_like(oo_ref)

  x = x_ref[...]
  lo, hi = int4_fields(w_ref[...])
  oe_ref[...] += jnp.dot(x, lo.astype(x.dtype), preferred_element_type=jnp.float32) * se_ref[0]
  oo_ref[...] += jnp.dot(x, hi.astype(x.dtype), preferred_element_type=jnp.float32) * so_ref[0]


def _compiler_params(platform: str, bm: int):
  """Triton on NVIDIA/AMD GPUs (8 warps for a prefill row block's accumulator), Mosaic on TPU
  (K, the grid's last axis, accumulates)."""
  if platform in ('gpu', 'cuda', 'rocm'):
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    return pl_triton.CompilerParams(num_warps=8 if bm > MAX_ROWS else 4, num_stages=2)
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
  return m, k, n, k // g


def qmm(x_MK, w, scale_GN, *, bits: int, interpret: Optional[bool] = None,
        block_n: int = 256, platform: Optional[str] = None, out_dtype=jnp.float32):
  """`x @ dequantize(codes, scales)` for symmetric int8 / packed int4 codes.

  Args:
    x_MK: activations (bf16, f16 or f32), any number of rows.
    w: codes (K, N) int8 for bits=8; (K, N/2) uint8 bytes for bits=4 (qjax's packing).
    scale_GN: f32-castable scales, one row per group of K/G consecutive rows.
    bits: 8 or 4.
    interpret: run the Pallas interpreter (default: on CPU, where nothing else lowers).
    block_n: the widest block of output columns.
    platform: the platform to lower for: 'cpu', 'gpu' (or 'cuda', 'rocm') or 'tpu' (default:
      the target's, `qjax.target`); 'cuda' or 'tpu' lets `jax.export` check the lowering on a
      machine without that device.
    out_dtype: the result's dtype (the f32 accumulator is rounded to it once, in the kernel).

  Returns:
    (M, N) in `out_dtype`.
  """
  # Resolved before the jit, so its cache keys on the platform the kernel is built for.
  platform = platform or qjax_target.current().backend
  return _qmm(x_MK, w, scale_GN, bits=bits, interpret=interpret, block_n=block_n,
              platform=platform, out_dtype=jnp.dtype(out_dtype))


def blocks(m: int, k: int, n: int, group: int, block_n: int = 256) -> tuple[int, int, int, int]:
  """(padded rows, bm, bn, bk) of the GPU kernel for (M, K, N) codes in groups of `group`."""
  if m <= MAX_ROWS:
    bm = -(-m // _ROW_PAD) * _ROW_PAD
    mp = bm
  else:
    bm = PREFILL_ROWS
    mp = -(-m // bm) * bm
  bn = _block(n, block_n if m <= MAX_ROWS else min(block_n, 128))
  bk = _block(group, _BK)  # a block of K inside one group
  return mp, bm, bn, bk


@functools.partial(jax.jit, static_argnames=('bits', 'interpret', 'block_n', 'platform',
                                             'out_dtype'))
def _qmm(x_MK, w, scale_GN, *, bits: int, interpret: Optional[bool], block_n: int,
         platform: str, out_dtype):
  """`qmm` for a resolved platform."""
  m, k, n, gk = check_operands(x_MK, w, scale_GN, bits)
  if interpret is None:
    interpret = platform == 'cpu'
  if platform == 'tpu' and not interpret:
    return _tpu_qmm(x_MK, w, scale_GN, bits=bits, block_n=block_n).astype(out_dtype)
  mp, bm, bn, bk = blocks(m, k, n, gk, block_n)
  cols = bn if bits == 8 else bn // 2  # code columns (bytes for int4) per block
  # Scales stay in their dtype (bf16 g32 scales converted outside would be a f32 copy).
  s = (scale_GN if scale_GN.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
       else scale_GN.astype(jnp.float32))
  # The row blocks of one column block are adjacent in the grid: they read the same codes.
  y = pl.pallas_call(
      functools.partial(_kernel, bits=bits, bk=bk, group=gk, m=m),
      grid=(n // bn, mp // bm),
      in_specs=[pl.BlockSpec((bm, k), lambda j, i: (i, 0)),
                pl.BlockSpec((k, cols), lambda j, i: (0, j)),
                pl.BlockSpec((s.shape[0], bn), lambda j, i: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(platform, bm))(x_MK, w, s)
  return y


def _tpu_qmm(x_MK, w, scale_GN, *, bits: int, block_n: int):
  """The TPU form: K on the grid, accumulated in the f32 output; int4 as even and odd
  columns (Mosaic has no in-register interleave); decode rows."""
  m, k, n, gk = check_operands(x_MK, w, scale_GN, bits)
  params = _compiler_params('tpu', 16)
  mp = -(-m // _ROW_PAD) * _ROW_PAD
  x = jnp.pad(x_MK, ((0, mp - m), (0, 0))) if mp != m else x_MK
  cols = n if bits == 8 else n // 2
  bn = _block(cols, block_n if bits == 8 else block_n // 2)
  bk = gk if gk < k else _block(k, 512)
  grid = (cols // bn, k // bk)
  x_spec = pl.BlockSpec((mp, bk), lambda j, i: (0, i))
  w_spec = pl.BlockSpec((bk, bn), lambda j, i: (i, j))
  s_spec = pl.BlockSpec((1, 1, bn), lambda j, i: (i * bk // gk, 0, j))
  o_spec = pl.BlockSpec((mp, bn), lambda j, g: (0, j))
  s = scale_GN.astype(jnp.float32)[:, None, :]
  call = functools.partial(pl.pallas_call, grid=grid, compiler_params=params)
  if bits == 8:
    y = call(_tpu_kernel_int8, in_specs=[x_spec, w_spec, s_spec], out_specs=o_spec,
             out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32))(x, w, s)
    return y[:m]
  ye, yo = call(_tpu_kernel_int4, in_specs=[x_spec, w_spec, s_spec, s_spec],
                out_specs=[o_spec, o_spec],
                out_shape=[jax.ShapeDtypeStruct((mp, cols), jnp.float32)] * 2)(
                    x, w, s[..., 0::2], s[..., 1::2])
  return jnp.stack([ye[:m], yo[:m]], axis=-1).reshape(m, n)
