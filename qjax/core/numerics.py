"""The numerics every quantizer shares: scale layout, scales and zero points, codes, checks.

One place for the arithmetic that `qarray`, `calibration`, `fake_quant`, `learned` and the
PTQ algorithms all need, so that each computes a scale, rounds a code and checks a value the
same way (a QAT forward and the model it converts to agree bit for bit because of it).

**Scale layout (tiles).** Scales and zero points have the rank of the data, and a tile of the
data shares one scale: axis i of a tensor of shape `shape` with scales of shape `s` is cut
into `s[i]` tiles of `shape[i] // s[i]` elements, and `shape[i] % s[i] == 0` always holds
(qwix's invariant). Per-tensor scales have shape (1, ..., 1); per-channel along axis i have
`s[i] = shape[i]`; groups of g along axis i have `s[i] = shape[i] // g`. In the *tiled view*
(`tiled`) axis i becomes the pair (s[i], shape[i] // s[i]), so reducing every second axis
gives one value per scale and a scale reshaped by `expand` broadcasts against it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core.formats import FLOAT_KINDS, QFormat, normalize_axis


# ---- axes and layout ----------------------------------------------------------------------
def resolved_axes(fmt: QFormat, ndim: int) -> tuple[tuple[int, ...], int | None]:
  """(sorted channel axes, group axis or None) of `fmt` on a rank-`ndim` tensor, non-negative."""
  channel = tuple(sorted({normalize_axis(a, ndim, f'QFormat.channel_axes={fmt.channel_axes}')
                          for a in fmt.channel_axes}))
  if fmt.group_size is None:
    return channel, None
  ga = normalize_axis(fmt.group_axis, ndim, f'QFormat.group_axis={fmt.group_axis}')
  if ga in channel:
    raise ValueError(f'QFormat: axis {ga} is both the group axis and a channel axis; a scale '
                     'per element is not a quantization. Drop it from channel_axes.')
  return channel, ga


def scale_shape(shape: Sequence[int], fmt: QFormat) -> tuple[int, ...]:
  """Shape of the scales (and zero points) `fmt` gives a tensor of `shape`.

  Raises:
    ValueError: an axis out of range, or a group size that does not divide its axis.
  """
  shape = tuple(int(d) for d in shape)
  channel, ga = resolved_axes(fmt, len(shape))
  out = [d if i in channel else 1 for i, d in enumerate(shape)]
  if ga is not None:
    g, n = fmt.group_size, shape[ga]
    if n % g == 0:
      out[ga] = n // g
    else:
      _flat_groups(shape, g, ga, channel, out)
  return tuple(out)


def _flat_groups(shape, g: int, ga: int, channel, out: list) -> None:
  """Groups of `g` larger than axis `ga`: `g` consecutive elements of the axes up to `ga`
  flattened in row-major order (o_proj's (N, H, D) weight grouped by 128 along N*H when
  H = 64), i.e. whole tiles of `ga` and of the axes between, cutting one earlier axis."""
  n = shape[ga]
  rest, a = g // n if g % n == 0 else 0, ga - 1
  while rest > 1 and a >= 0 and a not in channel:
    if shape[a] % rest == 0:
      out[a], rest = shape[a] // rest, 1
    elif rest % shape[a] == 0:
      rest //= shape[a]
      a -= 1
    else:
      break
  if rest != 1:
    divisors = [d for d in (8, 16, 32, 64, 128, 256, 512, 1024) if n % d == 0]
    raise ValueError(f'QFormat: group_size={g} does not divide axis {ga} of length {n} '
                     f'(shape {shape}), nor is it a run of whole rows of the axes before it '
                     f'(flattened groups must not cross a channel axis {tuple(channel)}); use '
                     f'a divisor of {n} such as {divisors[-3:]} or per-channel scales.')


def tile_shape(shape: Sequence[int], scale_shape_: Sequence[int]) -> tuple[int, ...]:
  """Elements per tile along each axis; raises if the scale shape does not tile `shape`."""
  shape, s = tuple(shape), tuple(scale_shape_)
  if len(s) != len(shape) or any(d % k for d, k in zip(shape, s)) or 0 in s:
    raise ValueError(f'scale shape {s} does not tile data shape {shape}: scales need the '
                     "data's rank and shape[i] % scale.shape[i] == 0 on every axis.")
  return tuple(d // k for d, k in zip(shape, s))


def tiled(x: jax.Array, scale_shape_: Sequence[int]) -> jax.Array:
  """`x` in its tiled view: axis i split into (scale_shape[i], tile[i])."""
  t = tile_shape(x.shape, scale_shape_)
  return x.reshape(tuple(d for pair in zip(scale_shape_, t) for d in pair))


def tile_axes(ndim: int) -> tuple[int, ...]:
  """The within-tile axes of a rank-`ndim` tensor's tiled view (reduce them per scale)."""
  return tuple(range(1, 2 * ndim, 2))


def expand(s: jax.Array) -> jax.Array:
  """A scale-shaped array reshaped to broadcast against the tiled view."""
  return s.reshape(tuple(d for k in s.shape for d in (k, 1)))


def broadcast_scale(s: jax.Array, shape: Sequence[int]) -> jax.Array:
  """A scale-shaped array repeated over its tiles: one value per element of `shape`."""
  t = tile_shape(shape, s.shape)
  return jnp.broadcast_to(expand(s), tuple(d for pair in zip(s.shape, t) for d in pair)
                          ).reshape(tuple(shape))


def first_of_tiles(full: jax.Array, scale_shape_: Sequence[int]) -> jax.Array:
  """One element per tile (its first): the inverse of `broadcast_scale`."""
  t = tile_shape(full.shape, scale_shape_)
  return full[tuple(slice(None, None, k) for k in t)]


# ---- scales, zero points and codes ----------------------------------------------------------
def scale_and_zero_point(lo, hi, fmt: QFormat):
  """Scale (rounded to `fmt.scale_dtype`) and zero point for a per-scale range.

  An all-zero group (lo == hi == 0) gets scale 1 and zero point 0: its codes are 0 and it
  dequantizes to exact zeros, never NaN. A NaN range gives a NaN scale, so NaN propagates
  under jit as it would be reported eagerly. Elementwise: any layout of ranges works.
  Concrete callers check the result with `check_scales`.
  """
  sdt = jnp.dtype(fmt.scale_dtype)
  if fmt.symmetric:
    amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    # Multiply by a host-side reciprocal: XLA may rewrite `/ const` that way under jit, and
    # eager and jitted scales must agree bit for bit (QAT == converted model).
    # `== 0`, not `> 0`: a NaN range must give a NaN scale (the NaN propagates to every
    # dequantized value of its tile), never scale 1 with the tile silently zeroed.
    scale = jnp.where(amax == 0, 1.0, amax * (1.0 / fmt.qmax))
    zp = None
  else:
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)  # keep 0 exactly representable
    span = hi - lo
    scale = jnp.where(span == 0, 1.0, span * (1.0 / (fmt.qmax - fmt.qmin)))
  if fmt.pow2_scale:
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  # Quantize with the scale as stored, so dequantize sees exactly what quantize used.
  scale = scale.astype(sdt)
  if not fmt.symmetric:
    zp = jnp.clip(jnp.round(fmt.qmin - lo / scale.astype(jnp.float32)), fmt.qmin, fmt.qmax)
    zp = zp.astype(sdt)
  return scale, zp


def to_codes(xv, scale, zp, fmt: QFormat):
  """Codes of `xv` (float32) for scales/zero points that broadcast against it."""
  s = scale.astype(jnp.float32)
  if fmt.is_float:
    y = jnp.clip(xv / s, -fmt.qmax, fmt.qmax)  # fp8 e4m3fn has no inf: saturate, don't NaN
    return y.astype(FLOAT_KINDS[fmt.kind])
  q = jnp.round(xv / s)
  if zp is not None:
    q = q + zp.astype(jnp.float32)
  return jnp.clip(q, fmt.qmin, fmt.qmax).astype(jnp.int8)


def from_codes(c, scale, zp, dtype=jnp.float32):
  """`(c - zp) * scale` in `dtype`, for scales/zero points that broadcast against `c`."""
  v = c.astype(jnp.float32)
  if zp is not None:
    v = v - zp.astype(jnp.float32)
  return (v * scale.astype(jnp.float32)).astype(dtype)


def fake_round(x, scale, zp, fmt: QFormat):
  """Quantize-dequantize `x` (float32 result, no straight-through gradient; see fake_quant).

  `scale` / `zp` either broadcast against `x` elementwise or tile it (the scale layout).
  """
  x = jnp.asarray(x, jnp.float32)
  if scale.ndim == x.ndim and not _broadcasts(scale.shape, x.shape):
    xv = tiled(x, scale.shape)
    s, z = expand(scale), None if zp is None else expand(zp)
    return from_codes(to_codes(xv, s, z, fmt), s, z).reshape(x.shape)
  return from_codes(to_codes(x, scale, zp, fmt), scale, zp)


def _broadcasts(s, shape) -> bool:
  return all(a in (1, b) for a, b in zip(s, shape))


# ---- checks -------------------------------------------------------------------------------
def is_concrete(x) -> bool:
  """Whether `x`'s values are known here (not a tracer under jit / grad / vmap)."""
  return not isinstance(x, jax.core.Tracer)


_QUANTIZE_FIX = ('quantization would silently corrupt them. Fix the source tensor (or clip '
                 'it) before quantizing.')


def check_finite(x, what: str, fix: str = _QUANTIZE_FIX) -> None:
  """Raise if a concrete `x` holds NaN or Inf (values under tracing are unknown: skipped).

  The message names `what`, the count, the first bad index and `fix` (what to do about it).
  """
  if x is None or not is_concrete(x):
    return
  bad = ~np.isfinite(np.asarray(x, dtype=np.float32))
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f'{what} holds {int(bad.sum())} NaN/Inf values (first at index {idx}); '
                     f'{fix}')


def check_range(lo, hi, what: str) -> None:
  """Raise if a concrete explicit range holds NaN/Inf or has hi < lo (named, first index)."""
  if not (is_concrete(lo) and is_concrete(hi)):
    return
  lo, hi = np.asarray(lo, np.float32), np.asarray(hi, np.float32)
  bad = ~(np.isfinite(lo) & np.isfinite(hi))
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise ValueError(f'{what}: the range ({lo[i]}, {hi[i]}) at scale index {i} is not finite '
                     '(NaN/Inf); pass finite (lo, hi), e.g. from compute_range.')
  bad = hi < lo
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise ValueError(f'{what}: the range has hi={hi[i]} < lo={lo[i]} at scale index {i}; '
                     'pass (lo, hi) with lo <= hi.')


def check_subnormal(x, scale_shape_: Sequence[int], what: str) -> None:
  """Raise if a concrete `x` has a scale group whose nonzero values are all float32 subnormals.

  XLA flushes subnormals to zero on CPU and GPU, so such a group's range reads as 0 and it
  would quantize to zeros silently (a float16 scale underflow is refused by `check_scales`;
  this is the float32 case of the same loss).
  """
  if not is_concrete(x):
    return
  host = np.abs(np.asarray(x, np.float32))
  tiny = np.finfo(np.float32).tiny
  if not ((host > 0) & (host < tiny)).any():  # the usual case: one pass
    return
  amax = np.max(tiled(host, scale_shape_), axis=tile_axes(host.ndim))
  bad = (amax > 0) & (amax < tiny)
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise ValueError(f'{what}: {int(bad.sum())} scale group(s) hold only float32 subnormal '
                     f'values (the one at scale index {i}: max |x| {amax[i]:.3g} < the '
                     f'smallest normal {tiny:.3g}); the device flushes them to zero, so they '
                     'would quantize to zeros. Rescale the tensor (multiply it by a power of '
                     'two and fold the factor into the next layer) or set them to 0.')


def check_given_scale(scale, what: str) -> None:
  """Raise if concrete caller-given scales are not finite and > 0 (a zero scale zeroes its
  group, a negative one flips its sign, both silently)."""
  if not is_concrete(scale):
    return
  s = np.asarray(scale, np.float32)
  bad = ~(np.isfinite(s) & (s > 0))
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise ValueError(f'{what}: {int(bad.sum())} given scale(s) are not finite and > 0 (the one '
                     f'at index {i} is {s[i]}); pass positive finite scales (e.g. from '
                     'compute_range and scale_and_zero_point), or scale=None to calibrate.')


def check_scales(scale, fmt: QFormat, what: str, lo=None, hi=None) -> None:
  """Raise if concrete scales are not finite and > 0, naming the scale dtype.

  A finite tensor can still overflow its scale (an asymmetric range of +-3e38 spans inf in
  float32; 1e6 / 127 is inf in float16) or underflow it (1e-9 / 127 is 0 in float16): the
  tensor would dequantize to NaN or zeros.

  Args:
    scale: the scales as stored (in `fmt.scale_dtype`).
    fmt: the format.
    what: the tensor, for the message.
    lo, hi: optional range per scale (named in the message; read only on failure).
  """
  if not is_concrete(scale):
    return
  s = np.asarray(scale, np.float32)
  bad = ~(np.isfinite(s) & (s > 0))
  if not bad.any():
    return
  i = tuple(int(j) for j in np.argwhere(bad)[0])
  info = np.finfo(np.dtype(jnp.dtype(fmt.scale_dtype)))
  rng = ('' if lo is None or hi is None else
         f' for the range [{float(np.asarray(lo, np.float32)[i]):.3g}, '
         f'{float(np.asarray(hi, np.float32)[i]):.3g}]')
  if np.isnan(s[i]):
    why = 'NaN (the range holds NaN)'
  elif s[i] == 0:
    why = f'0: it underflows {fmt.scale_dtype} (smallest normal {float(info.tiny):.3g})'
  elif s[i] < 0:
    why = f'{s[i]} (negative)'
  else:
    why = f'inf: it overflows {fmt.scale_dtype} (max {float(info.max):.3g})'
  fix = ('Rescale or clip the tensor' if fmt.scale_dtype == 'float32' else
         "Use scale_dtype='float32', or rescale or clip the tensor")
  raise ValueError(f'{what}: {int(bad.sum())} scale(s) of {fmt.name} are not representable in '
                   f'scale_dtype {fmt.scale_dtype}; the one at index {i} is {why}{rng}. {fix}.')
