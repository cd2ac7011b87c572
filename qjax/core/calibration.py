"""Range calibration and error metrics, as pure functions.

`compute_range(x, fmt)` returns (lo, hi) in the scale layout (`numerics.scale_shape`: the
data's rank, one value per tile). The range functions below work on the tiled view
(`numerics.tiled`) and reduce its within-tile axes with keepdims.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax.core import numerics
from qjax.core.formats import QFormat


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
  if isinstance(num_ratios, bool) or not float(num_ratios).is_integer() or num_ratios < 2:
    raise ValueError(f'mse_range: num_ratios={num_ratios!r} must be an integer >= 2 (the clip '
                     'ratios tried; e.g. 20).')
  if not 0.0 < min_ratio < 1.0:
    raise ValueError(f'mse_range: min_ratio={min_ratio!r} must be in (0, 1) (the smallest '
                     'fraction of the full range tried as a clip; e.g. 0.3).')
  num_ratios = int(num_ratios)
  lo0, hi0 = absmax_range(xv, axes) if fmt.symmetric else minmax_range(xv, axes)
  best_err = best_lo = best_hi = None
  for r in jnp.linspace(min_ratio, 1.0, num_ratios):
    lo, hi = lo0 * r, hi0 * r
    scale, zp = numerics.scale_and_zero_point(lo, hi, fmt)
    codes = numerics.to_codes(xv, scale, zp, fmt)
    err = jnp.mean((numerics.from_codes(codes, scale, zp) - xv) ** 2, axis=axes, keepdims=True)
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
  """Per-scale (lo, hi) of `x`, shaped `scale_shape(x.shape, fmt)`, by `method`.

  Args:
    x: the tensor.
    fmt: its format (granularity and, by default, the calibration method).
    method: None (`fmt.calibration`), 'absmax' / 'minmax', 'percentile' or 'mse'.
  """
  method = method or fmt.calibration
  sshape = numerics.scale_shape(x.shape, fmt)
  xv = numerics.tiled(jnp.asarray(x, jnp.float32), sshape)
  axes = numerics.tile_axes(x.ndim)
  if method in ('absmax', 'minmax'):  # the full range: |x| for symmetric, [min, max] otherwise
    lo, hi = absmax_range(xv, axes) if fmt.symmetric else minmax_range(xv, axes)
  elif method == 'percentile':
    lo, hi = percentile_range(xv, axes, fmt.calibration_arg, fmt.symmetric)
  elif method == 'mse':
    lo, hi = mse_range(xv, axes, fmt, int(fmt.calibration_arg or 20))
  else:
    raise ValueError(f'compute_range: unknown method {method!r}; use absmax, minmax, '
                     'percentile or mse.')
  return lo.reshape(sshape), hi.reshape(sshape)


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
