"""A Pallas TPU (Mosaic) kernel for weight-only quantized matmuls: codes in, f32 out.

`y_MF = x_MD @ dequantize(w)` where w holds int8, int4 (`jnp.int4`, two codes a byte in HBM)
or fp8 codes as XLA stores them (qjax's 'native' layout) with one scale per output channel and
per group of `group` rows of the contraction (M rows, D contracted, F output columns, Q groups).
Each grid step loads a block of codes, widens it in VMEM to the activation dtype (integer and
fp8 codes are exact in bf16), multiplies it with the matching activation block on the MXU with
f32 accumulation, and applies the **group scales to each group's partial sum** (`acc +=
dot(x_g, codes_g) * scale_g`), so no float weight, f32 or otherwise, is ever written to HBM:
the bytes read are the codes, the scales and the activations. Per-channel weights (one group
spanning D) take their scales once, after the last D block.

Two weight layouts, as qjax's einsums hold them (the names are the layouts' public values):

* 'kn': codes (D, F), scales (Q, F), contraction first (projections: 'BTD,DF->BTF'; o_proj
  contracts its heads and head dim flattened).
* 'nk': codes (F, D), scales (F, Q), contraction last (the tied head 'BTD,VD->BTV', F = V);
  each block is multiplied as x @ w.T, which the MXU takes without a transpose.

Blocks (the TPU rule: a block's last two dims are multiples of (8, 128) or the whole axis):
rows of M in multiples of 8 (16 for bf16 activations), F in multiples of 128 and D in whole
groups. For 'kn' scales a block holds 8 groups (so its (groups, bf) scale block obeys the rule)
or the whole D; for 'nk' the D block is the whole contraction (its scale block is (bf, Q)).
Block sizes come from `BLOCKS`, a table per TPU generation (v6e's MXU is 256 wide, v5e's 128).

The kernel states its cost (`pl.CostEstimate`: the flops of the matmul and the bytes of its
operands, activations counted once per F block) so XLA's cost analysis of a program that calls
it counts what it reads. On CPU it runs in interpret mode (the tests' float64 reference check);
it lowers only for TPU (Mosaic). This module imports nothing from qjax but the target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target

LAYOUTS = ('kn', 'nk')
CODE_DTYPES = ('int8', 'int4', 'float8_e4m3fn', 'float8_e5m2')
# An activation block of all D (fetched once per row block instead of once per output block)
# up to this many bytes (in f32): decode rows always, prefill rows where D is short.
_X_BLOCK_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Largest block sizes of one TPU generation (the kernel shrinks them to divide the axes).

  Attributes:
    bm: activation rows per block (prefill; decode shapes take all rows in one block).
    bf: output columns per block.
    bd: contraction rows per block ('kn' layout).
  """

  bm: int
  bf: int
  bd: int


# Per TPU generation (`jax.Device.device_kind`, lower case, first match): the MXU is 128 x 128
# on v4 and v5e, 256 x 256 on v6e; VMEM is 16 MiB scoped by default on v5e (32 MiB on v6e),
# and a step's double-buffered blocks (bm x bd activations, bd x bf codes widened to bf16,
# bm x bf f32 accumulator and output) stay under a quarter of it. Chosen from the TPU rule and
# memory arithmetic, not measured on a TPU: docs/quantized_matmul.md.
BLOCKS = (
    ('v6', Blocks(bm=512, bf=1024, bd=1024)),
    ('v5 lite', Blocks(bm=256, bf=512, bd=1024)),
    ('v5e', Blocks(bm=256, bf=512, bd=1024)),
    ('', Blocks(bm=256, bf=512, bd=512)),
)


def blocks_for(device_kind: str) -> Blocks:
  """The `BLOCKS` entry of a device kind ('TPU v5 lite', 'TPU v6 lite', ...)."""
  kind = (device_kind or '').lower()
  return next(b for key, b in BLOCKS if key in kind)


def _divisor(size: int, limit: int, step: int) -> Optional[int]:
  """The largest multiple of `step` <= limit dividing size, or None."""
  b = (min(limit, size) // step) * step
  while b >= step:
    if size % b == 0:
      return b
    b -= step
  return None


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one call is blocked: padded rows, block sizes and groups per D block."""

  layout: str
  m: int
  mp: int
  d: int
  f: int
  group: int      # contraction rows per scale row (d for per channel)
  bm: int
  bf: int
  bd: int
  x_whole: bool   # the activation block spans all of D: fetched once per row block

  @property
  def groups(self) -> int:
    return self.d // self.group

  @property
  def per_block(self) -> int:
    """Groups in one D block (1 for per channel)."""
    return max(1, self.bd // self.group)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.mp // self.bm, self.f // self.bf, self.d // self.bd)


def plan(layout: str, m: int, d: int, f: int, group: int,
         blocks: Blocks) -> tuple[Optional[Plan], str]:
  """The blocking of an (m, d) x codes call, or (None, why it does not fit the TPU rule)."""
  if layout not in LAYOUTS:
    return None, f'layout {layout!r} is not one of {LAYOUTS}'
  if group <= 0 or d % group:
    return None, f'group {group} does not divide D = {d}'
  bf = _divisor(f, blocks.bf, 128)
  if bf is None and f <= blocks.bf:
    bf = f  # a whole axis obeys the rule
  if bf is None:
    return None, f'F = {f} has no block that is a multiple of 128'
  if m <= blocks.bm:  # one row block of all M rows (a whole axis obeys the rule): no padding
    mp = bm = m
  else:
    bm = blocks.bm
    mp = -(-m // bm) * bm
  if group == d:  # per channel: any D block of whole 128-lane columns
    bd = _divisor(d, blocks.bd, 128) if layout == 'kn' else d
    if bd is None:
      bd = d
  elif layout == 'kn':
    if group % 8 and d // group != 1:
      return None, f'group {group} is not a multiple of 8 rows'
    # 8 groups per block keep the (groups, bf) scale block legal; else the whole D.
    bd = 8 * group if d % (8 * group) == 0 and (8 * group) % 128 == 0 else d
  else:
    if group % 128:
      return None, f"group {group}: a head ('nk') group must be whole 128-lane columns"
    bd = d
  x_whole = bd == d or bm * d * 4 <= _X_BLOCK_BYTES
  return Plan(layout, m, mp, d, f, group, bm, bf, bd, x_whole), ''


def _kn_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, p: Plan):
  """One (bm, bf) output block, accumulating over the D grid axis."""
  di = pl.program_id(2)

  @pl.when(di == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  if p.x_whole and p.bd != p.d:
    x = x_ref[:, pl.ds(pl.multiple_of(di * p.bd, 128), p.bd)]
  else:
    x = x_ref[...]
  w = w_ref[...].astype(x.dtype)  # exact: int8 / int4 / fp8 values are bf16 values
  if p.group == p.d:
    acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32)
  else:
    s = s_ref[...]
    acc = acc_ref[...]
    g = p.group
    for j in range(p.per_block):  # each group's partial sum, then its scale row
      part = jnp.dot(x[:, j * g:(j + 1) * g], w[j * g:(j + 1) * g],
                     preferred_element_type=jnp.float32)
      acc = acc + part * s[j:j + 1].astype(jnp.float32)
    acc_ref[...] = acc

  @pl.when(di == pl.num_programs(2) - 1)
  def _():
    y = acc_ref[...]
    if p.group == p.d:
      y = y * s_ref[...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def _nk_kernel(x_ref, w_ref, s_ref, o_ref, *, p: Plan):
  """One (bm, bf) output block of x @ w.T, the whole contraction in one step."""
  x = x_ref[...]
  w = w_ref[...].astype(x.dtype)
  dims = (((1,), (1,)), ((), ()))
  if p.group == p.d:
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    y = y * s_ref[...].astype(jnp.float32)  # (1, bf)
  else:
    s = s_ref[...].astype(jnp.float32)  # (Q, bf): the head's scales, transposed by the caller
    g = p.group
    y = jnp.zeros((p.bm, p.bf), jnp.float32)
    for j in range(p.groups):
      part = jax.lax.dot_general(x[:, j * g:(j + 1) * g], w[:, j * g:(j + 1) * g], dims,
                                 preferred_element_type=jnp.float32)
      y = y + part * s[j:j + 1]
  o_ref[...] = y.astype(o_ref.dtype)


def check_operands(x_MD, w, scale, layout: str) -> tuple[int, int, int, int]:
  """(M, D, F, group) of the operands; raises naming the bad shape or dtype."""
  if layout not in LAYOUTS:
    raise ValueError(f'tpu_qmm: layout={layout!r} is unknown; use one of {LAYOUTS}.')
  if x_MD.ndim != 2 or w.ndim != 2 or scale.ndim != 2:
    raise ValueError(f'tpu_qmm: expected x (M, D), codes and scales of rank 2, got '
                     f'{x_MD.shape}, {w.shape}, {scale.shape}.')
  if jnp.dtype(w.dtype).name not in CODE_DTYPES:
    raise ValueError(f'tpu_qmm: codes of dtype {w.dtype} have no kernel; use one of '
                     f'{CODE_DTYPES} (a QArray in the native layout).')
  m, d = x_MD.shape
  d_w, f = w.shape if layout == 'kn' else w.shape[::-1]
  if d_w != d:
    raise ValueError(f'tpu_qmm: x has D={d} columns but the {layout!r} codes {w.shape} '
                     f'contract {d_w}.')
  groups, f_s = scale.shape if layout == 'kn' else scale.shape[::-1]
  if f_s != f or d % groups:
    want = '(Q, F)' if layout == 'kn' else '(F, Q)'
    raise ValueError(f'tpu_qmm: scales {scale.shape} must be {want} with F={f} and Q dividing '
                     f'D={d}.')
  return m, d, f, d // groups


def fits(layout: str, m: int, d: int, f: int, group: int,
         device_kind: str = '') -> Optional[str]:
  """None where the kernel takes such a call on this TPU generation, else why not."""
  return plan(layout, m, d, f, group, blocks_for(device_kind))[1] or None


def cost(p: Plan, x_dtype, w_dtype, s_dtype, out_dtype) -> pl.CostEstimate:
  """The kernel's flops and HBM bytes: codes and scales once per row block, activations once
  per row block when their block spans D (else once per output block), the output once."""
  x_reads = 1 if p.x_whole else p.grid[1]
  bytes_ = ((weight_bytes(p.d, p.f, w_dtype) + p.groups * p.f * jnp.dtype(s_dtype).itemsize)
            * p.grid[0] + p.mp * p.d * jnp.dtype(x_dtype).itemsize * x_reads
            + p.mp * p.f * jnp.dtype(out_dtype).itemsize)
  return pl.CostEstimate(flops=2 * p.mp * p.d * p.f, transcendentals=0, bytes_accessed=bytes_)


def qmm(x_MD, w, scale, *, layout: str = 'kn', out_dtype=jnp.float32,
        interpret: Optional[bool] = None, device_kind: Optional[str] = None):
  """`x @ dequantize(codes, scales)` on the TPU, f32 result.

  Args:
    x_MD: activations (bf16 or f32), any number of rows.
    w: codes, int8 / int4 / fp8: (D, F) for layout 'kn', (F, D) for 'nk'.
    scale: one scale per output channel and group of contraction rows: (Q, F) for 'kn',
      (F, Q) for 'nk' (Q = 1 per channel).
    layout: 'kn' or 'nk' (module docstring).
    interpret: run the Pallas interpreter (default: when the target is not a TPU).
    out_dtype: the result's dtype (the f32 accumulator is rounded to it once, in the kernel).
    device_kind: the TPU generation whose `BLOCKS` apply (default: the target's).

  Returns:
    (M, F) in `out_dtype`.

  Raises:
    ValueError: operands of the wrong shape or dtype, or a call the TPU rule does not block
      (`fits` says why).
  """
  t = qjax_target.current()
  if interpret is None:
    interpret = t.platform != 'tpu'
  device_kind = t.device_kind if device_kind is None else device_kind
  return _qmm(x_MD, w, scale, layout=layout, out_dtype=jnp.dtype(out_dtype),
              interpret=bool(interpret), device_kind=device_kind)


@functools.partial(jax.jit, static_argnames=('layout', 'out_dtype', 'interpret', 'device_kind'))
def _qmm(x_MD, w, scale, *, layout: str, out_dtype, interpret: bool, device_kind: str):
  """`qmm` for a resolved target."""
  m, d, f, group = check_operands(x_MD, w, scale, layout)
  p, why = plan(layout, m, d, f, group, blocks_for(device_kind))
  if p is None:
    raise ValueError(f'tpu_qmm: {why}; use XLA\'s dot (qeinsum path \'native\').')
  x = x_MD if x_MD.dtype in (jnp.bfloat16, jnp.float32) else x_MD.astype(jnp.float32)
  if p.mp != m:
    x = jnp.pad(x, ((0, p.mp - m), (0, 0)))
  if layout == 'nk':
    # A row of scales per group: per channel (F, 1) -> (1, F) holds the elements in order;
    # grouped (F, Q) -> (Q, F) is a transpose of the scales (1/Q of the codes' elements): a
    # (bf, Q) block of (F, Q) scales would need XLA to re-tile the whole array to TPU tiles of
    # 128 lanes first, which the compiler counted as 5x the bytes of the transpose.
    scale = scale.reshape(1, f) if group == d else scale.T
  call = functools.partial(
      pl.pallas_call, grid=p.grid, interpret=interpret,
      out_shape=jax.ShapeDtypeStruct((p.mp, f), out_dtype),
      cost_estimate=cost(p, x.dtype, w.dtype, scale.dtype, out_dtype))
  if p.x_whole:
    x_spec = pl.BlockSpec((p.bm, d), lambda i, j, di: (i, 0))
  else:
    x_spec = pl.BlockSpec((p.bm, p.bd), lambda i, j, di: (i, di))
  o_spec = pl.BlockSpec((p.bm, p.bf), lambda i, j, di: (i, j))
  if layout == 'kn':
    w_spec = pl.BlockSpec((p.bd, p.bf), lambda i, j, di: (di, j))
    if group == d:
      s_spec = pl.BlockSpec((1, p.bf), lambda i, j, di: (0, j))
    else:
      s_spec = pl.BlockSpec((p.bd // group, p.bf), lambda i, j, di: (di, j))
    kernel = functools.partial(_kn_kernel, p=p)
    scratch = [_vmem((p.bm, p.bf))]
    params = _params(('parallel', 'parallel', 'arbitrary'), interpret)
  else:
    w_spec = pl.BlockSpec((p.bf, p.bd), lambda i, j, di: (j, di))
    s_spec = pl.BlockSpec((scale.shape[0], p.bf), lambda i, j, di: (0, j))
    kernel = functools.partial(_nk_kernel, p=p)
    scratch = []
    params = _params(('parallel', 'parallel', 'arbitrary'), interpret)
  y = call(kernel, in_specs=[x_spec, w_spec, s_spec], out_specs=o_spec,
           scratch_shapes=scratch, compiler_params=params)(x, w, scale)
  return y[:m] if p.mp != m else y


def _vmem(shape):
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  return pltpu.VMEM(shape, jnp.float32)


def _params(semantics, interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  return pltpu.CompilerParams(dimension_semantics=semantics)


def weight_bytes(d: int, f: int, w_dtype) -> int:
  """HBM bytes of (D, F) codes of `w_dtype` (int4 two to a byte)."""
  bits = 4 if jnp.dtype(w_dtype) == jnp.dtype(jnp.int4) else 8 * jnp.dtype(w_dtype).itemsize
  return math.ceil(d * f * bits / 8)
