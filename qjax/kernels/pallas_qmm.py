"""A Pallas kernel for weight-only int8 / int4 matmuls: codes in, any number of rows.

`y_MF = x_MD @ dequantize(w_DF)` with the dequantize inside the kernel: M rows, D contracted,
F output columns, Q groups of `group_size` rows along D. Each program computes one (bm, bf)
output block: it walks D in blocks of bd rows, loads a (bd, bf) block of codes (int8, or two
4-bit codes per uint8 byte in qjax's packing: the low nibble is column 2i, the high nibble
column 2i+1), widens it in registers to the activation dtype, multiplies it with the (bm, bd)
activation block with f32 accumulation and scales that block's partial sum by its group's
scale row; per-channel scales are applied once after the last block. The output is written
once, in the caller's dtype. No float copy of the weight exists anywhere. A block of D never
spans two groups (bd divides the group size), so any group of 16 rows or more works.

int4 bytes are split into their two nibbles and interleaved back into one (bd, bf) block of
codes in registers (Triton's join and reshape, as Pallas's own int4 loads do), so one dot per
block covers both halves: neither the scales nor the output are split into even and odd
columns.

Rows: at decode (M <= 64) one block of all rows, rounded up to 16 (the smallest operand
Triton's `tl.dot` takes) by masked loads and a masked write, so neither x nor y is padded in
HBM; at prefill blocks of `PREFILL_ROWS` rows, so each code tile is read once per
such block (four times for 512 rows; the grid walks the row blocks of one column block
together, so the re-reads can come from L2). Block shapes are powers of two dividing the axes:
bf up to 256 output columns (128 at prefill), bd up to 128 contraction rows.

Backends: Triton on GPU; on CPU the same kernel runs with `interpret=True` (the tests' float64
reference check). For a TPU the kernel of the same name keeps D on the grid (Mosaic's blocks,
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
_BD = 128            # contraction rows per block (at most)


def _block(size: int, limit: int) -> int:
  """The largest power of two <= limit dividing size (size itself when none does)."""
  b = limit
  while b >= 8:
    if size % b == 0:
      return b
    b //= 2
  return size


def int4_fields(b):
  """Signed low and high nibbles of uint8 bytes, as int32."""
  b = b.astype(jnp.int32)
  lo, hi = b & 15, (b >> 4) & 15
  return lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, bits: int, bd: int, group: int, m: int):
  """One (bm, bf) output block: the D loop in the program, f32 accumulation, one write. Rows
  past the m real ones are masked out of the loads and the write (x and y are never padded
  in HBM)."""
  d = x_ref.shape[1]
  bm, bf = o_ref.shape
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
  row = pl.program_id(1) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

  def step(i, acc):
    x_blk = x_ref.at[:, pl.ds(i * bd, bd)]
    x = x_blk[...] if m % bm == 0 else pl_triton.load(x_blk, mask=row < m, other=0)
    w = w_ref[pl.ds(i * bd, bd), :]
    if bits == 4:  # the two nibbles of each byte back to adjacent columns, in registers
      lo, hi = int4_fields(w)
      w = jnp.stack([lo, hi], axis=-1).reshape(bd, bf)
    part = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if group < d:  # this block's group: its partial sum times its scale row
      part = part * s_ref[pl.ds(i * bd // group, 1), :].astype(jnp.float32)
    return acc + part

  acc = jax.lax.fori_loop(0, d // bd, step, jnp.zeros((bm, bf), jnp.float32))
  if group == d:
    acc = acc * s_ref[...].astype(jnp.float32)
  y = acc.astype(o_ref.dtype)
  if m % bm == 0:
    o_ref[...] = y
  else:
    pl_triton.store(o_ref, y, mask=row < m)


# The TPU form. Scale blocks are (1, 1, bf) of a (Q, 1, F) array: a block's last two dims must
# be whole or multiples of (8, 128) on TPU, and one scale row of (Q, F) would be neither.
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
  (D, the grid's last axis, accumulates)."""
  if platform in ('gpu', 'cuda', 'rocm'):
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    return pl_triton.CompilerParams(num_warps=8 if bm > MAX_ROWS else 4, num_stages=2)
  if platform == 'tpu':
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
    return pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary'))
  return None


def check_operands(x_MD, w, scale_QF, bits: int) -> tuple[int, int, int, int]:
  """(M, D, F, group rows) of the operands; raises naming the bad shape or dtype."""
  if x_MD.ndim != 2 or w.ndim != 2 or scale_QF.ndim != 2:
    raise ValueError(f'pallas_qmm: expected x (M, D), codes (D, F or F/2) and scales (Q, F), '
                     f'got {x_MD.shape}, {w.shape}, {scale_QF.shape}.')
  m, d = x_MD.shape
  if bits == 8:
    if w.dtype != jnp.int8:
      raise ValueError(f'pallas_qmm: int8 codes must be int8, got {w.dtype}.')
    f = w.shape[1]
  elif bits == 4:
    if w.dtype != jnp.uint8:
      raise ValueError(f'pallas_qmm: int4 codes must be packed two per uint8 byte along F, got '
                       f'{w.dtype}; pass the packed layout (QArray.data of a packed QArray).')
    f = 2 * w.shape[1]
  else:
    raise ValueError(f'pallas_qmm: bits={bits} has no kernel; use 8 or 4.')
  if w.shape[0] != d:
    raise ValueError(f'pallas_qmm: x has D={d} columns but the codes have {w.shape[0]} rows.')
  if not (m and d and f):
    raise ValueError(f'pallas_qmm: an empty operand (M={m}, D={d}, F={f}: x {x_MD.shape}, '
                     f'codes {w.shape}); every dimension must be at least 1 (an empty product '
                     'needs no kernel: skip the call).')
  q = scale_QF.shape[0]
  if not q or scale_QF.shape[1] != f or d % q:
    raise ValueError(f'pallas_qmm: scales {scale_QF.shape} must be (Q, F={f}) with Q >= 1 '
                     f'dividing D={d}.')
  return m, d, f, d // q


def qmm(x_MD, w, scale_QF, *, bits: int, interpret: Optional[bool] = None,
        block_f: int = 256, platform: Optional[str] = None, out_dtype=jnp.float32):
  """`x @ dequantize(codes, scales)` for symmetric int8 / packed int4 codes.

  Args:
    x_MD: activations (bf16, f16 or f32), any number of rows.
    w: codes (D, F) int8 for bits=8; (D, F/2) uint8 bytes for bits=4 (qjax's packing).
    scale_QF: f32-castable scales, one row per group of D/Q consecutive rows.
    bits: 8 or 4.
    interpret: run the Pallas interpreter (default: on CPU, where nothing else lowers).
    block_f: the widest block of output columns.
    platform: the platform to lower for: 'cpu', 'gpu' (or 'cuda', 'rocm') or 'tpu' (default:
      the target's, `qjax.target`); 'cuda' or 'tpu' lets `jax.export` check the lowering on a
      machine without that device.
    out_dtype: the result's dtype (the f32 accumulator is rounded to it once, in the kernel).

  Returns:
    (M, F) in `out_dtype`.
  """
  # Resolved before the jit, so its cache keys on the platform the kernel is built for.
  platform = platform or qjax_target.current().backend
  return _qmm(x_MD, w, scale_QF, bits=bits, interpret=interpret, block_f=block_f,
              platform=platform, out_dtype=jnp.dtype(out_dtype))


def blocks(m: int, d: int, f: int, group: int, block_f: int = 256) -> tuple[int, int, int, int]:
  """(padded rows, bm, bf, bd) of the GPU kernel for (M, D, F) codes in groups of `group`."""
  if m <= MAX_ROWS:
    bm = -(-m // _ROW_PAD) * _ROW_PAD
    mp = bm
  else:
    bm = PREFILL_ROWS
    mp = -(-m // bm) * bm
  bf = _block(f, block_f if m <= MAX_ROWS else min(block_f, 128))
  bd = _block(group, _BD)  # a block of D inside one group
  return mp, bm, bf, bd


@functools.partial(jax.jit, static_argnames=('bits', 'interpret', 'block_f', 'platform',
                                             'out_dtype'))
def _qmm(x_MD, w, scale_QF, *, bits: int, interpret: Optional[bool], block_f: int,
         platform: str, out_dtype):
  """`qmm` for a resolved platform."""
  m, d, f, group = check_operands(x_MD, w, scale_QF, bits)
  if interpret is None:
    interpret = platform == 'cpu'
  if platform == 'tpu' and not interpret:
    return _tpu_qmm(x_MD, w, scale_QF, bits=bits, block_f=block_f).astype(out_dtype)
  mp, bm, bf, bd = blocks(m, d, f, group, block_f)
  cols = bf if bits == 8 else bf // 2  # code columns (bytes for int4) per block
  # Scales stay in their dtype (bf16 g32 scales converted outside would be a f32 copy).
  s = (scale_QF if scale_QF.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
       else scale_QF.astype(jnp.float32))
  # The row blocks of one column block are adjacent in the grid: they read the same codes.
  y = pl.pallas_call(
      functools.partial(_kernel, bits=bits, bd=bd, group=group, m=m),
      grid=(f // bf, mp // bm),
      in_specs=[pl.BlockSpec((bm, d), lambda j, i: (i, 0)),
                pl.BlockSpec((d, cols), lambda j, i: (0, j)),
                pl.BlockSpec((s.shape[0], bf), lambda j, i: (0, j))],
      out_specs=pl.BlockSpec((bm, bf), lambda j, i: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, f), out_dtype),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(platform, bm))(x_MD, w, s)
  return y


def _tpu_qmm(x_MD, w, scale_QF, *, bits: int, block_f: int):
  """The TPU form: D on the grid, accumulated in the f32 output; int4 as even and odd
  columns (Mosaic has no in-register interleave); decode rows."""
  m, d, f, group = check_operands(x_MD, w, scale_QF, bits)
  params = _compiler_params('tpu', 16)
  mp = -(-m // _ROW_PAD) * _ROW_PAD
  x = jnp.pad(x_MD, ((0, mp - m), (0, 0))) if mp != m else x_MD
  cols = f if bits == 8 else f // 2
  bf = _block(cols, block_f if bits == 8 else block_f // 2)
  bd = group if group < d else _block(d, 512)
  grid = (cols // bf, d // bd)
  x_spec = pl.BlockSpec((mp, bd), lambda j, i: (0, i))
  w_spec = pl.BlockSpec((bd, bf), lambda j, i: (i, j))
  s_spec = pl.BlockSpec((1, 1, bf), lambda j, i: (i * bd // group, 0, j))
  o_spec = pl.BlockSpec((mp, bf), lambda j, i: (0, j))
  s = scale_QF.astype(jnp.float32)[:, None, :]
  call = functools.partial(pl.pallas_call, grid=grid, compiler_params=params)
  if bits == 8:
    y = call(_tpu_kernel_int8, in_specs=[x_spec, w_spec, s_spec], out_specs=o_spec,
             out_shape=jax.ShapeDtypeStruct((mp, f), jnp.float32))(x, w, s)
    return y[:m]
  ye, yo = call(_tpu_kernel_int4, in_specs=[x_spec, w_spec, s_spec, s_spec],
                out_specs=[o_spec, o_spec],
                out_shape=[jax.ShapeDtypeStruct((mp, cols), jnp.float32)] * 2)(
                    x, w, s[..., 0::2], s[..., 1::2])
  return jnp.stack([ye[:m], yo[:m]], axis=-1).reshape(m, f)
