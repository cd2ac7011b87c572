"""A Pallas TPU (Mosaic) kernel for weight-only quantized matmuls: codes in, f32 out.

`y_MN = x_MK @ dequantize(w)` where w holds int8, int4 (`jnp.int4`, two codes a byte in HBM)
or fp8 codes as XLA stores them (qjax's 'native' layout) with one scale per output channel and
per group of `group` rows of the contraction. Each grid step loads a block of codes, widens it
in VMEM to the activation dtype (integer and fp8 codes are exact in bf16), multiplies it with
the matching activation block on the MXU with f32 accumulation, and applies the **group scales
to each group's partial sum** (`acc += dot(x_g, codes_g) * scale_g`), so no float weight, f32
or otherwise, is ever written to HBM: the bytes read are the codes, the scales and the
activations. Per-channel weights (one group spanning K) take their scales once, after the last
K block.

Two weight layouts, as qjax's einsums hold them:

* 'kn': codes (K, N), scales (G, N) (projections: 'BTD,DF->BTF', o_proj's flattened N*H).
* 'nk': codes (N, K), scales (N, G) (the tied head 'BTD,VD->BTV'); each block is multiplied
  as x @ w.T, which the MXU takes without a transpose.

Blocks (the TPU rule: a block's last two dims are multiples of (8, 128) or the whole axis):
rows of M in multiples of 8 (16 for bf16 activations), N in multiples of 128 and K in whole
groups. For 'kn' scales a block holds 8 groups (so its (groups, bn) scale block obeys the rule)
or the whole K; for 'nk' the K block is the whole contraction (its scale block is (bn, G)).
Block sizes come from `BLOCKS`, a table per TPU generation (v6e's MXU is 256 wide, v5e's 128).

The kernel states its cost (`pl.CostEstimate`: the flops of the matmul and the bytes of its
operands, activations counted once per N block) so XLA's cost analysis of a program that calls
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
# An activation block of all K (fetched once per row block instead of once per output block)
# up to this many bytes (in f32): decode rows always, prefill rows where K is short.
_X_BLOCK_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Largest block sizes of one TPU generation (the kernel shrinks them to divide the axes).

  Attributes:
    bm: activation rows per block (prefill; decode shapes take all rows in one block).
    bn: output columns per block.
    bk: contraction rows per block ('kn' layout).
  """

  bm: int
  bn: int
  bk: int


# Per TPU generation (`jax.Device.device_kind`, lower case, first match): the MXU is 128 x 128
# on v4 and v5e, 256 x 256 on v6e; VMEM is 16 MiB scoped by default on v5e (32 MiB on v6e),
# and a step's double-buffered blocks (bm x bk activations, bk x bn codes widened to bf16,
# bm x bn f32 accumulator and output) stay under a quarter of it. Chosen from the TPU rule and
# memory arithmetic, not measured on a TPU: docs/quantized_matmul.md.
BLOCKS = (
    ('v6', Blocks(bm=512, bn=1024, bk=1024)),
    ('v5 lite', Blocks(bm=256, bn=512, bk=1024)),
    ('v5e', Blocks(bm=256, bn=512, bk=1024)),
    ('', Blocks(bm=256, bn=512, bk=512)),
)


def blocks_for(device_kind: str) -> Blocks:
  """The `BLOCKS` entry of a device kind ('TPU v5 lite', 'TPU v6 lite', ...)."""
  kind = (device_kind or '').lower()
  return next(b for key, b in BLOCKS if key in kind)


def _divisor(n: int, limit: int, step: int) -> Optional[int]:
  """The largest multiple of `step` <= limit dividing n, or None."""
  b = (min(limit, n) // step) * step
  while b >= step:
    if n % b == 0:
      return b
    b -= step
  return None


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one call is blocked: padded rows, block sizes and groups per K block."""

  layout: str
  m: int
  mp: int
  k: int
  n: int
  group: int      # contraction rows per scale row (k for per channel)
  bm: int
  bn: int
  bk: int
  x_whole: bool   # the activation block spans all of K: fetched once per row block

  @property
  def groups(self) -> int:
    return self.k // self.group

  @property
  def per_block(self) -> int:
    """Groups in one K block (1 for per channel)."""
    return max(1, self.bk // self.group)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.mp // self.bm, self.n // self.bn, self.k // self.bk)


def plan(layout: str, m: int, k: int, n: int, group: int,
         blocks: Blocks) -> tuple[Optional[Plan], str]:
  """The blocking of an (m, k) x codes call, or (None, why it does not fit the TPU rule)."""
  if layout not in LAYOUTS:
    return None, f'layout {layout!r} is not one of {LAYOUTS}'
  if group <= 0 or k % group:
    return None, f'group {group} does not divide K = {k}'
  bn = _divisor(n, blocks.bn, 128)
  if bn is None and n <= blocks.bn:
    bn = n  # a whole axis obeys the rule
  if bn is None:
    return None, f'N = {n} has no block that is a multiple of 128'
  if m <= blocks.bm:  # one row block of all M rows (a whole axis obeys the rule): no padding
    mp = bm = m
  else:
    bm = blocks.bm
    mp = -(-m // bm) * bm
  if group == k:  # per channel: any K block of whole 128-lane columns
    bk = _divisor(k, blocks.bk, 128) if layout == 'kn' else k
    if bk is None:
      bk = k
  elif layout == 'kn':
    if group % 8 and k // group != 1:
      return None, f'group {group} is not a multiple of 8 rows'
    # 8 groups per block keep the (groups, bn) scale block legal; else the whole K.
    bk = 8 * group if k % (8 * group) == 0 and (8 * group) % 128 == 0 else k
  else:
    if group % 128:
      return None, f"group {group}: a head ('nk') group must be whole 128-lane columns"
    bk = k
  x_whole = bk == k or bm * k * 4 <= _X_BLOCK_BYTES
  return Plan(layout, m, mp, k, n, group, bm, bn, bk, x_whole), ''


def _kn_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, p: Plan):
  """One (bm, bn) output block, accumulating over the K grid axis."""
  kk = pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  if p.x_whole and p.bk != p.k:
    x = x_ref[:, pl.ds(pl.multiple_of(kk * p.bk, 128), p.bk)]
  else:
    x = x_ref[...]
  w = w_ref[...].astype(x.dtype)  # exact: int8 / int4 / fp8 values are bf16 values
  if p.group == p.k:
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

  @pl.when(kk == pl.num_programs(2) - 1)
  def _():
    y = acc_ref[...]
    if p.group == p.k:
      y = y * s_ref[...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)


def _nk_kernel(x_ref, w_ref, s_ref, o_ref, *, p: Plan):
  """One (bm, bn) output block of x @ w.T, the whole contraction in one step."""
  x = x_ref[...]
  w = w_ref[...].astype(x.dtype)
  dims = (((1,), (1,)), ((), ()))
  if p.group == p.k:
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    y = y * s_ref[...].astype(jnp.float32)  # (1, bn)
  else:
    s = s_ref[...].astype(jnp.float32)  # (G, bn): the head's scales, transposed by the caller
    g = p.group
    y = jnp.zeros((p.bm, p.bn), jnp.float32)
    for j in range(p.groups):
      part = jax.lax.dot_general(x[:, j * g:(j + 1) * g], w[:, j * g:(j + 1) * g], dims,
                                 preferred_element_type=jnp.float32)
      y = y + part * s[j:j + 1]
  o_ref[...] = y.astype(o_ref.dtype)


def check_operands(x_MK, w, scale, layout: str) -> tuple[int, int, int, int]:
  """(M, K, N, group) of the operands; raises naming the bad shape or dtype."""
  if layout not in LAYOUTS:
    raise ValueError(f'tpu_qmm: layout={layout!r} is unknown; use one of {LAYOUTS}.')
  if x_MK.ndim != 2 or w.ndim != 2 or scale.ndim != 2:
    raise ValueError(f'tpu_qmm: expected x (M, K), codes and scales of rank 2, got '
                     f'{x_MK.shape}, {w.shape}, {scale.shape}.')
  if jnp.dtype(w.dtype).name not in CODE_DTYPES:
    raise ValueError(f'tpu_qmm: codes of dtype {w.dtype} have no kernel; use one of '
                     f'{CODE_DTYPES} (a QArray in the native layout).')
  m, k = x_MK.shape
  kw, n = w.shape if layout == 'kn' else w.shape[::-1]
  if kw != k:
    raise ValueError(f'tpu_qmm: x has K={k} columns but the {layout!r} codes {w.shape} '
                     f'contract {kw}.')
  groups, sn = scale.shape if layout == 'kn' else scale.shape[::-1]
  if sn != n or k % groups:
    want = '(G, N)' if layout == 'kn' else '(N, G)'
    raise ValueError(f'tpu_qmm: scales {scale.shape} must be {want} with N={n} and G dividing '
                     f'K={k}.')
  return m, k, n, k // groups


def fits(layout: str, m: int, k: int, n: int, group: int,
         device_kind: str = '') -> Optional[str]:
  """None where the kernel takes such a call on this TPU generation, else why not."""
  return plan(layout, m, k, n, group, blocks_for(device_kind))[1] or None


def cost(p: Plan, x_dtype, w_dtype, s_dtype, out_dtype) -> pl.CostEstimate:
  """The kernel's flops and HBM bytes: codes and scales once per row block, activations once
  per row block when their block spans K (else once per output block), the output once."""
  x_reads = 1 if p.x_whole else p.grid[1]
  bytes_ = ((weight_bytes(p.k, p.n, w_dtype) + p.groups * p.n * jnp.dtype(s_dtype).itemsize)
            * p.grid[0] + p.mp * p.k * jnp.dtype(x_dtype).itemsize * x_reads
            + p.mp * p.n * jnp.dtype(out_dtype).itemsize)
  return pl.CostEstimate(flops=2 * p.mp * p.k * p.n, transcendentals=0, bytes_accessed=bytes_)


def qmm(x_MK, w, scale, *, layout: str = 'kn', out_dtype=jnp.float32,
        interpret: Optional[bool] = None, device_kind: Optional[str] = None):
  """`x @ dequantize(codes, scales)` on the TPU, f32 result.

  Args:
    x_MK: activations (bf16 or f32), any number of rows.
    w: codes, int8 / int4 / fp8: (K, N) for layout 'kn', (N, K) for 'nk'.
    scale: one scale per output channel and group of contraction rows: (G, N) for 'kn',
      (N, G) for 'nk' (G = 1 per channel).
    layout: 'kn' or 'nk' (module docstring).
    interpret: run the Pallas interpreter (default: when the target is not a TPU).
    out_dtype: the result's dtype (the f32 accumulator is rounded to it once, in the kernel).
    device_kind: the TPU generation whose `BLOCKS` apply (default: the target's).

  Returns:
    (M, N) in `out_dtype`.

  Raises:
    ValueError: operands of the wrong shape or dtype, or a call the TPU rule does not block
      (`fits` says why).
  """
  t = qjax_target.current()
  if interpret is None:
    interpret = t.platform != 'tpu'
  device_kind = t.device_kind if device_kind is None else device_kind
  return _qmm(x_MK, w, scale, layout=layout, out_dtype=jnp.dtype(out_dtype),
              interpret=bool(interpret), device_kind=device_kind)


@functools.partial(jax.jit, static_argnames=('layout', 'out_dtype', 'interpret', 'device_kind'))
def _qmm(x_MK, w, scale, *, layout: str, out_dtype, interpret: bool, device_kind: str):
  """`qmm` for a resolved target."""
  m, k, n, group = check_operands(x_MK, w, scale, layout)
  p, why = plan(layout, m, k, n, group, blocks_for(device_kind))
  if p is None:
    raise ValueError(f'tpu_qmm: {why}; use XLA\'s dot (qeinsum path \'native\').')
  x = x_MK if x_MK.dtype in (jnp.bfloat16, jnp.float32) else x_MK.astype(jnp.float32)
  if p.mp != m:
    x = jnp.pad(x, ((0, p.mp - m), (0, 0)))
  if layout == 'nk':
    # A row of scales per group: per channel (N, 1) -> (1, N) is the same elements in order;
    # grouped (N, G) -> (G, N) is a transpose of the (small) scale array.
    # A row of scales per group: per channel (N, 1) -> (1, N) holds the elements in order;
    # grouped (N, G) -> (G, N) is a transpose of the scales (1/G of the codes' elements): a
    # (bn, G) block of (N, G) scales would need XLA to re-tile the whole array to TPU tiles of
    # 128 lanes first, which the compiler counted as 5x the bytes of the transpose.
    scale = scale.reshape(1, n) if group == k else scale.T
  call = functools.partial(
      pl.pallas_call, grid=p.grid, interpret=interpret,
      out_shape=jax.ShapeDtypeStruct((p.mp, n), out_dtype),
      cost_estimate=cost(p, x.dtype, w.dtype, scale.dtype, out_dtype))
  if p.x_whole:
    x_spec = pl.BlockSpec((p.bm, k), lambda i, j, kk: (i, 0))
  else:
    x_spec = pl.BlockSpec((p.bm, p.bk), lambda i, j, kk: (i, kk))
  o_spec = pl.BlockSpec((p.bm, p.bn), lambda i, j, kk: (i, j))
  if layout == 'kn':
    w_spec = pl.BlockSpec((p.bk, p.bn), lambda i, j, kk: (kk, j))
    if group == k:
      s_spec = pl.BlockSpec((1, p.bn), lambda i, j, kk: (0, j))
    else:
      s_spec = pl.BlockSpec((p.bk // group, p.bn), lambda i, j, kk: (kk, j))
    kernel = functools.partial(_kn_kernel, p=p)
    scratch = [_vmem((p.bm, p.bn))]
    params = _params(('parallel', 'parallel', 'arbitrary'), interpret)
  else:
    w_spec = pl.BlockSpec((p.bn, p.bk), lambda i, j, kk: (j, kk))
    s_spec = pl.BlockSpec((scale.shape[0], p.bn), lambda i, j, kk: (0, j))
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


def weight_bytes(k: int, n: int, w_dtype) -> int:
  """HBM bytes of (K, N) codes of `w_dtype` (int4 two to a byte)."""
  bits = 4 if jnp.dtype(w_dtype) == jnp.dtype(jnp.int4) else 8 * jnp.dtype(w_dtype).itemsize
  return math.ceil(k * n * bits / 8)
