"""Conversion of a trained QAT model to the real quantized model it was trained to be.

`convert` hands the trained weights and their learned scales to `quantize_model` as
precomputed ranges (`learned_ranges`): `range_for` inverts a scale to a range that the core's
`scale_and_zero_point` maps back to exactly that scale, so the stored scales and zero points
are the ones the forward trained with. PACT clips and the attention's KV format are part of
what the model computes and are kept (`float_model`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.core import QFormat, scale_and_zero_point
from qjax.nn import QuantPolicy, QuantReport, einsum_layers, quantize_model
from qjax.nn.layers import learned_qparams, learned_range


def learned_scales(model: nnx.Module) -> dict[str, tuple[jax.Array, Optional[jax.Array]]]:
  """{path: (scale, zero point)} of every learned scale, exactly as the forward uses them."""
  out = {}
  for path, layer in einsum_layers(model):
    if layer.qat_scale is not None:
      zp = None if layer.qat_zero_point is None else layer.qat_zero_point[...]
      out[path] = learned_qparams(layer.qat_scale[...], zp, layer.fake_fmt)
  return out


def learned_ranges(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{path: (lo, hi)} from which `quantize` recomputes exactly the learned scales.

  Non-power-of-two scales: the `learned_range` the forward itself mapped through
  `scale_and_zero_point`; powers of two: `range_for`. Either way checked here.
  """
  out = {}
  for path, layer in einsum_layers(model):
    if layer.qat_scale is None:
      continue
    fmt = layer.fake_fmt
    zp = None if layer.qat_zero_point is None else layer.qat_zero_point[...]
    s, z = learned_qparams(layer.qat_scale[...], zp, fmt)
    if fmt.pow2_scale:
      out[path] = range_for(s, z, fmt)
      continue
    lo, hi = learned_range(layer.qat_scale[...], zp, fmt)
    got_s, got_z = scale_and_zero_point(lo, hi, fmt)
    if not (np.array_equal(np.asarray(got_s, np.float32), np.asarray(s))
            and (z is None or np.array_equal(np.asarray(got_z, np.float32), np.asarray(z)))):
      raise RuntimeError(f'learned_ranges: layer {path!r}: quantize would not reproduce the '
                         'learned scales from their range; this is a bug, please report it.')
    out[path] = (lo, hi)
  return out


# Ulp steps tried (in order) when inverting a scale to a range: `amax * (1/qmax)` may land an
# ulp off, and a power-of-two scale must not round up to the next power.
ULP_STEPS = (0,) + tuple(k * sign for k in range(1, 33) for sign in (-1, 1))


def step_ulps(x: np.ndarray, k: int) -> np.ndarray:
  for _ in range(abs(k)):
    x = np.nextafter(x, np.float32(np.inf if k > 0 else -np.inf)).astype(np.float32)
  return x


def range_for(scale, zero_point, fmt: QFormat) -> tuple[jax.Array, jax.Array]:
  """A (lo, hi) that `scale_and_zero_point` maps back to exactly (scale, zero_point).

  Args:
    scale: positive scales in the grouped view, representable in `fmt.scale_dtype` (and
      powers of two for `pow2_scale` formats), e.g. from `learned_qparams`.
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


def float_model(model: nnx.Module) -> nnx.Module:
  """A copy of a QAT model without its QAT state (fake formats, learned scales).

  PACT clips and the attention's KV format stay: they are part of what the converted model
  computes.
  """
  fm = nnx.clone(model)
  for _, layer in einsum_layers(fm):
    layer.fake_fmt = layer.fake_act_fmt = None
    layer.qat_scale = layer.qat_zero_point = None
  return fm


def convert(model: nnx.Module, policy: QuantPolicy, **overrides) -> tuple[nnx.Module, QuantReport]:
  """The real quantized model of a trained QAT model: `quantize_model` with its scales.

  Learned scales are passed as precomputed ranges (`learned_ranges`), so the stored scales and
  zero points are exactly the ones the forward trained with; dynamic ones are recalibrated
  from the trained weights exactly as the forward did.

  Args:
    model: a model from `prepare_qat` (trained or not).
    policy: the policy it was prepared with (checked layer by layer).
    **overrides: QuantPolicy fields to change for serving only, e.g. path='dequant'.

  Returns:
    (qmodel, QuantReport) as `quantize_model` returns them.
  """
  layers = dict(einsum_layers(model))
  ranges = learned_ranges(model)
  if overrides:
    policy = QuantPolicy(policy.rules, **{'strict': policy.strict, 'path': policy.path,
                                          **overrides})
  qmodel, report = quantize_model(float_model(model), policy, calibration=ranges or None)
  for l in report.layers:
    fmt = layers[l.path].fake_fmt
    trained = fmt.name if fmt is not None else 'float'
    if trained != l.weight:
      raise ValueError(f'convert: layer {l.path!r} trained as {trained} but the policy makes it '
                       f'{l.weight}; convert with the policy given to prepare_qat.')
  return qmodel, report
