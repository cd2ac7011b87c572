"""Conversion of a trained QAT model to the real quantized model it was trained to be.

`convert` hands the trained weights and their learned scales to `quantize_model` as
precomputed ranges (`learned_ranges`, through `qjax.core.conversion_range`: a range that the
core's `scale_and_zero_point` maps back to exactly the learned scale), so the stored scales
and zero points are the ones the forward trained with. PACT clips and the attention's KV
format are part of what the model computes and are kept (`float_model`).
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from qjax.core import conversion_range, learned_qparams
from qjax.nn import QuantPolicy, QuantReport, einsum_layers, quantize_model


def _learned_pairs(model: nnx.Module):
  """(path, raw scale, raw zero point or None, format) of every layer with learned scales."""
  for path, layer in einsum_layers(model):
    if layer.quant.learn_scale:
      zp = None if layer.qat_zero_point is None else layer.qat_zero_point[...]
      yield path, layer.qat_scale[...], zp, layer.quant.fake_fmt


def learned_scales(model: nnx.Module) -> dict[str, tuple[jax.Array, Optional[jax.Array]]]:
  """{path: (scale, zero point)} of every learned scale, exactly as the forward uses them."""
  return {path: learned_qparams(s, z, fmt) for path, s, z, fmt in _learned_pairs(model)}


def learned_ranges(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{path: (lo, hi)} from which `quantize` recomputes exactly the learned scales
  (`qjax.core.conversion_range`, which checks it)."""
  out = {}
  for path, s, z, fmt in _learned_pairs(model):
    try:
      out[path] = conversion_range(s, z, fmt)
    except RuntimeError as e:
      raise RuntimeError(f'learned_ranges: layer {path!r}: {e}') from None
  return out


def float_model(model: nnx.Module) -> nnx.Module:
  """A copy of a QAT model without its QAT state (fake formats, learned scales).

  PACT clips and the attention's KV format stay: they are part of what the converted model
  computes.
  """
  fm = nnx.clone(model)
  for _, layer in einsum_layers(fm):
    layer.set_quant(layer.quant.replace(fake_fmt=None, learn_scale=False, fake_act_fmt=None))
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
    fmt = layers[l.path].quant.fake_fmt
    trained = fmt.name if fmt is not None else 'float'
    if trained != l.weight:
      raise ValueError(f'convert: layer {l.path!r} trained as {trained} but the policy makes it '
                       f'{l.weight}; convert with the policy given to prepare_qat.')
  return qmodel, report
