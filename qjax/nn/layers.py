"""Thin NNX layers: `Einsum` (every projection), `Embed`, `RMSNorm`, and the `QWeight` variable.

Every weight is an `nnx.Param` whose `out_sharding` metadata holds its logical axis names
(`qjax.nn.axes`), created with `eager_sharding=False` so that building a model needs no mesh;
a layout maps the names to mesh axes later (`nnx.get_partition_spec`).

How an Einsum quantizes is one frozen description, `EinsumQuant` (`layer.quant`): serving
fields (activation format, compute path, LLM.int8() outlier threshold) for a quantized weight
(a `QWeight` holding a `QArray`, then the forward is `qeinsum`), training fields (fake-quant
weight and activation formats, learned LSQ scales) for a float one, and a PACT clip or an
explicit input scale for either. Policies, QAT and PTQ methods change a layer by replacing
the description (`layer.set_quant(layer.quant.replace(...), **values)`); the learned or fixed
values it implies (`QATScale`, `InputScale`, the LLM.int8() float weights) are variables on
the layer, and which of them exist is the description's `variables`. A saved model is rebuilt
from the descriptions (`qjax.checkpoints`). The learned-scale math is the core's
(`qjax.core.learned`).

Calibration reads layer inputs the same way, without editing callers: inside
`with tap_inputs(fn):` every Einsum call first runs `fn(layer, x)` (`qjax.algorithms.calibrate`
streams statistics from it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QArray, choose_path, dequantize, fake_quant, qeinsum
from qjax.core import paths, scale_shape
from qjax.core.decode_paths import float_einsum, matrix_einsum
from qjax.core.learned import learned_fake_quant, pact_clip
from qjax.core.qdot import INT8_ACT
from qjax.core.qdot import parse_spec as _core_parse_spec
from qjax.nn import shard_hooks
from qjax.nn.einsum_quant import QUANT_VARIABLES, EinsumQuant


_TAPS: list = []  # active `tap_inputs` callbacks


@contextlib.contextmanager
def tap_inputs(fn: Callable[['Einsum', jax.Array], None]):
  """Call `fn(layer, x)` with the input of every Einsum call made inside the `with` block.

  Taps run when the Python forward runs: eagerly, or once while tracing (then `x` is a
  tracer). An Einsum subclass that overrides `__call__` calls `notify_taps` first.
  """
  _TAPS.append(fn)
  try:
    yield fn
  finally:
    _TAPS.remove(fn)


def notify_taps(layer: 'Einsum', x: jax.Array) -> None:
  """Pass one Einsum input to the active taps (a no-op outside `tap_inputs`)."""
  for fn in tuple(_TAPS):
    fn(layer, x)


class QWeight(nnx.Variable):
  """A quantized weight: its value is a `QArray` pytree (codes, scales, zero points).

  Not an `nnx.Param`, so optimizers built with `wrt=nnx.Param` leave it alone. The logical
  axes of the float weight it replaces are kept as `logical_axes` metadata (not
  `out_sharding`: a layout maps the QArray's leaves itself), and the recipe it was quantized
  with (the `QFormat`, calibration included) as `qformat` metadata: the QArray itself only
  knows its code type and scale tiling.
  """


class QATScale(nnx.Variable):
  """A learned quantization parameter: an LSQ step size or zero point, or a PACT clip.

  Its own type, neither `nnx.Param` nor `QWeight`, so an optimizer can partition by type
  and give it its own learning rate (`qjax.train.qat.make_qat_optimizer`), while
  `wrt=nnx.Param` leaves it alone.
  """


class InputScale(nnx.Variable):
  """A fixed per-input-element divisor (an AWQ / SmoothQuant scale no producer absorbed)."""


# One einsum-spec parser for the whole project: the core's (re-exported for nn users).
parse_spec = _core_parse_spec

class Einsum(nnx.Module):
  """A projection `einsum(spec, x, w)`, activations first.

  Attributes:
    spec: e.g. 'BTD,DNH->BTNH'.
    axes: logical axis names of the weight, one per weight letter.
    w: `nnx.Param` (float) or `QWeight` (a QArray) after `quantize_model`.
    quant: the `EinsumQuant` description (read-only; change it with `set_quant`, or by
      assigning a description that adds no variable).
    qat_scale, qat_zero_point: learned LSQ step size / zero point of `quant.fake_fmt`
      (`QATScale`, shaped as `compute_range` gives the format's scales), or None.
    act_clip: learned PACT clip a (`QATScale`, a scalar), or None.
    in_scale: the fixed input divisor (`InputScale`, the contracted weight axes), or None.
    w_outlier: LLM.int8()'s float weight copy (`nnx.Param`, the weight's shape), or None.
  """

  def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *,
               rngs: nnx.Rngs, param_dtype='float32', stddev: Optional[float] = None):
    ws = parse_spec(spec)[1]
    if not len(ws) == len(shape) == len(axes):
      raise ValueError(f'Einsum: spec {spec!r} names {len(ws)} weight axes but shape={shape} '
                       f'and axes={axes}; give one size and one logical name per letter.')
    self.spec = spec
    self.axes = tuple(axes)
    fan_in = math.prod(n for n, c in zip(shape, ws) if c in self.contracted_letters)
    std = stddev if stddev is not None else fan_in ** -0.5
    value = std * jax.random.normal(rngs.params(), shape, jnp.dtype(param_dtype))
    self.w = nnx.Param(value, out_sharding=self.axes, eager_sharding=False)
    self._quant = EinsumQuant()
    for name in QUANT_VARIABLES:
      setattr(self, name, nnx.data(None))

  @property
  def contracted_letters(self) -> str:
    xs, ws, out = parse_spec(self.spec)
    return ''.join(c for c in ws if c in xs and c not in out)

  @property
  def contracted_axes(self) -> tuple[int, ...]:
    """Weight axes summed over (in weight order); the last one is where groups go."""
    ws = parse_spec(self.spec)[1]
    return tuple(i for i, c in enumerate(ws) if c in self.contracted_letters)

  @property
  def contracted_shape(self) -> tuple[int, ...]:
    """Sizes of the contracted weight axes, in weight order (the shape of `in_scale`)."""
    shape = self.weight_shape
    return tuple(shape[a] for a in self.contracted_axes)

  @property
  def weight_shape(self) -> tuple[int, ...]:
    w = self.w.get_value()
    return tuple(w.shape)

  @property
  def quantized(self) -> bool:
    return isinstance(self.w, QWeight)

  # ---- the quantization description ------------------------------------------------------
  @property
  def quant(self) -> EinsumQuant:
    return self._quant

  @quant.setter
  def quant(self, quant: EinsumQuant) -> None:
    self.set_quant(quant)

  def _variable_shape(self, name: str, quant: EinsumQuant) -> tuple[int, ...]:
    if name in ('qat_scale', 'qat_zero_point'):
      return scale_shape(self.w.get_value().shape, quant.fake_fmt)
    return {'act_clip': (), 'in_scale': self.contracted_shape,
            'w_outlier': self.weight_shape}[name]

  def _check_quant(self, quant: EinsumQuant) -> None:
    """The description fits this layer's weight (float or quantized)."""
    what = f'Einsum {self.spec!r}'
    w = self.w.get_value()
    if isinstance(w, QArray):
      training = [n for n in ('fake_fmt', 'fake_act_fmt') if getattr(quant, n) is not None]
      if training:
        raise ValueError(f'set_quant: {what} holds a quantized weight ({w.layout_name}), but the '
                         f'description sets {training}, which fake-quantize a float weight '
                         '(QAT); drop them, or give the layer a float weight first.')
      if quant.outlier_threshold is not None and (w.qtype.is_float or w.bits != 8):
        raise ValueError(f'set_quant: {what}: LLM.int8() (outlier_threshold='
                         f'{quant.outlier_threshold}) needs int8 weights, not {w.layout_name}.')
      try:
        if quant.path == 'auto':
          choose_path(w.qtype, quant.act_fmt)
      except ValueError as e:
        raise ValueError(f'set_quant: {what}: {e}') from None
      return
    serving = [n for n, v in (('act_fmt', quant.act_fmt), ('outlier_threshold',
               quant.outlier_threshold)) if v is not None]
    if quant.path != 'auto':
      serving.append('path')
    if serving:
      raise ValueError(f'set_quant: {what} holds a float weight, but the description sets '
                       f'{serving}, which apply to a quantized weight; quantize the layer '
                       '(`quantize_model`) first, or use fake_fmt / fake_act_fmt for QAT.')

  def set_quant(self, quant: EinsumQuant, **values) -> None:
    """Replace the layer's quantization description, creating or dropping its variables.

    A variable the new description implies (`quant.variables`) takes its value from
    `values`, else keeps the layer's current one; the others are dropped.

    Args:
      quant: the new description.
      **values: arrays for the variables the description adds (names in QUANT_VARIABLES):
        `qat_scale` / `qat_zero_point` (raw LSQ values, e.g. from `qjax.core.init_learned`),
        `act_clip` (the PACT clip), `in_scale` (the input divisor), `w_outlier` (LLM.int8()'s
        float weights). `placeholder_values(quant)` gives values of the right shapes.

    Raises:
      ValueError: the description does not fit the weight, a value is missing, unexpected or
        of the wrong shape.
    """
    if not isinstance(quant, EinsumQuant):
      raise ValueError(f'set_quant: expected an EinsumQuant, got {type(quant).__name__}.')
    self._check_quant(quant)
    wanted = quant.variables
    extra = sorted(set(values) - set(wanted))
    if extra:
      raise ValueError(f'set_quant: values {extra} given, but the description implies only '
                       f'{list(wanted)}; set the fields that create them (learn_scale, pact, '
                       'input_scale, outlier_threshold) or drop the values.')
    new = {}
    for name in wanted:
      if name in values:
        v = jnp.asarray(values[name])
      elif getattr(self, name) is not None:
        v = getattr(self, name)[...]
      else:
        raise ValueError(f'set_quant: the description adds the variable {name!r} to Einsum '
                         f'{self.spec!r}; pass {name}=... (its initial value), e.g. '
                         'layer.set_quant(quant, **layer.placeholder_values(quant)).')
      want = self._variable_shape(name, quant)
      if tuple(v.shape) != want:
        raise ValueError(f'set_quant: {name} of Einsum {self.spec!r} has shape '
                         f'{tuple(v.shape)}, expected {want}.')
      new[name] = v
    for name in QUANT_VARIABLES:
      if name not in new:
        setattr(self, name, None)
      elif name == 'w_outlier':  # the float weight's axes
        setattr(self, name, nnx.data(nnx.Param(new[name], out_sharding=self.axes,
                                               eager_sharding=False)))
      else:
        kind = InputScale if name == 'in_scale' else QATScale
        setattr(self, name, nnx.data(kind(new[name].astype(jnp.float32))))
    self._quant = quant

  def placeholder_values(self, quant: EinsumQuant) -> dict:
    """Values of the right shapes and dtypes for the variables `quant` implies (ones for
    scales and clips, zeros for weights and zero points): a skeleton for a restore."""
    out = {}
    for name in quant.variables:
      shape = self._variable_shape(name, quant)
      if name == 'w_outlier':
        out[name] = jnp.zeros(shape, self.w.get_value().dtype)
      else:
        out[name] = (jnp.zeros if name == 'qat_zero_point' else jnp.ones)(shape, jnp.float32)
    return out

  # ---- the forward -----------------------------------------------------------------------
  def fake_weight(self, w: jax.Array) -> jax.Array:
    """`w` fake-quantized per `quant.fake_fmt` (with the learned scale when there is one)."""
    fmt = self.quant.fake_fmt
    if fmt is None:
      return w
    if not self.quant.learn_scale:
      return fake_quant(w, fmt)
    zp = None if self.qat_zero_point is None else self.qat_zero_point[...]
    return learned_fake_quant(w, fmt, self.qat_scale[...], zp)

  def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
    """`einsum(spec, x, w)` in x's dtype (or `out_dtype`)."""
    if self.quant.pact:
      x = pact_clip(x, self.act_clip[...])
    notify_taps(self, x)
    return shard_hooks.current().einsum(self, x, self.w.get_value(),
                                        functools.partial(self.apply, out_dtype=out_dtype))

  def apply(self, x: jax.Array, w, out_dtype=None) -> jax.Array:
    """The product with a given weight value (a layout may pass a gathered or local shard)."""
    quant = self.quant
    if quant.input_scale:  # taps saw x itself; the division belongs to the product
      xs, cl = parse_spec(self.spec)[0], self.contracted_letters
      s = jnp.transpose(self.in_scale[...], [cl.index(c) for c in xs if c in cl])
      x = x / s.reshape([x.shape[i] if c in cl else 1 for i, c in enumerate(xs)]).astype(x.dtype)
    if isinstance(w, QArray):
      if quant.outlier_threshold is not None:
        return self.outlier_forward(x, w, out_dtype)[0]
      return qeinsum(self.spec, x, w, act_fmt=quant.act_fmt, path=quant.path,
                     out_dtype=out_dtype)
    w = self.fake_weight(w)
    if quant.fake_act_fmt is not None:
      x = fake_quant(x, quant.fake_act_fmt)
    out_dtype = out_dtype or x.dtype
    if w.dtype == jnp.bfloat16 and x.dtype != w.dtype:
      # bf16 params with f32 compute: no per-call f32 copy of the weight (decode_paths).
      return float_einsum(self.spec, x, w, out_dtype)
    # A 2-D dot: XLA:CPU may otherwise copy the weight to the activations' axis order.
    return matrix_einsum(self.spec, x, w.astype(x.dtype), out_dtype)

  def outlier_forward(self, x: jax.Array, w: QArray,
                      out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """LLM.int8() with weight `w`: (y, fraction of input features multiplied in int8).

    The input features (contracted elements of x) whose max |x| over the call's tokens
    exceeds `quant.outlier_threshold` multiply the float weights (`w_outlier`, or the
    dequantized codes), the rest go through `qeinsum`'s int8 x int8 path with per-token
    activation scales: the einsum form of `qjax.algorithms.llm_int8_matmul`.
    """
    out_dtype = out_dtype or x.dtype
    xs = parse_spec(self.spec)[0]
    tokens = tuple(i for i, c in enumerate(xs) if c not in self.contracted_letters)
    outlier = jnp.max(jnp.abs(x), axis=tokens, keepdims=True) > self.quant.outlier_threshold
    x_int8 = jnp.where(outlier, jnp.zeros((), x.dtype), x)
    x_float = jnp.where(outlier, x, jnp.zeros((), x.dtype))
    y = qeinsum(self.spec, x_int8, w, act_fmt=INT8_ACT, path='int8', out_dtype=out_dtype)
    wf = dequantize(w, x.dtype) if self.w_outlier is None else self.w_outlier[...]
    # The float part is the float layer's own einsum, so threshold 0 reproduces it exactly.
    y = y + jnp.einsum(self.spec, x_float, wf.astype(x.dtype), preferred_element_type=out_dtype)
    return y, 1.0 - jnp.mean(outlier.astype(jnp.float32))


class Embed(Einsum):
  """The V x D embedding table; as an Einsum it is the tied LM head 'BTD,VD->BTV'."""

  def __init__(self, vocab_size: int, d_model: int, axes: tuple[str, str], *,
               rngs: nnx.Rngs, param_dtype='float32'):
    super().__init__('BTD,VD->BTV', (vocab_size, d_model), axes, rngs=rngs,
                     param_dtype=param_dtype, stddev=d_model ** -0.5)

  def lookup(self, tokens_BT: jax.Array, dtype) -> jax.Array:
    """Embedding rows of `tokens_BT` in `dtype`; a quantized table dequantizes only those rows."""
    table = self.w.get_value()
    if not isinstance(table, QArray):
      table = self.fake_weight(table)
    # Indexing, or on a TPU the tile-row gather kernel (the table stays in the head's layout).
    rows_BTD = paths.lookup(table, tokens_BT, dtype)
    return shard_hooks.current().embed_rows(self, rows_BTD)


class RMSNorm(nnx.Module):
  """`x / rms(x) * w` (or `* (1 + w)` with `plus_one`), over the last axis, in float32."""

  def __init__(self, dim: int, axis_name: str, *, eps: float = 1e-6, plus_one: bool = False,
               param_dtype='float32'):
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), jnp.dtype(param_dtype)), out_sharding=(axis_name,),
                           eager_sharding=False)
    self.eps = eps
    self.plus_one = plus_one

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    w = self.scale[...].astype(jnp.float32)
    return (y * (1.0 + w if self.plus_one else w)).astype(x.dtype)
