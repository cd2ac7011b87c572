"""Quantized matmul: `qeinsum(spec, x, w)` with a QArray weight.

Compute paths (`path=`):

* `'dequant'`: `einsum(x, dequantize(w))` in the activation dtype. Exact weight-only
  semantics. On GPU/TPU XLA fuses the int->float convert into the matmul's operand load, so
  no float weight is materialised there; on XLA:CPU it is (a full f32 copy of the weight per
  call: 2-20x f32 time), so it is never the CPU default.
* `'tiled'` (CPU): weight-only semantics computed as a `fori_loop` over row tiles of the
  weight (its contracted axes, ~1M elements and at most 1/8 of the weight per tile, whole
  groups). Each tile's codes are unpacked as separate bit fields (`packing.unpack_fields`,
  no interleaving), dequantized (or, when scales are constant along the contraction, left as
  codes and scaled once after the loop), and multiplied by the matching activation columns:
  bf16 x bf16 with f32 accumulation for M >= 2 rows (XLA:CPU's fused kernel), f32 at M = 1
  (XLA's own matrix-vector loop, which would widen a bf16 operand anyway). The float tile
  lives in cache; temp memory is one tile, never a float copy of the weight. Error vs the
  exact dequantized product: bf16 rounding of x and of the tile, ~52 dB SQNR at M >= 2;
  exact up to summation order at M = 1.
* `'int8'`: activations quantized on the fly to int8, symmetric, one scale per token and per
  weight group (per token when ungrouped; the same idea as llama.cpp's Q8 activation blocks),
  multiplied with the integer codes with an exact integer accumulator, then rescaled (and
  zero-point corrected) in f32. This is W8A8 when `act_fmt=int8` is requested. On CPU it
  runs tiled as above: int8 values are exact in bf16, so a bf16 x bf16 -> f32 tile dot is an
  exact integer dot as long as |partial sum| < 2**24; tiles are at most 2**24 / (127 * max
  |code|) rows (1032 for int8 codes) and partial sums are carried in int32, so the result
  equals `dot_general(int8, int8, preferred_element_type=int32)` bit for bit. Grouped
  weights take one group per tile and apply that group's scales to its partial sum.
  Elsewhere it is that `dot_general` on the whole operands.
* `'fp8'`: activations quantized per token to the weight's fp8 kind, fp8 x fp8 products with
  f32 accumulation (tiled on CPU: fp8 values are exact in bf16).

`path='auto'` picks: the activation format's path if one is given (`'int8'` / `'fp8'`);
otherwise `'tiled'` on CPU for every weight format and `'dequant'` elsewhere. The choice is a
function of (format, backend) only, so it is recorded in conversion records via
`choose_path`.

Why, on XLA:CPU (2-core AMD EPYC, 4096x4096 weight, time / f32 time, measured side by side
by benchmarks/qdot_bench.py under a noisy load of 3-12):

* XLA:CPU's fused dot kernel (YNNPACK) re-packs its weight operand every call, and does not
  fuse an int->float convert into the dot, so "dequantize then dot" writes a full float copy
  (int8 dequant 2-8x, int4 g128 2.5-9x f32). A plain int8 x int8 -> int32 dot reads the codes
  directly but gains little (W8A8 0.8-0.95x at M = 8..64, ~1.5-2x at M = 1 padded to 2 rows),
  and a grouped one needs the group as a batch dimension, which XLA:CPU runs slowly (int4
  g128 via the batched int8 einsum: 8-17x). Interleaving unpacked 4-bit codes back into one
  array costs ~2x an f32 matrix-vector product by itself.
* Tiling keeps the dequantized tile in cache and gives each tile dot a small weight to pack.
  Three benchmark runs at load 7-10 (M = 1 / 8 / 64): int8 weight-only 0.9-1.1x / 0.45-0.7x
  / 0.35-0.8x; int4 g128 0.9-1.4x / 0.6-1.1x / 0.4-0.85x; W8A8 1.05-1.5x / 0.42-0.56x /
  0.32-0.46x. Tiles of 128-512 rows measured alike; bf16 tiles at M = 1 (padded to 2 rows)
  were slower than f32 tiles.
* Specs the tiled form cannot express (batch axes shared by x, w and out; weight axes not
  ordered contracted-then-kept; groups not on the last contracted axis; a scale per weight
  element) fall back to the whole-operand implementations ('dequant' for 'tiled').
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from qjax.core import packing
from qjax.core.formats import FLOAT_KINDS, QFormat
from qjax.core.qarray import QArray, QType, dequantize

PATHS = ('auto', 'dequant', 'tiled', 'int8', 'fp8')
INT8_ACT = QFormat(bits=8)


def choose_path(w_fmt: Union[QFormat, QType], act_fmt: Optional[QFormat] = None,
                backend: Optional[str] = None) -> str:
  """The compute path `path='auto'` takes for this weight format (or code type, `q.qtype`),
  activation format and backend."""
  backend = backend or jax.default_backend()
  if act_fmt is not None:
    if w_fmt.is_float != act_fmt.is_float:
      raise ValueError(f'qeinsum: weights {w_fmt.name} and activations {act_fmt.name} mix '
                       'integer and float codes; use both int or both fp8.')
    return 'fp8' if act_fmt.is_float else 'int8'
  if backend == 'cpu':
    return 'tiled'
  return 'dequant'


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


def _fresh_letter(used: str) -> str:
  return next(c for c in string.ascii_letters if c not in used)


def _quantize_rows(x, reduce_axes, act_kind):
  """Symmetric per-row quantization of activations (rows = all non-reduced axes)."""
  amax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
  if act_kind == 'int':
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale
  dt = FLOAT_KINDS[act_kind]
  fmax = float(jnp.finfo(dt).max)
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  return jnp.clip(x / scale, -fmax, fmax).astype(dt), scale


def qeinsum(spec: str, x: jax.Array, w: Union[jax.Array, QArray], *,
            act_fmt: Optional[QFormat] = None, path: str = 'auto',
            out_dtype=None) -> jax.Array:
  """Einsum of float activations with a (possibly quantized) weight.

  Args:
    spec: two-operand einsum with explicit output, activations first, e.g. 'BTD,DNH->BTNH'.
    x: float activations.
    w: weight, a float array (plain einsum) or a QArray.
    act_fmt: activation format for W8A8 / fp8 x fp8 (only its kind matters: activations are
      always quantized dynamically, symmetric, per token and weight group), or None for
      weight-only.
    path: 'auto', 'dequant', 'tiled', 'int8' or 'fp8' (see the module docstring).
    out_dtype: result dtype (default: x's dtype).

  Returns:
    The einsum result, `out_dtype`.
  """
  out_dtype = out_dtype or x.dtype
  if not isinstance(w, QArray):
    return jnp.einsum(spec, x, w.astype(x.dtype)).astype(out_dtype)
  if path not in PATHS:
    raise ValueError(f'qeinsum: path={path!r} is unknown; use one of {PATHS}.')
  xs, ws, out = parse_spec(spec)
  if len(ws) != w.ndim or len(xs) != x.ndim:
    raise ValueError(f'qeinsum: spec {spec!r} has operands of rank {len(xs)} and {len(ws)} but '
                     f'got x{tuple(x.shape)} and w{w.shape}.')
  qt = w.qtype
  if path == 'auto':
    path = choose_path(qt, act_fmt)
  if path == 'tiled':
    y = _tiled_einsum(xs, ws, out, x, w, None, out_dtype)
    if y is not None:
      return y
    path = 'dequant'  # a spec the tiled form cannot express
  if path == 'dequant':
    return jnp.einsum(spec, x, dequantize(w, x.dtype)).astype(out_dtype)
  if path == 'int8' and qt.is_float or path == 'fp8' and not qt.is_float:
    raise ValueError(f'qeinsum: path={path!r} cannot multiply {qt.name} weights; use '
                     f"path='{'fp8' if qt.is_float else 'int8'}' or 'dequant'.")
  if jax.default_backend() == 'cpu':
    y = _tiled_einsum(xs, ws, out, x, w, 'int' if path == 'int8' else qt.kind, out_dtype)
    if y is not None:
      return y
  return _integer_like_einsum(xs, ws, out, x, w, path, out_dtype)


def _integer_like_einsum(xs, ws, out, x, w: QArray, path, out_dtype):
  """'int8' / 'fp8' as one dot on the whole operands (non-CPU, and specs tiling can't express)."""
  contracted = [c for c in ws if c in xs and c not in out]
  tiles, sshape = w.tile_shape, w.scale.shape
  along_k = [i for i, c in enumerate(ws) if c in contracted and sshape[i] > 1]
  cut_kept = [i for i, c in enumerate(ws) if c not in contracted and 1 < tiles[i] < w.shape[i]]
  if len(along_k) > 1 or cut_kept or (along_k and tiles[along_k[0]] == 1):
    # A scale that varies along a contracted axis other than by groups cannot be applied
    # after the dot; take the exact dequantize path rather than a wrong answer.
    return jnp.einsum(f'{xs},{ws}->{out}', x, dequantize(w, x.dtype)).astype(out_dtype)
  codes, s_letters = w.codes(), ws
  if along_k:  # groups along one contracted axis: the group index becomes a batch axis
    ga = along_k[0]
    gl, ng, gs = ws[ga], sshape[ga], tiles[ga]
    g = _fresh_letter(xs + ws + out)
    wv, s_letters = ws[:ga] + g + ws[ga:], ws[:ga] + g + ws[ga + 1:]
    codes = codes.reshape(w.shape[:ga] + (ng, gs) + w.shape[ga + 1:])
    xi = xs.index(gl)
    xv = xs[:xi] + g + xs[xi:]
    x = x.reshape(x.shape[:xi] + (ng, gs) + x.shape[xi + 1:])
    acc_l = out + g
  else:
    wv, xv, acc_l = ws, xs, out
  squeeze = tuple(i for i, d in enumerate(sshape) if d == 1)
  kept = ''.join(c for i, c in enumerate(s_letters) if i not in squeeze)

  # Pad batch-1 to two rows on CPU (see module docstring).
  x_only = [i for i, c in enumerate(xv) if c not in wv]
  pad_axis = None
  if jax.default_backend() == 'cpu' and x_only and all(x.shape[i] == 1 for i in x_only):
    pad_axis = x_only[0]
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=pad_axis)

  x_reduce = tuple(i for i, c in enumerate(xv) if c in contracted)
  act_kind = 'int' if path == 'int8' else w.qtype.kind
  xq, xscale = _quantize_rows(x.astype(jnp.float32), x_reduce, act_kind)
  acc_dtype = jnp.int32 if path == 'int8' else jnp.float32
  acc = jnp.einsum(f'{xv},{wv}->{acc_l}', xq, codes, preferred_element_type=acc_dtype)
  acc = acc.astype(jnp.float32)

  xs_l = ''.join(c for c in xv if c not in contracted)
  xscale = jnp.squeeze(xscale, axis=x_reduce)
  scale = jnp.squeeze(w.scale.astype(jnp.float32), axis=squeeze)
  if w.zero_point is not None:
    # (c - z) . x  =  c . x  -  z * sum(x) over each group's contracted elements.
    xsum = jnp.sum(xq.astype(jnp.int32), axis=x_reduce).astype(jnp.float32)
    zp = jnp.squeeze(w.zero_point.astype(jnp.float32), axis=squeeze)
    acc = acc - jnp.einsum(f'{xs_l},{kept}->{acc_l}', xsum, zp)
  y = jnp.einsum(f'{acc_l},{xs_l},{kept}->{out}', acc, xscale, scale)
  if pad_axis is not None:
    y = jax.lax.slice_in_dim(y, 0, 1, axis=out.index(xv[pad_axis]))
  return y.astype(out_dtype)


# ---- the tiled CPU path: a plan, a per-tile product, an epilogue ------------------------------
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


def _canonical(xs, ws, out) -> Optional[int]:
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
  a = _canonical(xs, ws, out)
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
  # Tile rows: ~_TILE_ELEMENTS per tile in whole groups; one group per tile when activation
  # scales are per group; few enough rows that integer partial sums are exact in f32.
  if act_kind is not None and grouped:
    kt = unit
  else:
    # At most ~1/8 of the weight per tile, so no tile is a float copy of the whole weight.
    rows = max(_MIN_TILE_ROWS, min(_TILE_ELEMENTS // n, k // 8))
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


def _per_k(arr, w: QArray, plan: TilePlan):
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


def _tiled_einsum(xs, ws, out, x, w: QArray, act_kind, out_dtype):
  """`qeinsum` on CPU as a loop over row tiles of the weight (module docstring)."""
  plan = plan_tiles(xs, ws, out, x.shape, w, act_kind)
  if plan is None:
    return None
  a, k, m, unit, kt = plan.a, plan.k, plan.m, plan.unit, plan.kt
  kept_shape, n = plan.kept_shape, plan.n

  # x -> (M, K) with the contracted axes in the weight's order.
  x2 = jnp.transpose(x, [xs.index(c) for c in plan.x_only + tuple(ws[:a])])
  x2 = x2.reshape(m, k).astype(jnp.float32)
  # M = 1 takes XLA's own matrix-vector loop (f32); M >= 2 the fused bf16 kernel (bf16 x bf16 with
  # f32 accumulation needs no weight copy there; at M = 1 bf16 tiles measured slower than f32).
  cdt = jnp.float32 if m == 1 else jnp.bfloat16
  xq = xscale = None
  if act_kind is not None:
    xr = x2.reshape(m, k // unit, unit) if plan.grouped else x2.reshape(m, 1, k)
    xq, xscale = _quantize_rows(xr, (2,), act_kind)
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
  s_f = _fields(_per_k(w.scale, w, plan), per, nf, kept_shape)
  z_f = _fields(_per_k(w.zero_point, w, plan), per, nf, kept_shape)

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


def qdot(x: jax.Array, w: Union[jax.Array, QArray], **kw) -> jax.Array:
  """`x @ w` for a 2-d weight (contracting x's last axis with w's first), via `qeinsum`."""
  letters = string.ascii_lowercase[:x.ndim - 1]
  return qeinsum(f'{letters}y,yz->{letters}z', x, w, **kw)
