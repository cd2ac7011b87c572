"""Fake quantization with the straight-through estimator (STE): the one place it lives.

`fake_quant(x, fmt)` returns `dequantize(quantize(x, fmt))` in the forward pass, bit for bit,
and in the backward pass the gradient with respect to `x` is the identity inside the clip
range and zero outside it. When a scale (and zero point) is passed in as a traced value, the
gradient with respect to it is LSQ's (Esser et al. 2020): `round(v) - v` inside the range and
the clip bound `qmin - z` or `qmax - z` outside, for `v = x / s + z`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax.core import calibration as calib
from qjax.core.formats import FLOAT_KINDS, QFormat
from qjax.core.qarray import RangeArg, _negative_axes, scale_and_zero_point


def round_ste(v: jax.Array, fmt: QFormat) -> jax.Array:
  """Round to the format's grid in the forward pass; identity gradient."""
  if fmt.is_float:
    r = v.astype(FLOAT_KINDS[fmt.kind]).astype(v.dtype)
  else:
    r = jnp.round(v)
  return v + jax.lax.stop_gradient(r - v)


def fake_quant_view(xv, scale, zero_point, fmt: QFormat) -> jax.Array:
  """STE quantize-dequantize in the grouped view with given scale and zero point."""
  s = scale.astype(jnp.float32)
  z = 0.0 if zero_point is None else zero_point.astype(jnp.float32)
  v = xv / s + z
  # The clip is the zero gradient outside the range; the range's ends count as inside.
  inside = (v >= fmt.qmin) & (v <= fmt.qmax)
  v = jnp.where(inside, v, jnp.clip(v, fmt.qmin, fmt.qmax))
  return (round_ste(v, fmt) - z) * s


def fake_quant(x: jax.Array, fmt: QFormat, calibration: RangeArg = None,
               scale: Optional[jax.Array] = None,
               zero_point: Optional[jax.Array] = None) -> jax.Array:
  """Quantize-dequantize `x` with a straight-through gradient.

  Args:
    x: float tensor.
    fmt: the format (granularity as for `quantize`).
    calibration: as for `quantize` (ignored when `scale` is given).
    scale: optional scale in the grouped view (e.g. a learned LSQ parameter); when None it is
      computed from `x` and treated as a constant (stop_gradient).
    zero_point: optional zero point (asymmetric formats), as `scale`.

  Returns:
    Array of x's shape and dtype, equal to `dequantize(quantize(x, fmt))` when the scale is
    the calibrated one.
  """
  fmt = _negative_axes(fmt, x.ndim)
  xv, _ = calib.grouped_view(x.astype(jnp.float32), fmt)
  if scale is None:
    if isinstance(calibration, tuple):
      lo, hi = calibration
    else:
      lo, hi = calib.compute_range(jax.lax.stop_gradient(x), fmt, calibration)
    scale, zero_point = jax.lax.stop_gradient(scale_and_zero_point(lo, hi, fmt))
  elif fmt.symmetric:
    zero_point = None
  return fake_quant_view(xv, scale, zero_point, fmt).reshape(x.shape).astype(x.dtype)
