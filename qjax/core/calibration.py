"""Range calibration and error metrics, as pure functions.

Every range function works on the *grouped view* of a tensor (`grouped_view`): the group
axis split into (num_groups, group_size), so that reducing over every axis that is neither a
channel axis nor the group index gives one range per scale. Ranges come back with keepdims,
ready to broadcast against the grouped view.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from qjax.core.formats import QFormat, normalize_axis


def grouped_view_shape(shape: Sequence[int], fmt: QFormat) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shape of the grouped view and the axes (in it) that scales reduce over.

  Args:
    shape: the tensor's shape.
    fmt: the format whose granularity to apply.

  Returns:
    (view_shape, reduce_axes).
  """
  ndim = len(shape)
  channel = sorted({normalize_axis(a, ndim, f'QFormat.channel_axes={fmt.channel_axes}')
                    for a in fmt.channel_axes})
  if fmt.group_size is None:
    return tuple(shape), tuple(a for a in range(ndim) if a not in channel)
  ga = normalize_axis(fmt.group_axis, ndim, f'QFormat.group_axis={fmt.group_axis}')
  if ga in channel:
    raise ValueError(f'QFormat: axis {ga} is both the group axis and a channel axis; a scale '
                     'per element is not a quantization. Drop it from channel_axes.')
  g, n = fmt.group_size, shape[ga]
  if n % g:
    divisors = [d for d in (8, 16, 32, 64, 128, 256, 512, 1024) if n % d == 0]
    raise ValueError(f'QFormat: group_size={g} does not divide axis {ga} of length {n} '
                     f'(shape {tuple(shape)}); use a divisor of {n} such as {divisors[-3:]} '
                     'or per-channel scales.')
  view = tuple(shape[:ga]) + (n // g, g) + tuple(shape[ga + 1:])
  keep = {a if a < ga else a + 1 for a in channel} | {ga}
  return view, tuple(a for a in range(ndim + 1) if a not in keep)


def grouped_view(x: jax.Array, fmt: QFormat) -> tuple[jax.Array, tuple[int, ...]]:
  """`x` reshaped to its grouped view, and the axes scales reduce over."""
  view, axes = grouped_view_shape(x.shape, fmt)
  return x.reshape(view), axes


def absmax_range(xv: jax.Array, axes) -> tuple[jax.Array, jax.Array]:
  """Symmetric range [-max|x|, max|x|] per scale."""
  m = jnp.max(jnp.abs(xv), axis=axes, keepdims=True)
  return -m, m


def minmax_range(xv: jax.Array, axes) -> tuple[jax.Array, jax.Array]:
  """Range [min x, max x] per scale."""
  return jnp.min(xv, axis=axes, keepdims=True), jnp.max(xv, axis=axes, keepdims=True)


def _move_to_end(xv, axes):
  keep = [a for a in range(xv.ndim) if a not in axes]
  moved = jnp.transpose(xv, keep + list(axes))
  return moved.reshape(moved.shape[:len(keep)] + (-1,)), keep


def _restore(r, xv, axes):
  shape = [1 if a in axes else xv.shape[a] for a in range(xv.ndim)]
  return r.reshape(shape)


def percentile_range(xv: jax.Array, axes, percentile: float,
                     symmetric: bool = True) -> tuple[jax.Array, jax.Array]:
  """Clip at a percentile of |x| (symmetric) or of x at both tails (asymmetric)."""
  flat, _ = _move_to_end(xv, axes)
  if symmetric:
    m = _restore(jnp.percentile(jnp.abs(flat), percentile, axis=-1), xv, axes)
    return -m, m
  lo = jnp.percentile(flat, 100.0 - percentile, axis=-1)
  hi = jnp.percentile(flat, percentile, axis=-1)
  return _restore(lo, xv, axes), _restore(hi, xv, axes)


def mse_range(xv: jax.Array, axes, fmt: QFormat, num_ratios: int = 20,
              min_ratio: float = 0.3) -> tuple[jax.Array, jax.Array]:
  """MSE-optimal clipping: the ratio of the full range minimizing reconstruction MSE.

  Tries `num_ratios` clip ratios in [min_ratio, 1] per scale and keeps, per scale, the one
  with the lowest mean squared reconstruction error (ratio 1 is always a candidate, so the
  result is never worse than absmax/minmax).
  """
  from qjax.core.qarray import scale_and_zero_point, fake_round  # pylint: disable=g-import-not-at-top
  lo0, hi0 = absmax_range(xv, axes) if fmt.symmetric else minmax_range(xv, axes)
  best_err = best_lo = best_hi = None
  for r in jnp.linspace(min_ratio, 1.0, num_ratios):
    lo, hi = lo0 * r, hi0 * r
    scale, zp = scale_and_zero_point(lo, hi, fmt)
    err = jnp.mean((fake_round(xv, scale, zp, fmt) - xv) ** 2, axis=axes, keepdims=True)
    if best_err is None:
      best_err, best_lo, best_hi = err, lo, hi
    else:
      better = err < best_err
      best_err = jnp.where(better, err, best_err)
      best_lo = jnp.where(better, lo, best_lo)
      best_hi = jnp.where(better, hi, best_hi)
  return best_lo, best_hi


def compute_range(x: jax.Array, fmt: QFormat,
                  method: Optional[str] = None) -> tuple[jax.Array, jax.Array]:
  """Per-scale (lo, hi) of `x` in its grouped view, by `method` (default `fmt.calibration`)."""
  method = method or fmt.calibration
  xv, axes = grouped_view(x.astype(jnp.float32), fmt)
  if method in ('absmax', 'minmax'):  # the full range: |x| for symmetric, [min, max] otherwise
    return absmax_range(xv, axes) if fmt.symmetric else minmax_range(xv, axes)
  if method == 'percentile':
    return percentile_range(xv, axes, fmt.calibration_arg, fmt.symmetric)
  if method == 'mse':
    return mse_range(xv, axes, fmt, int(fmt.calibration_arg or 20))
  raise ValueError(f'compute_range: unknown method {method!r}; use absmax, minmax, '
                   'percentile or mse.')


# ---- error metrics ------------------------------------------------------------------------
def max_abs_error(x, x_hat) -> jax.Array:
  return jnp.max(jnp.abs(x.astype(jnp.float32) - x_hat.astype(jnp.float32)))


def mse(x, x_hat) -> jax.Array:
  return jnp.mean((x.astype(jnp.float32) - x_hat.astype(jnp.float32)) ** 2)


def sqnr_db(x, x_hat) -> jax.Array:
  """Signal-to-quantization-noise ratio 10 log10(sum x^2 / sum (x - x_hat)^2), in dB."""
  x = x.astype(jnp.float32)
  noise = jnp.sum((x - x_hat.astype(jnp.float32)) ** 2)
  return 10.0 * jnp.log10(jnp.sum(x ** 2) / jnp.maximum(noise, 1e-30))
