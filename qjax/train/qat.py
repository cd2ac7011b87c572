"""Quantization-aware training (QAT) under the same `QuantPolicy` that PTQ uses.

What you train is what you serve: `prepare_qat` fake-quantizes exactly the layers and formats
`quantize_model` quantizes under the policy (through `apply_fake_quant`), and `convert`
(`qjax.train.qat_convert`) hands the trained weights and their learned scales (as
precomputed ranges) to `quantize_model`.
With power-of-two scales the fake-quant forward and the converted model (path='dequant')
give bit-identical logits; otherwise they agree to float rounding.

Scales are either

* *dynamic* (default): recalibrated from the weight at every step by the format's
  calibration, constants for the gradient; conversion recalibrates the same way; or
* *learned* (LSQ, Esser et al. 2020): the step size, and the zero point of asymmetric
  formats, are `QATScale` variables initialised from the core's calibration (or a PTQ
  result), trained with their own learning rate by `make_qat_optimizer`'s optax partition.
  LSQ scales its step-size gradient by 1/sqrt(N * Qp) for SGD; under Adam, which
  normalises gradients, the equivalent is a step relative to the scale's size
  (`relative_adam`).

Optionally activations are fake-quantized as `qeinsum`'s int8 / fp8 paths quantize them
(dynamic, per token and weight group), behind a PACT-style learned clip [-a, a]; and keys
and values as a quantized KV cache stores them (`kv=`: the attention's KV format, kept by the
converted model, whose cache then uses it). The straight-through and LSQ gradients live in
`qjax.core.fake_quant`, the learned-scale math in `qjax.core.learned`; nothing here redefines
them. Each layer's QAT state is its `EinsumQuant` description (`fake_fmt`, `learn_scale`,
`fake_act_fmt`, `pact`), set with `Einsum.set_quant`.

    qat, _ = prepare_qat(model, policy, learn_scales=True)
    opt = make_qat_optimizer(qat, make_optimizer(1e-3, steps, warmup), scale_lr=1e-3)
    for batch_BT1 in batches:
      loss = qat_step(qat, opt, batch_BT1)
    qmodel, report = convert(qat, policy)
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qjax.core import QArray, QFormat, QType, dequantize, init_learned, scale_shape
from qjax.nn import QuantPolicy, apply_fake_quant, einsum_layers, set_kv_format
from qjax.nn.layers import Einsum, QATScale, parse_spec

# Everything QAT trains: the weights and the learned quantization parameters.
TRAINABLE = nnx.Any(nnx.Param, QATScale)


def _stores(q: QArray, fmt: QFormat) -> bool:
  """Whether `q` holds codes and scales laid out as `fmt` would store them."""
  return (q.qtype == QType.of(fmt) and tuple(q.scale.shape) == scale_shape(q.shape, fmt)
          and (q.zero_point is None) == fmt.symmetric
          and q.scale.dtype == jnp.dtype(fmt.scale_dtype))


def _dequantized(model: nnx.Module) -> tuple[nnx.Module, dict]:
  """A float copy of a PTQ result (codes dequantized into Params) and its {path: QArray}."""
  fm = nnx.clone(model)
  ptq = {}
  for path, layer in einsum_layers(fm):
    w = layer.w.get_value()
    if isinstance(w, QArray):
      ptq[path] = w
      layer.w = nnx.Param(dequantize(w), out_sharding=layer.axes, eager_sharding=False)
      layer.set_quant(layer.quant.replace(act_fmt=None, path='auto'))
  return fm, ptq


def activation_format(layer: Einsum, weight_fmt: QFormat, act: QFormat) -> QFormat:
  """The input format `qeinsum` applies for `act`: symmetric, dynamic, one scale per token
  and per block of `group_size` consecutive elements of the weight's group axis (per token
  over all contracted elements when the weight is not grouped)."""
  xs, ws, _ = parse_spec(layer.spec)
  contracted = layer.contracted_letters
  gl = ws[weight_fmt.group_axis % len(ws)]
  if weight_fmt.group_size is None or gl not in contracted:
    channel = tuple(i for i, c in enumerate(xs) if c not in contracted)
    return QFormat(bits=8, kind=act.kind, channel_axes=channel)
  channel = tuple(i for i, c in enumerate(xs) if c != gl)
  return QFormat(bits=8, kind=act.kind, channel_axes=channel, group_size=weight_fmt.group_size,
                 group_axis=xs.index(gl))


def prepare_qat(model: nnx.Module, policy: QuantPolicy, *,
                learn_scales: Union[bool, str] = False,
                ranges: Union[None, str, Mapping[str, tuple]] = None,
                act: bool = False, pact: Optional[float] = None,
                kv: Union[None, str, QFormat] = None):
  """A QAT copy of `model` under `policy` (the model is left untouched).

  Args:
    model: a float model, or a PTQ result of it under the same policy (`quantize_model`,
      `qjax.algorithms.apply.apply_method`): its codes are dequantized into the trainable
      weights, so QAT starts from exactly that model, and its scales initialise learned ones.
    policy: the QuantPolicy the model will be converted with.
    learn_scales: False (dynamic scales), True (LSQ scales on every quantized layer), or a
      regex of layer paths (re.fullmatch) whose scales to learn.
    ranges: initial ranges of the learned scales: None (each format's calibration, or the
      PTQ result's scales), a calibration method name ('absmax', 'mse', ...), or
      {path: (lo, hi)} in the grouped view, as `quantize_model(calibration=...)` takes.
    act: also fake-quantize the inputs of layers whose rule has an activation format, as
      `qeinsum` quantizes them (`activation_format`).
    pact: initial PACT clip a > 0 of those inputs (learned, kept by the converted model), or
      None for no clip.
    kv: KV cache format to train with: None (float), a name in `qjax.nn.kvcache.KV_FORMATS`
      ('int8', 'int4', 'fp8', 'fp8_e5m2') or a QFormat with a scale per token and kv head.
      Keys and values are then fake-quantized in every forward exactly as that cache stores
      them (`kvcache.through_format`), and the converted model keeps the format.

  Returns:
    (qat_model, QuantReport from `apply_fake_quant`).
  """
  base, ptq = _dequantized(model)
  qat, report = apply_fake_quant(base, policy)
  if kv is not None:
    set_kv_format(qat, kv, 'prepare_qat: kv')
  layers = dict(einsum_layers(qat))
  for path, q in ptq.items():
    fmt = layers[path].quant.fake_fmt
    if fmt is None or not _stores(q, fmt):
      raise ValueError(f'prepare_qat: layer {path!r} of the PTQ model is {q.layout_name}, but the '
                       f'policy makes it {fmt.name if fmt else "float"}; start QAT with the '
                       'policy the model was quantized with.')

  if learn_scales is True:
    learn = [p for p, l in layers.items() if l.quant.fake_fmt is not None]
    if not learn:
      raise ValueError('prepare_qat: learn_scales=True, but the policy keeps every layer float '
                       '(no format, no scale to learn); fix the policy or learn_scales=False.')
  elif learn_scales:
    learn = [p for p in layers if re.fullmatch(learn_scales, p)]
    if not learn:
      raise ValueError(f'prepare_qat: learn_scales={learn_scales!r} matches no layer; paths '
                       f'look like {list(layers)[:3]} (re.fullmatch).')
  else:
    learn = []
    if ranges is not None:
      raise ValueError('prepare_qat: ranges initialise learned scales, but learn_scales=False '
                       '(dynamic scales are recalibrated from the weights at every step); '
                       'pass learn_scales=True, or drop ranges.')
  if isinstance(ranges, Mapping):
    extra = set(ranges) - set(learn)
    if extra:
      raise ValueError(f'prepare_qat: ranges name layers {sorted(extra)} whose scales are not '
                       f'learned; learned layers are {learn}.')
  for path in learn:
    layer = layers[path]
    fmt = layer.quant.fake_fmt
    if fmt is None:
      reason = report[path].reason
      raise ValueError(f'prepare_qat: layer {path!r} stays float under the policy ({reason}), '
                       'so it has no scale to learn; narrow learn_scales to quantized layers.')
    if path in ptq and (ranges is None or isinstance(ranges, Mapping) and path not in ranges):
      init = ptq[path]
    elif isinstance(ranges, Mapping):
      init = ranges.get(path)
    else:
      init = ranges
    try:
      scale, zp = init_learned(layer.w.get_value(), fmt, init)
    except ValueError as e:
      raise ValueError(f'prepare_qat: layer {path!r}: {e}') from None
    learned = {'qat_scale': scale} if zp is None else {'qat_scale': scale, 'qat_zero_point': zp}
    layer.set_quant(layer.quant.replace(learn_scale=True), **learned)

  if act or pact is not None:
    acted = []
    for path, layer in layers.items():
      rule = policy.match(path)[1]
      fmt = layer.quant.fake_fmt
      if fmt is not None and rule is not None and rule.act is not None:
        layer.set_quant(layer.quant.replace(fake_act_fmt=activation_format(layer, fmt, rule.act)))
        acted.append(path)
    if not acted:
      raise ValueError('prepare_qat: act=True / pact given, but no rule of the policy has an '
                       'activation format (QuantRule(act=...)); weight-only QAT needs neither.')
    if pact is not None:
      if not act:
        raise ValueError('prepare_qat: pact clips quantized activations; pass act=True too.')
      if not pact > 0:
        raise ValueError(f'prepare_qat: pact={pact!r}; the clip a of [-a, a] must be > 0 '
                         '(e.g. a few times the inputs\' rms).')
      for path in acted:
        layer = layers[path]
        layer.set_quant(layer.quant.replace(pact=True), act_clip=jnp.asarray(pact, jnp.float32))
  return qat, report


def relative_adam(lr: float) -> optax.GradientTransformation:
  """Adam whose steps are relative to each variable's RMS: ~`lr` of it per step.

  Adam's step is ~lr whatever the parameter's size; int8 step sizes (~1e-3) and int2 ones
  (~1e-1) need steps in proportion, as LSQ's gradient scale gives plain SGD.
  """
  return optax.chain(optax.scale_by_adam(), optax.scale_by_param_block_rms(min_scale=1e-12),
                     optax.scale(-lr))


def make_qat_optimizer(model: nnx.Module, tx: optax.GradientTransformation, *,
                       scale_lr: Optional[float] = None,
                       scale_tx: Optional[optax.GradientTransformation] = None) -> nnx.Optimizer:
  """An optimizer over the weights (`tx`) and learned scales (their own transformation).

  Variables are partitioned by type with `optax.multi_transform`: `nnx.Param` -> `tx`,
  `QATScale` -> `scale_tx` or `relative_adam(scale_lr)` (no weight decay, no shared
  clipping).

  Args:
    model: a model from `prepare_qat` (or any model, without scale arguments).
    tx: the weights' transformation (e.g. `qjax.train.optim.make_optimizer(...)`).
    scale_lr: learning rate of the learned scales / zero points / PACT clips.
    scale_tx: their transformation instead of `relative_adam(scale_lr)`.

  Returns:
    nnx.Optimizer(model, ..., wrt=TRAINABLE) (wrt=nnx.Param when nothing is learned).
  """
  state = nnx.state(model, TRAINABLE)
  n_learned = len(jax.tree.leaves(nnx.state(model, QATScale)))
  given = scale_lr is not None or scale_tx is not None
  if given and not n_learned:
    raise ValueError(f'make_qat_optimizer: scale_lr={scale_lr!r} given, but the model has no '
                     'learned scales: its layers are float/exempt under the policy, or it was '
                     'prepared with learn_scales=False (dynamic scales are recalibrated, not '
                     'trained). Drop scale_lr, or prepare_qat(..., learn_scales=True).')
  if not n_learned:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  if not given:
    raise ValueError(f'make_qat_optimizer: the model has {n_learned} learned quantization '
                     'parameters (QATScale); give them a learning rate, scale_lr=... (or '
                     'scale_tx=...).')
  if scale_tx is None:
    if not scale_lr > 0:
      raise ValueError(f'make_qat_optimizer: scale_lr={scale_lr!r} must be > 0 (e.g. 1e-2).')
    scale_tx = relative_adam(scale_lr)
  labels = jax.tree.map(lambda v: 'scales' if isinstance(v, QATScale) else 'weights', state,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.Optimizer(model, optax.multi_transform({'weights': tx, 'scales': scale_tx},
                                                    labels), wrt=TRAINABLE)


def lm_loss(model: nnx.Module, batch_BT1: jax.Array) -> jax.Array:
  """Next-token cross entropy of a [B, T + 1] batch."""
  logits_BTV = model(batch_BT1[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch_BT1[:, 1:]).mean()


@nnx.jit
def qat_step(model: nnx.Module, optimizer: nnx.Optimizer, batch_BT1: jax.Array) -> jax.Array:
  """One step of `lm_loss` on the weights and learned scales; returns the loss."""
  loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, TRAINABLE))(
      model, batch_BT1)
  optimizer.update(model, grads)
  return loss
