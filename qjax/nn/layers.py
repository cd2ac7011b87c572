"""Thin NNX layers: `Einsum` (every projection), `Embed`, `RMSNorm`, and the `QWeight` variable.

Every weight is an `nnx.Param` whose `out_sharding` metadata holds its logical axis names
(`qjax.nn.axes`), created with `eager_sharding=False` so that building a model needs no mesh;
a layout maps the names to mesh axes later (`nnx.get_partition_spec`).

Quantization never edits these classes' callers: `qjax.nn.policy` swaps an Einsum's `w` from
a `Param` to a `QWeight` holding a `QArray` (then the forward is `qeinsum`), or sets
`fake_fmt` (then the float weight is fake-quantized in the forward, for QAT). QAT
(`qjax.train.qat`) may add learned step sizes / zero points (`QATScale`), an activation
fake-quant format (`fake_act_fmt`) and a PACT clip of the input (`act_clip`, kept by the
converted model).

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

from qjax.core import (QArray, QFormat, dequantize, fake_quant, qeinsum, round_ste,
                       scale_and_zero_point)
from qjax.core.qdot import parse_spec as _core_parse_spec
from qjax.nn import shard_hooks


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
  `out_sharding`: codes and scales have other ranks than the weight, so a layout must map
  them explicitly).
  """


class QATScale(nnx.Variable):
  """A learned quantization parameter: an LSQ step size or zero point, or a PACT clip.

  Its own type, neither `nnx.Param` nor `QWeight`, so an optimizer can partition by type
  and give it its own learning rate (`qjax.train.qat.make_qat_optimizer`), while
  `wrt=nnx.Param` leaves it alone.
  """


_MIN_SCALE = 1e-12  # a learned step size never reaches 0 (or flips sign)
_ROUND = QFormat()  # an integer format: `round_ste` rounds to integers under it


def _positive_integer(scale, zero_point, fmt: QFormat):
  """A learned step size kept positive; a learned zero point rounded (STE) into [qmin, qmax]."""
  s = jnp.maximum(scale.astype(jnp.float32), _MIN_SCALE)
  if fmt.symmetric or zero_point is None:
    return s, None
  return s, jnp.clip(round_ste(zero_point.astype(jnp.float32), _ROUND), fmt.qmin, fmt.qmax)


def learned_range(scale, zero_point, fmt: QFormat):
  """The range (lo, hi) a learned step size s and zero point z span: +-qmax s, or (q - z) s."""
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


# One einsum-spec parser for the whole project: the core's (re-exported for nn users).
parse_spec = _core_parse_spec


class Einsum(nnx.Module):
  """A projection `einsum(spec, x, w)`, activations first.

  Attributes:
    spec: e.g. 'BTD,DNH->BTNH'.
    axes: logical axis names of the weight, one per weight letter.
    w: `nnx.Param` (float) or `QWeight` (a QArray) after `quantize_model`.
    act_fmt: activation format for W8A8 / fp8 (quantized weights only), or None.
    compute_path: qeinsum `path` for quantized weights ('auto', 'dequant', 'int8', 'fp8').
    fake_fmt: a fully resolved QFormat fake-quantizing the float weight in the forward (QAT).
    qat_scale, qat_zero_point: learned step size / zero point of `fake_fmt` (`QATScale`, in
      its grouped view), or None: the scale is calibrated from the weight at every call.
    fake_act_fmt: format fake-quantizing the input in the forward (QAT of `act_fmt`), or None.
    act_clip: PACT clip `a` (`QATScale`): the input is clipped to [-a, a] first, in the
      float, fake-quantized and quantized forward alike; or None.
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
    self.act_fmt: Optional[QFormat] = None
    self.compute_path = 'auto'
    self.fake_fmt: Optional[QFormat] = None
    self.qat_scale: Optional[QATScale] = nnx.data(None)
    self.qat_zero_point: Optional[QATScale] = nnx.data(None)
    self.fake_act_fmt: Optional[QFormat] = None
    self.act_clip: Optional[QATScale] = nnx.data(None)

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
  def weight_shape(self) -> tuple[int, ...]:
    w = self.w.get_value()
    return tuple(w.shape)

  @property
  def quantized(self) -> bool:
    return isinstance(self.w, QWeight)

  def fake_weight(self, w: jax.Array) -> jax.Array:
    """`w` fake-quantized per `fake_fmt` (with the learned scale when there is one)."""
    if self.fake_fmt is None:
      return w
    if self.qat_scale is None:
      return fake_quant(w, self.fake_fmt)
    zp = None if self.qat_zero_point is None else self.qat_zero_point[...]
    s, z = learned_qparams(self.qat_scale[...], zp, self.fake_fmt)
    return fake_quant(w, self.fake_fmt, scale=s, zero_point=z)

  def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
    """`einsum(spec, x, w)` in x's dtype (or `out_dtype`)."""
    if self.act_clip is not None:
      a = self.act_clip[...].astype(x.dtype)
      x = jnp.clip(x, -a, a)
    notify_taps(self, x)
    return shard_hooks.current().einsum(self, x, self.w.get_value(),
                                        functools.partial(self.apply, out_dtype=out_dtype))

  def apply(self, x: jax.Array, w, out_dtype=None) -> jax.Array:
    """The product with a given weight value (a layout may pass a gathered or local shard)."""
    if isinstance(w, QArray):
      return qeinsum(self.spec, x, w, act_fmt=self.act_fmt, path=self.compute_path,
                     out_dtype=out_dtype)
    w = self.fake_weight(w)
    if self.fake_act_fmt is not None:
      x = fake_quant(x, self.fake_act_fmt)
    out_dtype = out_dtype or x.dtype
    return jnp.einsum(self.spec, x, w.astype(x.dtype), preferred_element_type=out_dtype)


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
      return table[tokens_BT].astype(dtype)
    return dequantize(_gather_rows(table, tokens_BT.reshape(-1)), dtype).reshape(
        tokens_BT.shape + (table.shape[-1],))


def _gather_rows(q: QArray, rows_M: jax.Array) -> QArray:
  """Rows of a 2-d QArray as an (M, D) QArray; scales shared across rows are not gathered."""
  def take(a):
    if a is None or a.shape[0] == 1:  # per-tensor scale: one for every row
      return a
    return a[rows_M]
  return QArray(q.data[rows_M], take(q.scale), take(q.zero_point), q.fmt, q.last_dim,
                q.dtype_name)


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
