"""Fake quantization with the straight-through estimator (STE): the one place it lives.

`fake_quant(x, fmt)` returns `dequantize(quantize(x, fmt))` in the forward pass, bit for bit,
and in the backward pass the gradient with respect to `x` is the identity inside the clip
range and zero outside it. When a scale (and zero point) is passed in as a traced value, the
gradient with respect to it is LSQ's (Esser et al. 2020): `round(v) - v` inside the range and
the clip bound `qmin - z` or `qmax - z` outside, for `v = x / s + z`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core import calibration as calib
from qjax.core import numerics
from qjax.core.formats import FLOAT_KINDS, QFormat
from qjax.core.qarray import RangeArg, check_input


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_ste(v: jax.Array, fmt: QFormat) -> jax.Array:
  """Round to the format's grid in the forward pass (exactly); identity gradient."""
  if fmt.is_float:
    return v.astype(FLOAT_KINDS[fmt.kind]).astype(v.dtype)
  return jnp.round(v)


@round_ste.defjvp
def _round_ste_jvp(fmt, primals, tangents):
  # A custom JVP rather than `v + stop_gradient(round(v) - v)`: that sum is not exactly
  # round(v) in floating point, and QAT must be bit-identical to the converted model.
  (v,), (dv,) = primals, tangents
  return round_ste(v, fmt), dv


def fake_quant_view(xv, scale, zero_point, fmt: QFormat) -> jax.Array:
  """STE quantize-dequantize of `xv` with scales (and zero points) that broadcast against it
  (e.g. the tiled view `numerics.tiled` with `numerics.expand`ed scales)."""
  s = scale.astype(jnp.float32)
  z = 0.0 if zero_point is None else zero_point.astype(jnp.float32)
  v = xv / s + z
  # The clip is the zero gradient outside the range. The ends count as inside, with a
  # 1e-3-code tolerance: the absmax element lands at qmax only up to float rounding of the
  # scale, and it must not lose its gradient for that.
  inside = (v >= fmt.qmin - 1e-3) & (v <= fmt.qmax + 1e-3)
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
    scale: optional scales in the scale layout (`compute_range`'s shape; e.g. a learned LSQ
      parameter); when None they are computed from `x` and treated as constants
      (stop_gradient).
    zero_point: optional zero point (asymmetric formats), as `scale`.

  Returns:
    Array of x's shape and dtype, equal to `dequantize(quantize(x, fmt))` when the scale is
    the calibrated one.
  """
  check_input(x, 'fake_quant', fmt)
  if scale is None:
    numerics.check_subnormal(x, numerics.scale_shape(x.shape, fmt),
                             f'fake_quant({fmt.name}, shape={x.shape})')
    if isinstance(calibration, tuple):
      lo, hi = calibration
      numerics.check_range(lo, hi, f'fake_quant({fmt.name}, shape={x.shape})')
    else:
      lo, hi = calib.compute_range(jax.lax.stop_gradient(x), fmt, calibration)
    scale, zero_point = jax.lax.stop_gradient(numerics.scale_and_zero_point(lo, hi, fmt))
    if numerics.is_concrete(scale):
      # A NaN scale comes from a NaN input and is let through: the NaN propagates to the
      # output, eagerly as under jit. An inf or zero scale from finite inputs is refused.
      s = np.asarray(scale, np.float32)
      numerics.check_scales(np.where(np.isnan(s), 1.0, s), fmt,
                            f'fake_quant({fmt.name}, shape={x.shape})')
  else:
    # Given scales (a learned LSQ parameter, a loaded one) are checked when concrete; under
    # jit the caller keeps them positive (e.g. a softplus parametrisation).
    numerics.check_given_scale(scale, f'fake_quant({fmt.name}, shape={x.shape})')
    zero_point = None if fmt.symmetric else zero_point
  sshape = numerics.scale_shape(x.shape, fmt)
  if tuple(scale.shape) != sshape:
    raise ValueError(f'fake_quant({fmt.name}): scales of shape {tuple(scale.shape)} for a '
                     f'tensor of shape {tuple(x.shape)}; expected the scale layout {sshape}.')
  xv = numerics.tiled(x.astype(jnp.float32), sshape)
  z = None if zero_point is None else numerics.expand(zero_point)
  y = fake_quant_view(xv, numerics.expand(scale), z, fmt)
  return y.reshape(x.shape).astype(x.dtype)
