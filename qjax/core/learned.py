"""Learned quantization parameters (LSQ step sizes and zero points, PACT clips): the one place
their math lives.

A learned pair (scale, zero point) is a raw trainable value; the forward and the converted
model use `learned_qparams` of it: the step size kept positive, the zero point rounded
(straight-through) to a code, and the scale mapped through `scale_and_zero_point` of its
`learned_range` (or to a power of two), i.e. exactly what `quantize` stores for that range.
`conversion_range` inverts this: a range from which `quantize` recomputes the learned scales
bit for bit. `init_learned` goes the other way at the start of QAT.

Scales here are laid out as `compute_range` / `QArray.scale` hold them (the data's rank, one
per tile); the math is elementwise.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core.calibration import compute_range
from qjax.core.fake_quant import fake_quant, round_ste
from qjax.core.formats import QFormat
from qjax.core.numerics import scale_and_zero_point, scale_shape
from qjax.core.qarray import QArray

MIN_SCALE = 1e-12  # a learned step size never reaches 0 (or flips sign)
_ROUND = QFormat()  # an integer format: `round_ste` rounds to integers under it

# Ulp steps tried (in order) when inverting a scale to a range: `amax * (1/qmax)` may land an
# ulp off, and a power-of-two scale must not round up to the next power.
ULP_STEPS = (0,) + tuple(k * sign for k in range(1, 33) for sign in (-1, 1))


def _positive_integer(scale, zero_point, fmt: QFormat):
  """A learned step size kept positive; a learned zero point rounded (STE) into [qmin, qmax]."""
  s = jnp.maximum(scale.astype(jnp.float32), MIN_SCALE)
  if fmt.symmetric or zero_point is None:
    return s, None
  return s, jnp.clip(round_ste(zero_point.astype(jnp.float32), _ROUND), fmt.qmin, fmt.qmax)


def learned_range(scale, zero_point, fmt: QFormat):
  """The range (lo, hi) a learned step size s and zero point z span: +-qmax s, or (q - z) s.

  Args:
    scale: raw learned step sizes.
    zero_point: raw learned zero points (asymmetric formats), or None.
    fmt: the weight format.

  Returns:
    (lo, hi) float32 arrays of the scale's shape.
  """
  s, z = _positive_integer(scale, zero_point, fmt)
  if z is None:
    return -s * fmt.qmax, s * fmt.qmax
  return (fmt.qmin - z) * s, (fmt.qmax - z) * s


def learned_qparams(scale, zero_point, fmt: QFormat):
  """The (scale, zero point) a learned pair stands for: what the forward uses and stores.

  The zero point is rounded (straight-through) to a code in [qmin, qmax]. A `pow2_scale`
  step size becomes the power of two nearest in log2 (straight-through). Any other is
  mapped through the core's `scale_and_zero_point` of its `learned_range`: the arithmetic
  `quantize` applies to that range at conversion, so the stored scale is the one trained.

  Args:
    scale: raw learned step sizes.
    zero_point: raw learned zero points (asymmetric formats), or None.
    fmt: the weight format.

  Returns:
    (scale, zero point or None), float32, differentiable in the raw values.
  """
  s, z = _positive_integer(scale, zero_point, fmt)
  if fmt.pow2_scale:
    s = jnp.exp2(round_ste(jnp.log2(s), _ROUND))
    return s.astype(jnp.dtype(fmt.scale_dtype)).astype(jnp.float32), z
  lo, hi = learned_range(scale, zero_point, fmt)
  s = scale_and_zero_point(lo, hi, fmt)[0].astype(jnp.float32)
  if z is not None:  # the core's zero point for that range, with a straight-through gradient
    z = jnp.clip(round_ste(fmt.qmin - jnp.minimum(lo, 0.0) / s, _ROUND), fmt.qmin, fmt.qmax)
  return s, z


def learned_fake_quant(x: jax.Array, fmt: QFormat, scale, zero_point=None) -> jax.Array:
  """`fake_quant(x, fmt)` with a learned pair: STE for x, LSQ gradients for the pair.

  Args:
    x: the float tensor (a weight).
    fmt: its resolved format.
    scale: raw learned step sizes (the shape `compute_range` gives for `fmt`).
    zero_point: raw learned zero points (asymmetric formats), or None.

  Returns:
    x's fake-quantized value, its shape and dtype.
  """
  s, z = learned_qparams(scale, zero_point, fmt)
  return fake_quant(x, fmt, scale=s, zero_point=z)


def pact_clip(x: jax.Array, clip) -> jax.Array:
  """PACT (Choi et al. 2018): x clipped to [-a, a]; the gradient reaches `a` where x clips."""
  a = jnp.asarray(clip).astype(x.dtype)
  return jnp.clip(x, -a, a)


def step_ulps(x: np.ndarray, k: int) -> np.ndarray:
  """`x` moved `k` float32 ulps (up for k > 0, down for k < 0)."""
  for _ in range(abs(k)):
    x = np.nextafter(x, np.float32(np.inf if k > 0 else -np.inf)).astype(np.float32)
  return x


def raw_for(scale, zero_point, fmt: QFormat):
  """Raw learned values whose `learned_qparams` are (scale, zero_point), where floats allow.

  Args:
    scale: positive scales (e.g. a QArray's, or `scale_and_zero_point` of a range).
    zero_point: their zero points, or None.
    fmt: the format.

  Returns:
    (raw scale, zero point): each raw scale is the target moved by the fewest ulps (in
    `ULP_STEPS` order) that reproduce it, or the target itself if none does.
  """
  target = np.asarray(scale, np.float32)
  raw, todo = target.copy(), np.ones(target.shape, bool)
  for k in ULP_STEPS:
    cand = step_ulps(target, k)
    got = np.asarray(learned_qparams(jnp.asarray(cand), zero_point, fmt)[0])
    take = todo & (got == target)
    raw, todo = np.where(take, cand, raw), todo & ~take
    if not todo.any():
      break
  return jnp.asarray(raw), zero_point


def init_learned(w: jax.Array, fmt: QFormat, init: Union[None, str, tuple, QArray] = None
                 ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Raw learned (scale, zero point) to start LSQ from, for the weight `w` in `fmt`.

  Args:
    w: the float weight.
    fmt: its resolved format.
    init: None (the format's calibration of `w`), a calibration method name ('absmax',
      'mse', ...), a precomputed range (lo, hi) shaped as `compute_range` returns, or a
      QArray of `w` whose scales (and zero points) to start from.

  Returns:
    (scale, zero point or None), float32, such that `learned_qparams` reproduces the initial
    scales where float rounding allows (`raw_for`).
  """
  if isinstance(init, QArray):
    scale, zp = init.scale, init.zero_point
  else:
    lo, hi = init if isinstance(init, tuple) else compute_range(w, fmt, init)
    scale, zp = scale_and_zero_point(jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32),
                                     fmt)
    want = scale_shape(w.shape, fmt)
    if tuple(scale.shape) != want:
      raise ValueError(f'init_learned: the range given for a {fmt.name} weight of shape '
                       f'{tuple(w.shape)} has shape {tuple(scale.shape)}, expected {want} (the '
                       'scale layout: the weight\'s rank, one value per tile, as compute_range '
                       'returns).')
  scale, zp = raw_for(scale, zp, fmt)
  return scale.astype(jnp.float32), None if zp is None else jnp.asarray(zp, jnp.float32)


def range_for(scale, zero_point, fmt: QFormat) -> tuple[jax.Array, jax.Array]:
  """A (lo, hi) that `scale_and_zero_point` maps back to exactly (scale, zero_point).

  Args:
    scale: positive scales, representable in `fmt.scale_dtype` (and powers of two for
      `pow2_scale` formats), e.g. from `learned_qparams`.
    zero_point: integer zero points in [qmin, qmax] (asymmetric formats), or None.
    fmt: the format.

  Returns:
    (lo, hi) float32 arrays of the scale's shape.
  """
  s = np.asarray(scale, np.float32)
  z = None if fmt.symmetric else np.asarray(zero_point, np.float32)
  if fmt.symmetric:
    lo0, hi0 = -s * np.float32(fmt.qmax), s * np.float32(fmt.qmax)
  else:
    lo0, hi0 = (np.float32(fmt.qmin) - z) * s, (np.float32(fmt.qmax) - z) * s
  # Move the end that sets the span (the larger in magnitude), an ulp at a time.
  move_hi = hi0 >= -lo0
  lo, hi = lo0.copy(), hi0.copy()
  todo = np.ones(s.shape, bool)
  for k in ULP_STEPS:
    if fmt.symmetric:
      c_hi = step_ulps(hi0, k)
      c_lo = -c_hi
    else:
      c_hi = np.where(move_hi, step_ulps(hi0, k), hi0)
      c_lo = np.where(move_hi, lo0, step_ulps(lo0, -k))
    got_s, got_z = scale_and_zero_point(jnp.asarray(c_lo), jnp.asarray(c_hi), fmt)
    ok = np.asarray(got_s, np.float32) == s
    if z is not None:
      ok &= np.asarray(got_z, np.float32) == z
    take = todo & ok
    lo, hi = np.where(take, c_lo, lo), np.where(take, c_hi, hi)
    todo &= ~ok
    if not todo.any():
      return jnp.asarray(lo), jnp.asarray(hi)
  raise ValueError(f'range_for: {int(todo.sum())} {fmt.name} scale(s) have no range that '
                   f'reproduces them (e.g. {s[todo][:3]}); scales must be positive, finite and '
                   f'representable in {fmt.scale_dtype} (pass them through learned_qparams).')


def conversion_range(scale, zero_point, fmt: QFormat) -> tuple[jax.Array, jax.Array]:
  """A (lo, hi) from which `quantize` recomputes exactly `learned_qparams(scale, zero_point)`.

  Non-power-of-two scales: the `learned_range` the forward itself mapped through
  `scale_and_zero_point`; powers of two: `range_for`. Either way checked here.

  Args:
    scale: raw learned step sizes.
    zero_point: raw learned zero points (asymmetric formats), or None.
    fmt: the weight format.

  Returns:
    (lo, hi) float32 arrays of the scale's shape.
  """
  s, z = learned_qparams(scale, zero_point, fmt)
  if fmt.pow2_scale:
    return range_for(s, z, fmt)
  lo, hi = learned_range(scale, zero_point, fmt)
  got_s, got_z = scale_and_zero_point(lo, hi, fmt)
  if not (np.array_equal(np.asarray(got_s, np.float32), np.asarray(s))
          and (z is None or np.array_equal(np.asarray(got_z, np.float32), np.asarray(z)))):
    raise RuntimeError(f'conversion_range: quantize would not reproduce the learned {fmt.name} '
                       'scales from their range; this is a bug, please report it.')
  return lo, hi
