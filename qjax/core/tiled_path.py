"""The tiled CPU path of `qeinsum`: a plan, a per-tile product, an epilogue.

Weight-only (or int8 / fp8 activation) products computed as a `fori_loop` over row tiles of
the weight, so no float copy of the whole weight is ever live (the `qdot` module docstring
says why XLA:CPU needs this and what was measured). Tiles of the contracted axes ("rows")
cover specs whose weight is (contracted..., kept...); `qjax.core.decode_paths` covers the
transposed head layout ('BTD,VD->BTV') by blocks of V.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from qjax import kernels
from qjax.core import packing
from qjax.core.formats import FLOAT_KINDS
from qjax.core.qarray import QArray


def parse_spec(spec: str) -> tuple[str, str, str]:
  """'BTD,DNH->BTNH' -> ('BTD', 'DNH', 'BTNH'): two operands, explicit output, no ellipsis."""
  try:
    ins, out = spec.replace(' ', '').split('->')
    xs, ws = ins.split(',')
  except ValueError:
    raise ValueError(f"qeinsum: spec {spec!r} must look like 'BTD,DF->BTF' (two operands, "
                     'explicit output, no ellipsis).') from None
  if '.' in spec:
    raise ValueError(f'qeinsum: spec {spec!r} uses an ellipsis; spell out every axis.')
  return xs, ws, out


def quantize_rows(x, reduce_axes, act_kind):
  """Symmetric per-row quantization of activations (rows = all non-reduced axes)."""
  amax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
  # `amax == 0`, not `amax > 0`: a NaN row keeps a NaN scale, so the NaN reaches the output
  # (under jit nothing else would report it) instead of becoming codes of 0 at scale 1.
  if act_kind == 'int':
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale
  dt = FLOAT_KINDS[act_kind]
  fmax = float(jnp.finfo(dt).max)
  scale = jnp.where(amax == 0, 1.0, amax / fmax)
  return jnp.clip(x / scale, -fmax, fmax).astype(dt), scale


_TILE_ELEMENTS = 2**20  # weight elements per tile: 2 MiB in bf16, 4 MiB in f32 (cache-sized)
_MIN_TILE_ROWS = 64     # fewer rows per tile cost more in loop overhead than they save
_EXACT = 2**24          # integers below this add exactly in an f32 accumulator


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """How `qeinsum` runs as a loop over row tiles: x2 (M, K) @ w2 (K, N), N = kept axes.

  Attributes:
    a: number of contracted weight axes (they come first in the weight).
    x_only: activation letters that are neither contracted nor in the weight (rows, M).
    m_shape: their sizes; m = prod(m_shape).
    k: contracted elements K.
    kept_shape: the weight's kept (output) axes; n = prod(kept_shape).
    unit: K rows per scale row (whole groups); kq = K / unit scale rows, or kq = 1 when the
      scales are constant along K.
    kq: scale rows along K.
    kt: K rows per tile.
    act_kind: None (weight-only), 'int' or an fp8 kind (activations quantized per token, and
      per group when scales vary along K).
    grouped: activation scales per group: one group per tile, scaled inside the loop.
  """

  a: int
  x_only: tuple
  m_shape: tuple
  k: int
  kept_shape: tuple
  unit: int
  kq: int
  kt: int
  act_kind: Optional[str]
  grouped: bool

  @property
  def m(self) -> int:
    return math.prod(self.m_shape)

  @property
  def n(self) -> int:
    return math.prod(self.kept_shape)

  @property
  def fold(self) -> bool:
    """Scales vary along K: applied to each tile before its dot (else once, after the loop)."""
    return self.kq > 1


def canonical_axes(xs, ws, out) -> Optional[int]:
  """Whether the spec is x2 (M, K) @ w2 (K, N) with w's axes (contracted..., kept...).

  That is: no batch axes, no repeated letters, no axis summed out of one operand alone, and the
  weight's contracted axes come first, so (K, N) is a free reshape of its storage and the
  packed last axis is a kept one. Returns the number of contracted weight axes, or None.
  """
  if len(set(xs)) != len(xs) or len(set(ws)) != len(ws) or len(set(out)) != len(out):
    return None
  a = sum(c in xs for c in ws)
  contracted, kept = ws[:a], ws[a:]
  if not a or not kept or any(c in xs or c not in out for c in kept):
    return None
  if any(c in out for c in contracted) or any(c not in ws and c not in out for c in xs):
    return None
  return a


def plan_tiles(xs, ws, out, x_shape, w: QArray, act_kind) -> Optional[TilePlan]:
  """The tile plan of `qeinsum` on CPU, or None for a spec / scale layout it cannot express."""
  a = canonical_axes(xs, ws, out)
  if a is None:
    return None
  shape, tiles, sshape = w.shape, w.tile_shape, w.scale.shape
  if any(1 < t < d for t, d in zip(tiles[a:], shape[a:])):
    return None  # scales cut a kept axis into groups
  if any(t not in (1, d) for t, d in zip(tiles[:a - 1], shape[:a - 1])):
    return None  # groups must run along the last contracted axis: contiguous along K
  k = math.prod(shape[:a])
  kept_shape = tuple(shape[a:])
  n = math.prod(kept_shape)
  if all(d == 1 for d in sshape[:a]):
    unit, kq = k, 1
  else:
    unit = tiles[a - 1]
    kq = k // unit
  if unit == 1 and all(d == t for d, t in zip(sshape[a:], kept_shape)):
    return None  # a scale per element: nothing to tile over
  grouped = kq > 1 and 1 < tiles[a - 1] < shape[a - 1]
  if act_kind is not None and kq > 1 and not grouped:
    return None  # a scale along K (not by group) cannot follow a quantized-activation dot
  x_only = tuple(c for c in xs if c not in ws)
  m_shape = tuple(x_shape[xs.index(c)] for c in x_only)
  m = math.prod(m_shape)
  # Tile rows: ~_TILE_ELEMENTS per tile in whole groups; one group per tile when activation
  # scales are per group; few enough rows that integer partial sums are exact in f32.
  if act_kind is not None and grouped:
    kt = unit
  else:
    # At most ~1/8 of the weight per tile, so no tile is a float copy of the whole weight, or
    # M rows when that is more: a tile then holds no more elements than the (M, N) output, and
    # each tile's partial product (re-read and re-written once per tile) is amortised over as
    # many weight rows as there are activation rows (prefill).
    rows = max(_MIN_TILE_ROWS, m, min(_TILE_ELEMENTS // n, k // 8))
    step = unit if kq > 1 else 1
    kt = min(k, step * max(1, rows // step))
  if act_kind == 'int':
    step = unit if kq > 1 else 1
    bound = _EXACT // (127 * 2**(w.qtype.bits - 1)) // step * step
    if kt > bound:
      if bound < step:
        return None
      kt = bound
  return TilePlan(a, x_only, m_shape, k, kept_shape, unit, kq, kt, act_kind, grouped)


def per_k(arr, w: QArray, plan: TilePlan):
  """A scale-shaped array as (kq, kept scale dims...) in f32."""
  if arr is None:
    return None
  v = arr.astype(jnp.float32)
  a = plan.a
  if plan.kq == 1:
    return v.reshape((1,) + v.shape[a:])
  v = jnp.broadcast_to(v, tuple(w.shape[:a - 1]) + v.shape[a - 1:])
  return v.reshape((-1,) + v.shape[a:])


def _fields(arr, per, nf, kept_shape):
  """(kq, kept...) -> `per` arrays (kq, Nf) matching the packed fields of the last axis."""
  if arr is None:
    return [None] * per
  kq = arr.shape[0]
  if all(d == 1 for d in arr.shape[1:]):
    return [arr.reshape(kq, 1)] * per
  arr = jnp.broadcast_to(arr, (kq,) + tuple(kept_shape))
  pad = per * nf - kept_shape[-1]
  if pad:
    arr = jnp.pad(arr, [(0, 0)] * (arr.ndim - 1) + [(0, pad)], constant_values=1.0)
  return [arr[..., j::per].reshape(kq, -1) for j in range(per)]


def tile_dtype(m: int):
  """The dtype of a tile's dot for M activation rows.

  bf16 x bf16 with f32 accumulation (XLA:CPU's fused kernel) where the CPU has bf16 dot
  instructions (x86 AVX-512 BF16 or AMX: `kernels.cpu_flags`) and M >= 2; f32 otherwise.
  Without them XLA widens bf16 in software, and bf16 tiles at prefill rows measured slower
  than f32 tiles (docs/cpu_kernel.md); at M = 1 bf16 tiles measured slower than f32 on every
  CPU. Integer codes and int8 activations are exact in both (|partial sum| < 2**24 by the tile
  plan).
  """
  bf16_dot = bool((kernels.cpu_flags() or frozenset()) & {'avx512_bf16', 'amx_bf16'})
  return jnp.bfloat16 if m > 1 and bf16_dot else jnp.float32


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 5, 6))
def tiled_einsum(xs, ws, out, x, w: QArray, act_kind, out_dtype):
  """`qeinsum` on CPU as a loop over row tiles of the weight (module docstring).

  Jitted as a whole (the spec, activation kind and dtype static): called eagerly, the row loop
  would otherwise be traced and compiled anew on every call (a fresh loop body each time).
  Returns None (decided from shapes alone) when no tile plan fits.
  """
  plan = plan_tiles(xs, ws, out, x.shape, w, act_kind)
  if plan is None:
    return None
  a, k, m, unit, kt = plan.a, plan.k, plan.m, plan.unit, plan.kt
  kept_shape, n = plan.kept_shape, plan.n

  # x -> (M, K) with the contracted axes in the weight's order.
  x2 = jnp.transpose(x, [xs.index(c) for c in plan.x_only + tuple(ws[:a])])
  x2 = x2.reshape(m, k).astype(jnp.float32)
  # M = 1 takes XLA's own matrix-vector loop (f32); M >= 2 bf16 tiles where the CPU multiplies
  # bf16 natively (`tile_dtype`), f32 tiles elsewhere.
  cdt = tile_dtype(m)
  xq = xscale = None
  if act_kind is not None:
    xr = x2.reshape(m, k // unit, unit) if plan.grouped else x2.reshape(m, 1, k)
    xq, xscale = quantize_rows(xr, (2,), act_kind)
    xq = xq.reshape(m, k)
    xscale = xscale.reshape(m, -1)  # (M, K/unit) or (M, 1)
    xin = xq.astype(cdt)
  else:
    xin = x2.astype(cdt)

  lead = n // kept_shape[-1]
  qt = w.qtype
  if qt.packed:
    per = packing.GROUPS[qt.bits][0]
    data2 = w.data.reshape(k, -1)
    nf = packing.packed_length(kept_shape[-1], qt.bits) // packing.GROUPS[qt.bits][1]
    def fields(rows):
      p = rows.reshape(rows.shape[0], lead, -1)
      return [f.reshape(rows.shape[0], -1) for f in packing.unpack_fields(p, qt.bits)]
  else:
    per, nf = 1, kept_shape[-1]
    data2 = w.data.reshape(k, n)
    def fields(rows):
      return [rows]
  s_f = _fields(per_k(w.scale, w, plan), per, nf, kept_shape)
  z_f = _fields(per_k(w.zero_point, w, plan), per, nf, kept_shape)

  def tile_product(start, rows):
    """Per-field (M, Nf) f32 partial products of the tile of weight rows at `start`."""
    size = rows.shape[0]
    xt = lax.dynamic_slice_in_dim(xin, start, size, 1)
    parts = []
    for c, s, z in zip(fields(rows), s_f, z_f):
      if plan.fold:
        gi = start // unit
        s_t = lax.dynamic_slice_in_dim(s, gi, size // unit, 0)[:, None]
        cv = c.reshape(size // unit, unit, -1).astype(jnp.float32)
        if z is not None:
          cv = cv - lax.dynamic_slice_in_dim(z, gi, size // unit, 0)[:, None]
        if act_kind is None:
          cv = cv * s_t
        c = cv.reshape(size, -1)
      p = jnp.dot(xt, c.astype(cdt), preferred_element_type=jnp.float32)
      if act_kind is not None and plan.grouped:  # one group per tile: scale it now
        xs_t = lax.dynamic_slice_in_dim(xscale, start // unit, 1, 1)
        p = p * xs_t * s_t[0]
      elif act_kind == 'int':
        p = p.astype(jnp.int32)  # exact: |partial| < 2**24 by the choice of kt
      parts.append(p)
    return jnp.stack(parts)

  acc_dtype = jnp.int32 if act_kind == 'int' and not plan.grouped else jnp.float32
  acc = jnp.zeros((per, m, lead * nf), acc_dtype)
  n_full = k // kt
  if n_full:
    acc = lax.fori_loop(
        0, n_full,
        lambda i, acc: acc + tile_product(i * kt,
                                          lax.dynamic_slice_in_dim(data2, i * kt, kt, 0)),
        acc)
  if n_full * kt < k:
    acc = acc + tile_product(n_full * kt, data2[n_full * kt:])
  y = _tile_epilogue(acc.astype(jnp.float32), plan, s_f, z_f, xin, xq, xscale, lead, nf, per)
  y_letters = ''.join(plan.x_only) + ws[a:]
  return jnp.transpose(y, [y_letters.index(c) for c in out]).astype(out_dtype)


def _tile_epilogue(acc, plan: TilePlan, s_f, z_f, xin, xq, xscale, lead, nf, per):
  """Scales constant along K applied once, and (per, M, lead * nf) -> (M, kept...)."""
  if not plan.fold:
    if z_f[0] is not None:  # (c - z) . x  =  c . x  -  z * sum(x)
      xsum = jnp.sum(xq.astype(jnp.int32) if plan.act_kind == 'int' else xin, axis=1)
      z = jnp.stack([z[0] for z in z_f])[:, None]
      acc = acc - xsum.astype(jnp.float32)[None, :, None] * z
    if plan.act_kind is not None:
      acc = acc * xscale[None]
    acc = acc * jnp.stack([s[0] for s in s_f])[:, None]
  y = acc.reshape(per, plan.m, lead, nf).transpose(1, 2, 3, 0).reshape(plan.m, lead, nf * per)
  return y[..., :plan.kept_shape[-1]].reshape(plan.m_shape + plan.kept_shape)
