"""The quantized-array pytree and quantize / dequantize.

`QArray` is the one container every qjax algorithm produces and consumes. Its leaves are
plain arrays (so it passes through `jax.jit`, `jax.vmap`, `jax.tree` utilities, Orbax and
`jax.device_put` with a sharding). Its static metadata is only what the numbers mean: the
code type (`QType`: int of 2-8 bits, packed at 2/3/4 bits, or fp8), the logical length of the
packed last axis and the dtype it dequantizes to. How the scales were chosen (calibration
method, clip search, power-of-two rounding) is the recipe (`QFormat`) that `quantize` reads
and the conversion record keeps, not part of the array: two QArrays of one code type and shape
have the same tree structure whatever calibrated them.

Scales and zero points have the data's rank and tile it (`numerics`): `shape[i] %
scale.shape[i] == 0`. Indexing (`q[rows]`, `q[:, slots]`), `reshape` and `transpose` therefore
act on the QArray directly, and the logical sharding of data and scales is the same list.
This is layout version 2 (`LAYOUT_VERSION`); layout 1 stored scales in a rank+1 "grouped
view", and a model saved in it is refused on load.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from qjax import target as qjax_target
from qjax.core import calibration as calib
from qjax.core import numerics
from qjax.core import packing
from qjax.core import qarray_views
from qjax.core.formats import FLOAT_KINDS, QFormat

LAYOUT_VERSION = 2  # recorded with every saved QArray (conversion records: 'qarray_layout')
# How codes are stored (`QType.layout`; `qjax.core.layouts` chooses one per backend):
# 'packed': 2/3/4-bit codes bit-packed into uint8 by `packing` (the checkpoint format, and
#   what qjax's CPU paths read); 'native': one code per element of a dtype XLA itself knows
#   (int4 for 2-4 bits, int8, fp8), which XLA:GPU/TPU store packed and convert inside the
#   matmul's operand load. 5-8-bit and fp8 codes are stored alike in both.
STORAGE_LAYOUTS = ('packed', 'native')


@dataclasses.dataclass(frozen=True)
class QType:
  """What a QArray's codes are: 'int' of `bits` (2-8) or fp8, and how they are stored.

  Attributes:
    kind: 'int', 'e4m3' or 'e5m2'.
    bits: code width (8 for fp8).
    layout: 'packed' (2/3/4-bit codes bit-packed into uint8) or 'native' (jnp.int4 for 2-4
      bits); 5-8-bit and fp8 codes are stored the same in both (`STORAGE_LAYOUTS`).
  """

  kind: str = 'int'
  bits: int = 8
  layout: str = 'packed'

  def __post_init__(self):
    if self.layout not in STORAGE_LAYOUTS:
      raise ValueError(f'QType: layout={self.layout!r} is unknown; use one of '
                       f'{STORAGE_LAYOUTS}.')

  @classmethod
  def of(cls, fmt: QFormat, layout: str = 'packed') -> 'QType':
    return cls(fmt.kind, fmt.bits, layout)

  @property
  def is_float(self) -> bool:
    return self.kind != 'int'

  @property
  def packed(self) -> bool:
    """Whether the codes are bit-packed by `qjax.core.packing` (uint8 data)."""
    return self.layout == 'packed' and not self.is_float and self.bits in packing.GROUPS

  @property
  def native_int4(self) -> bool:
    """Whether the codes are stored as jnp.int4 (native layout, 2-4 bits)."""
    return self.layout == 'native' and not self.is_float and self.bits <= 4

  @property
  def code_dtype(self):
    return FLOAT_KINDS[self.kind] if self.is_float else jnp.int8

  @property
  def storage_dtype(self):
    if self.native_int4:
      return jnp.int4
    return jnp.uint8 if self.packed else self.code_dtype

  def with_layout(self, layout: str) -> 'QType':
    return dataclasses.replace(self, layout=layout)

  @property
  def name(self) -> str:
    return f'fp8{self.kind}' if self.is_float else f'int{self.bits}'


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized tensor: `x ~= (codes - zero_point) * scale`, each scale shared by a tile.

  Build one with `quantize` or `from_codes` (both validate); derive one with indexing,
  `reshape`, `transpose`, `scaled_by` or `with_dtype`. The constructor validates concrete
  leaves (shapes, dtypes, packing, finite positive scales); pytree unflattening (jit, Orbax,
  sharding specs as leaves) does not.

  Attributes:
    data: stored codes, shape `shape[:-1] + (packed_length(shape[-1]),)`; uint8 when
      bit-packed (2/3/4 bits), int8 for 5/6/8 bits, fp8 for float formats.
    scale: scales, the data's rank, `shape[i] % scale.shape[i] == 0`.
    zero_point: integer-valued zero points of the scale's shape and dtype, or None (0).
    qtype: the code type (static).
    last_dim: logical length of the last axis (packing may pad it; static).
    dtype_name: dtype `dequantize` returns by default (the source tensor's dtype; static).
  """

  data: jax.Array
  scale: jax.Array
  zero_point: Optional[jax.Array]
  qtype: QType
  last_dim: int
  dtype_name: str = 'float32'

  def __post_init__(self):
    _validate(self)

  def tree_flatten(self):
    return (self.data, self.scale, self.zero_point), (self.qtype, self.last_dim, self.dtype_name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return _unchecked(cls, *children, *aux)

  # ---- what it is ------------------------------------------------------------------------
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

  @property
  def bits(self) -> int:
    return self.qtype.bits

  @property
  def tile_shape(self) -> tuple[int, ...]:
    """Elements per scale along each axis."""
    return numerics.tile_shape(self.shape, self.scale.shape)

  @property
  def layout_name(self) -> str:
    """The code type and scale tiling in words, e.g. 'int4 tiles(32,1)-asym'."""
    tiles = ','.join(str(t) for t in self.tile_shape)
    native = '-native' if self.qtype.native_int4 else ''
    return (f'{self.qtype.name}{native} tiles({tiles})'
            f'{"" if self.zero_point is None else "-asym"}')

  def codes(self) -> jax.Array:
    """Unpacked codes in the tensor's own shape (int8, or fp8)."""
    if self.qtype.packed:
      return packing.unpack(self.data, self.qtype.bits, self.last_dim)
    if self.qtype.native_int4:
      return self.data.astype(jnp.int8)
    return self.data

  def dequantize(self, dtype=None) -> jax.Array:
    return dequantize(self, dtype)

  # ---- derived arrays ----------------------------------------------------------------------
  def with_dtype(self, dtype) -> 'QArray':
    """The same codes, dequantizing to `dtype` by default."""
    return dataclasses.replace(self, dtype_name=jnp.dtype(dtype).name)

  def scaled_by(self, factor, *, divide: bool = False) -> 'QArray':
    """Scales multiplied (or divided, in f32) by `factor`, broadcastable to the scale's shape:
    the tensor times (or over) it. A factor that varies within a tile raises."""
    f = jnp.asarray(factor, jnp.float32)
    if f.ndim > self.ndim or jnp.broadcast_shapes(f.shape, self.scale.shape) != self.scale.shape:
      raise ValueError(f'QArray.scaled_by: a factor of shape {f.shape} does not broadcast to '
                       f'the scales {self.scale.shape} of {self.layout_name}; it must be constant '
                       'on every tile.')
    s32 = self.scale.astype(jnp.float32)
    s = (s32 / f if divide else s32 * f).astype(self.scale.dtype)
    return dataclasses.replace(self, scale=s)

  def rebuild(self, leaves: Sequence[Any], last_dim: Optional[int] = None) -> 'QArray':
    """This QArray's structure over other leaves (shards, shardings, abstract values), with
    the static last dim of those leaves if it differs; no validation (like unflattening)."""
    leaves = list(leaves) + [None] * (3 - len(leaves))
    return _unchecked(QArray, leaves[0], leaves[1], leaves[2], self.qtype,
                      self.last_dim if last_dim is None else last_dim, self.dtype_name)

  def __getitem__(self, idx) -> 'QArray':
    return self._with_leaves(*qarray_views.getitem(self, idx))

  def reshape(self, *shape) -> 'QArray':
    """A reshape that keeps every tile whole (merging or splitting axes along tiles)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return self._with_leaves(*qarray_views.reshape(self, tuple(int(d) for d in shape)))

  def _with_leaves(self, data, scale, zero_point, last_dim: int) -> 'QArray':
    """A validated QArray of this one's code type and dtype over new leaves."""
    return QArray(data, scale, zero_point, self.qtype, last_dim, self.dtype_name)

  def transpose(self, *axes) -> 'QArray':
    """Axes permuted; a packed format keeps its last axis last."""
    axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    axes = tuple(range(self.ndim))[::-1] if not axes else tuple(a % self.ndim for a in axes)
    if sorted(axes) != list(range(self.ndim)):
      raise ValueError(f'QArray.transpose: {axes} is not a permutation of {self.ndim} axes.')
    if self.qtype.packed and axes[-1] != self.ndim - 1:
      raise ValueError(f'QArray.transpose: {self.qtype.name} codes are packed along the last '
                       f'axis, which {axes} would move; dequantize first or keep it last.')
    t = lambda a: None if a is None else jnp.transpose(a, axes)
    return QArray(t(self.data), t(self.scale), t(self.zero_point), self.qtype,
                  self.shape[axes[-1]] if not self.qtype.packed else self.last_dim,
                  self.dtype_name)

  @property
  def T(self) -> 'QArray':  # pylint: disable=invalid-name
    return self.transpose()

  def __repr__(self):
    return (f'QArray({self.layout_name}, shape={self.shape}, data={self.data.dtype}'
            f'{list(self.data.shape)}, scale={list(self.scale.shape)}, nbytes={self.nbytes})')


def _unchecked(cls, data, scale, zero_point, qtype, last_dim, dtype_name):
  q = object.__new__(cls)
  for k, v in zip(('data', 'scale', 'zero_point', 'qtype', 'last_dim', 'dtype_name'),
                  (data, scale, zero_point, qtype, last_dim, dtype_name)):
    object.__setattr__(q, k, v)
  return q


def _is_array(x) -> bool:
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


def _validate(q: QArray) -> None:
  """The invariant, checked on construction (values only where concrete)."""
  if not isinstance(q.qtype, QType):
    raise TypeError(f'QArray: qtype must be a QType, got {q.qtype!r}.')
  if not all(_is_array(a) for a in (q.data, q.scale)) or (
      q.zero_point is not None and not _is_array(q.zero_point)):
    raise TypeError('QArray: data, scale (and zero_point) must be arrays; build QArrays with '
                    'quantize() or from_codes().')
  name = f'QArray({q.qtype.name})'
  want = jnp.dtype(q.qtype.storage_dtype)
  if jnp.dtype(q.data.dtype) != want:
    raise ValueError(f'{name}: data has dtype {q.data.dtype}, expected {want}.')
  if q.data.ndim < 1:
    raise ValueError(f'{name}: data must have rank >= 1, got a scalar.')
  stored = packing.packed_length(q.last_dim, q.qtype.bits) if q.qtype.packed else q.last_dim
  if q.data.shape[-1] != stored:
    raise ValueError(f'{name}: last axis of logical length {q.last_dim} is stored in {stored} '
                     f'bytes/codes, but data has {q.data.shape[-1]}.')
  if not jnp.issubdtype(q.scale.dtype, jnp.floating):
    raise ValueError(f'{name}: scale dtype {q.scale.dtype} is not floating.')
  numerics.tile_shape(q.shape, q.scale.shape)  # rank and divisibility
  if q.zero_point is not None and (q.zero_point.shape != q.scale.shape
                                   or q.zero_point.dtype != q.scale.dtype):
    raise ValueError(f'{name}: zero_point {q.zero_point.shape} {q.zero_point.dtype} must match '
                     f'the scale {q.scale.shape} {q.scale.dtype}.')
  if q.zero_point is not None and q.qtype.is_float:
    raise ValueError(f'{name}: fp8 codes have no zero point.')
  if numerics.is_concrete(q.scale) and isinstance(q.scale, (jax.Array, np.ndarray)):
    s = np.asarray(q.scale, np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
      bad = ~(np.isfinite(s) & (s > 0))
      raise ValueError(f'{name}: {int(bad.sum())} scale(s) are not finite and positive '
                       f'(e.g. {s[bad][:3]}); every scale must be > 0 and finite.')


def from_codes(codes: jax.Array, scale: jax.Array, zero_point: Optional[jax.Array],
               qtype: Union[QType, QFormat], dtype=jnp.float32) -> QArray:
  """A QArray from unpacked codes (int8 or fp8, the tensor's shape) and tiling scales.

  Packs sub-byte codes and validates the invariant. For algorithms that choose codes
  themselves (GPTQ's error feedback, a relayout of another QArray).
  """
  qtype = QType.of(qtype) if isinstance(qtype, QFormat) else qtype
  codes = codes.astype(qtype.code_dtype)
  data = packing.pack(codes, qtype.bits) if qtype.packed else codes.astype(qtype.storage_dtype)
  return QArray(data, scale, zero_point, qtype, codes.shape[-1], jnp.dtype(dtype).name)


RangeArg = Union[None, str, tuple[Any, Any]]


def check_input(x, what: str, fmt: QFormat) -> None:
  """The dtype/shape checks every quantizer applies to its input (`quantize`, `fake_quant`).

  Raises:
    ValueError: not a floating array, a scalar, or an empty array (named with its shape).
  """
  if isinstance(x, (list, tuple)) or np.isscalar(x):
    raise ValueError(f'{what}({fmt.name}): got a Python {type(x).__name__}, not an array; '
                     'pass jnp.asarray(x, jnp.float32).')
  dtype = getattr(x, 'dtype', None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'{what}({fmt.name}): expected a floating tensor, got dtype {dtype}; cast '
                     'it with .astype(jnp.float32) first (integer inputs are not values to '
                     'quantize).')
  if x.ndim == 0:
    raise ValueError(f'{what}({fmt.name}): got a scalar; quantize tensors of rank >= 1.')
  if x.size == 0:
    raise ValueError(f'{what}({fmt.name}): got an empty tensor of shape {tuple(x.shape)}; '
                     'there is no range to calibrate: skip it.')


def quantize(x: jax.Array, fmt: QFormat, calibration: RangeArg = None) -> QArray:
  """Quantize `x` to `fmt`.

  Args:
    x: a floating tensor (NaN/Inf rejected when concrete).
    fmt: the format; its axes may be negative or positive.
    calibration: None (use `fmt.calibration`), a method name, or a precomputed (lo, hi) in the
      scale layout (e.g. from `compute_range` over calibration data).

  Returns:
    A QArray with `dequantize(q) ~= x`.
  """
  check_input(x, 'quantize', fmt)
  numerics.check_finite(x, f'quantize({fmt.name}, shape={x.shape}): the tensor')
  sshape = numerics.scale_shape(x.shape, fmt)
  numerics.check_subnormal(x, sshape, f'quantize({fmt.name}, shape={x.shape})')
  if isinstance(calibration, tuple):
    lo, hi = calibration
    if tuple(np.shape(lo)) != sshape or tuple(np.shape(hi)) != sshape:
      raise ValueError(f'quantize({fmt.name}): a range for shape {tuple(x.shape)} must have the '
                       f'scale shape {sshape}, got {np.shape(lo)} and {np.shape(hi)} (use '
                       'compute_range, which returns ranges in that layout).')
    numerics.check_range(lo, hi, f'quantize({fmt.name}, shape={x.shape})')
  else:
    lo, hi = calib.compute_range(x, fmt, calibration)
  scale, zp = numerics.scale_and_zero_point(lo, hi, fmt)
  if numerics.is_concrete(scale):
    numerics.check_scales(scale, fmt, f'quantize({fmt.name}, shape={x.shape})', lo, hi)
  xv = numerics.tiled(x.astype(jnp.float32), sshape)
  z = None if zp is None else numerics.expand(zp)
  codes = numerics.to_codes(xv, numerics.expand(scale), z, fmt).reshape(x.shape)
  return from_codes(codes, scale, zp, QType.of(fmt), x.dtype)


def dequantize(q: QArray, dtype=None) -> jax.Array:
  """Reconstruct `(codes - zero_point) * scale` in `dtype` (default: the source dtype)."""
  c = numerics.tiled(q.codes(), q.scale.shape)
  z = None if q.zero_point is None else numerics.expand(q.zero_point)
  return numerics.from_codes(c, numerics.expand(q.scale), z, dtype or q.dtype).reshape(q.shape)


def nbytes(q: QArray) -> int:
  """Bytes the device holds for `q`: codes (as packed) + scales + zero points.

  Native int4 codes count what the default backend holds per code (`int4_bits`): 4 bits
  where XLA packs them (GPU, TPU, XLA:CPU of jax >= 0.11), 8 where it keeps a byte each.
  """
  # shape/dtype only (not .size): flax's repr swaps leaves for placeholder objects.
  total = 0
  for a in jax.tree.leaves(q):
    n = math.prod(a.shape)
    total += (-(-n * int4_bits() // 8) if jnp.dtype(a.dtype) == jnp.dtype(jnp.int4)
              else n * jnp.dtype(a.dtype).itemsize)
  return total


_INT4_BITS: dict = {}  # backend -> bits one int4 element occupies there (probed once)


def int4_bits(backend: Optional[str] = None) -> int:
  """Bits the backend's buffers spend on one jnp.int4 element (4 packed, 8 unpacked).

  `backend` defaults to the target's (`qjax.target`). Probed once per backend on a
  (512, 1024) buffer, large and aligned so that tiled memory layouts (TPU) add no padding to
  the measurement (`on_device_size_in_bytes`), and cached in `_INT4_BITS`: a fact of the
  runtime, constant for the process. A compile-only target holds no buffer: XLA:GPU and
  XLA:TPU store s4 two per byte, so it counts 4.
  """
  target = qjax_target.current()
  backend = backend or target.backend
  if backend == target.backend and target.compile_only:
    return 4
  if backend not in _INT4_BITS:
    n = 512 * 1024
    with jax.ensure_compile_time_eval():
      buf = jax.device_put(np.zeros((512, 1024), jnp.int4), jax.devices(backend)[0])
      _INT4_BITS[backend] = 4 if int(buf.on_device_size_in_bytes()) * 8 < 6 * n else 8
      del buf
  return _INT4_BITS[backend]


def estimate_nbytes(shape: Sequence[int], fmt: QFormat) -> dict:
  """The seed's analytic estimate P * b / 8 plus metadata, to compare with `nbytes`.

  Returns:
    dict with 'codes' (P * bits / 8, unpadded), 'metadata' (scales + zero points), 'total'.
  """
  p = math.prod(shape)
  n_scales = math.prod(numerics.scale_shape(tuple(shape), fmt))
  per = jnp.dtype(fmt.scale_dtype).itemsize * (1 if fmt.symmetric else 2)
  codes = p * fmt.bits / 8
  return {'codes': codes, 'metadata': n_scales * per, 'total': codes + n_scales * per}
