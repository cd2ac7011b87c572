"""The quantized-array pytree and quantize / dequantize.

`QArray` is the one container every qjax algorithm produces and consumes. Its leaves are
plain arrays (so it passes through `jax.jit`, `jax.vmap`, `jax.tree` utilities, Orbax and
`jax.device_put` with a sharding), and its format is static metadata.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core import calibration as calib
from qjax.core import packing
from qjax.core.formats import FLOAT_KINDS, QFormat, normalize_axis


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized tensor.

  Invariant: `x ~= (codes - zero_point) * broadcast(scale)`, where `codes` is `unpack(data)`
  reshaped to the grouped view of `fmt` (see `calibration.grouped_view_shape`), `scale` and
  `zero_point` have that view's shape with 1s on the reduced axes, and `zero_point` is None
  (read as 0) for symmetric formats.

  Attributes:
    data: stored codes, shape `shape[:-1] + (packed_length(shape[-1]),)`; uint8 when
      bit-packed (2/3/4 bits), int8 for 5/6/8 bits, fp8 for float formats.
    scale: scales in `fmt.scale_dtype`.
    zero_point: integer-valued zero points in `fmt.scale_dtype`, or None.
    fmt: the static format, with axes stored as negative indices so that `jax.vmap` over
      leading axes keeps their meaning.
    last_dim: logical length of the last axis (packing pads it).
    dtype_name: dtype `dequantize` returns by default (the source tensor's dtype).
  """

  data: jax.Array
  scale: jax.Array
  zero_point: Optional[jax.Array]
  fmt: QFormat
  last_dim: int
  dtype_name: str = 'float32'

  def tree_flatten(self):
    return (self.data, self.scale, self.zero_point), (self.fmt, self.last_dim, self.dtype_name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape[:-1]) + (self.last_dim,)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def dtype(self):
    return jnp.dtype(self.dtype_name)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return nbytes(self)

  def codes(self) -> jax.Array:
    """Unpacked codes in the tensor's own shape (int8, or fp8)."""
    if self.fmt.packed:
      return packing.unpack(self.data, self.fmt.bits, self.last_dim)
    return self.data

  def dequantize(self, dtype=None) -> jax.Array:
    return dequantize(self, dtype)

  def __repr__(self):
    return (f'QArray({self.fmt.name}, shape={self.shape}, data={self.data.dtype}'
            f'{list(self.data.shape)}, scale={list(self.scale.shape)}, nbytes={self.nbytes})')


def _negative_axes(fmt: QFormat, ndim: int) -> QFormat:
  ch = tuple(normalize_axis(a, ndim, f'QFormat.channel_axes={fmt.channel_axes}') - ndim
             for a in fmt.channel_axes)
  ga = normalize_axis(fmt.group_axis, ndim, f'QFormat.group_axis={fmt.group_axis}') - ndim
  return fmt.replace(channel_axes=ch, group_axis=ga)


def _check_finite(x, what):
  if isinstance(x, jax.core.Tracer):
    return  # values unknown under tracing; checked eagerly wherever the caller is concrete
  bad = ~np.isfinite(np.asarray(x, dtype=np.float32))
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f'{what}: the tensor holds {int(bad.sum())} NaN/Inf values (first at '
                     f'index {idx}); quantization would silently corrupt them. Fix the source '
                     'tensor (or clip it) before quantizing.')


def scale_and_zero_point(lo, hi, fmt: QFormat):
  """Scale (rounded to `fmt.scale_dtype`) and zero point for a per-scale range.

  An all-zero group (lo == hi == 0) gets scale 1 and zero point 0: its codes are 0 and it
  dequantizes to exact zeros, never NaN.
  """
  sdt = jnp.dtype(fmt.scale_dtype)
  if fmt.symmetric:
    amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    # Multiply by a host-side reciprocal: XLA may rewrite `/ const` that way under jit, and
    # eager and jitted scales must agree bit for bit (QAT == converted model).
    scale = jnp.where(amax > 0, amax * (1.0 / fmt.qmax), 1.0)
    zp = None
  else:
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)  # keep 0 exactly representable
    span = hi - lo
    scale = jnp.where(span > 0, span * (1.0 / (fmt.qmax - fmt.qmin)), 1.0)
  if fmt.pow2_scale:
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  # Quantize with the scale as stored, so dequantize sees exactly what quantize used.
  scale = scale.astype(sdt)
  if not fmt.symmetric:
    zp = jnp.clip(jnp.round(fmt.qmin - lo / scale.astype(jnp.float32)), fmt.qmin, fmt.qmax)
    zp = zp.astype(sdt)
  return scale, zp


def _to_codes(xv, scale, zp, fmt: QFormat):
  s = scale.astype(jnp.float32)
  if fmt.is_float:
    y = jnp.clip(xv / s, -fmt.qmax, fmt.qmax)  # fp8 e4m3fn has no inf: saturate, don't NaN
    return y.astype(FLOAT_KINDS[fmt.kind])
  q = jnp.round(xv / s)
  if zp is not None:
    q = q + zp.astype(jnp.float32)
  return jnp.clip(q, fmt.qmin, fmt.qmax).astype(jnp.int8)


def _from_codes(c, scale, zp, dtype=jnp.float32):
  v = c.astype(jnp.float32)
  if zp is not None:
    v = v - zp.astype(jnp.float32)
  return (v * scale.astype(jnp.float32)).astype(dtype)


def fake_round(xv, scale, zp, fmt: QFormat):
  """Quantize-dequantize in the grouped view (no straight-through gradient; see fake_quant)."""
  return _from_codes(_to_codes(xv, scale, zp, fmt), scale, zp)


RangeArg = Union[None, str, tuple[Any, Any]]


def quantize(x: jax.Array, fmt: QFormat, calibration: RangeArg = None) -> QArray:
  """Quantize `x` to `fmt`.

  Args:
    x: a floating tensor (NaN/Inf rejected when concrete).
    fmt: the format; its axes may be negative or positive.
    calibration: None (use `fmt.calibration`), a method name, or a precomputed (lo, hi) in the
      grouped view (e.g. from `compute_range` over calibration data).

  Returns:
    A QArray with `dequantize(q) ~= x`.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f'quantize: expected a floating tensor, got dtype {x.dtype}; cast it with '
                     '.astype(jnp.float32) first.')
  if x.ndim == 0:
    raise ValueError('quantize: got a scalar; quantize tensors of rank >= 1.')
  _check_finite(x, f'quantize({fmt.name}, shape={x.shape})')
  fmt = _negative_axes(fmt, x.ndim)
  xv, _ = calib.grouped_view(x.astype(jnp.float32), fmt)
  if isinstance(calibration, tuple):
    lo, hi = calibration
  else:
    lo, hi = calib.compute_range(x, fmt, calibration)
  scale, zp = scale_and_zero_point(lo, hi, fmt)
  codes = _to_codes(xv, scale, zp, fmt).reshape(x.shape)
  data = packing.pack(codes, fmt.bits) if fmt.packed else codes
  return QArray(data, scale, zp, fmt, x.shape[-1], jnp.dtype(x.dtype).name)


def dequantize(q: QArray, dtype=None) -> jax.Array:
  """Reconstruct `(codes - zero_point) * scale` in `dtype` (default: the source dtype)."""
  view, _ = calib.grouped_view_shape(q.shape, q.fmt)
  c = q.codes().reshape(view)
  return _from_codes(c, q.scale, q.zero_point, dtype or q.dtype).reshape(q.shape)


def nbytes(q: QArray) -> int:
  """Bytes the device holds for `q`: codes (as packed) + scales + zero points."""
  # shape/dtype only (not .size): flax's repr swaps leaves for placeholder objects.
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(q))


def estimate_nbytes(shape: Sequence[int], fmt: QFormat) -> dict:
  """The seed's analytic estimate P * b / 8 plus metadata, to compare with `nbytes`.

  Returns:
    dict with 'codes' (P * bits / 8, unpadded), 'metadata' (scales + zero points), 'total'.
  """
  p = math.prod(shape)
  view, axes = calib.grouped_view_shape(tuple(shape), fmt)
  n_scales = math.prod(d for i, d in enumerate(view) if i not in axes)
  per = jnp.dtype(fmt.scale_dtype).itemsize * (1 if fmt.symmetric else 2)
  codes = p * fmt.bits / 8
  return {'codes': codes, 'metadata': n_scales * per, 'total': codes + n_scales * per}
