"""Number formats: what a quantized tensor's codes mean and how scales are laid out.

A `QFormat` is frozen and hashable, so it can be a static field of a pytree, a key of a
`jax.jit` cache and a line of a conversion record. It answers three questions:

* **codes**: signed integers of `bits` in {2, 3, 4, 5, 6, 8}, or an fp8 dtype
  (`'e4m3'`, max 448; `'e5m2'`, max 57344);
* **scale layout** (granularity): one scale per tensor (default), per channel along
  `channel_axes` (each index along those axes gets its own scale), and/or per group of
  `group_size` consecutive elements along `group_axis` (the contraction axis of a weight);
  groups combine with channels (e.g. group along D x channel along F);
* **how scales are chosen**: symmetric (zero point 0, codes in [-qmax, qmax] with
  qmax = 2**(bits-1) - 1, the seed's "narrow" range) or asymmetric (codes in
  [-2**(bits-1), 2**(bits-1) - 1] plus an integer zero point), optional power-of-two scales
  (exact under re-scaling, needed for bit-exact QAT), the calibration method that picks the
  range, and the dtype scales and zero points are stored in (they count in the memory).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import jax.numpy as jnp
import ml_dtypes

INT_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_KINDS = {'e4m3': jnp.float8_e4m3fn, 'e5m2': jnp.float8_e5m2}
CALIBRATIONS = ('absmax', 'minmax', 'percentile', 'mse')
_SCALE_DTYPES = ('float32', 'bfloat16', 'float16')
MSE_MAX_GRID = 1000  # MSE calibration tries this many clip ratios at most
_EXAMPLES = {'bits': 4, 'group_size': 128, 'group_axis': 0}


@dataclasses.dataclass(frozen=True)
class QFormat:
  """A quantization format: code type, scale granularity and scale choice.

  Attributes:
    bits: code width for integer formats (2, 3, 4, 5, 6, 8); 8 for fp8.
    kind: 'int' or an fp8 kind, 'e4m3' / 'e5m2'.
    symmetric: zero point fixed at 0 (always True for fp8).
    channel_axes: axes whose every index gets its own scale (per-channel); () = none.
    group_size: elements per group along `group_axis`, or None for no grouping.
    group_axis: the axis split into groups (a weight's contraction axis).
    pow2_scale: round scales up to a power of two.
    scale_dtype: storage dtype of scales and zero points ('float32', 'bfloat16', 'float16').
    calibration: how the range is chosen: 'absmax' / 'minmax' (the full range: max |x| for
      symmetric formats, [min x, max x] for asymmetric ones, whichever name is used),
      'percentile' (clip at `calibration_arg` percent of |x|), 'mse' (grid search of clip
      ratios minimizing reconstruction MSE, `calibration_arg` grid points).
    calibration_arg: the percentile (e.g. 99.9) or number of MSE grid points.
  """

  bits: int = 8
  kind: str = 'int'
  symmetric: bool = True
  channel_axes: tuple[int, ...] = ()
  group_size: Optional[int] = None
  group_axis: int = 0
  pow2_scale: bool = False
  scale_dtype: str = 'float32'
  calibration: str = 'absmax'
  calibration_arg: Optional[float] = None

  def __post_init__(self):
    object.__setattr__(self, 'channel_axes', tuple(int(a) for a in self.channel_axes))
    # Integers only: 4.0 would pass `in INT_BITS` and 3.5 the range check, then fail (or
    # silently truncate) deep inside the packing and the reshapes.
    for name in ('bits', 'group_size', 'group_axis'):
      v = getattr(self, name)
      if v is None and name == 'group_size':
        continue
      if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f'QFormat: {name}={v!r} must be an integer (got '
                         f'{type(v).__name__}); e.g. {name}={_EXAMPLES[name]}.')
      object.__setattr__(self, name, int(v))
    if self.kind == 'int':
      if self.bits not in INT_BITS:
        raise ValueError(
            f'QFormat: integer bits={self.bits} is not supported; use one of {INT_BITS} '
            '(1-bit and 7-bit codes have no kernel path here; 9+ bits: use float).')
    elif self.kind in FLOAT_KINDS:
      if self.bits != 8:
        raise ValueError(f"QFormat: kind={self.kind!r} is an 8-bit format, got bits={self.bits}; "
                         'use bits=8.')
      if not self.symmetric:
        raise ValueError(f'QFormat: fp8 kind={self.kind!r} has no zero point; use symmetric=True.')
    else:
      raise ValueError(f"QFormat: unknown kind={self.kind!r}; use 'int' or one of "
                       f'{sorted(FLOAT_KINDS)}.')
    if self.group_size is not None and not 1 <= self.group_size <= 65536:
      raise ValueError(f'QFormat: group_size={self.group_size} must be in [1, 65536] '
                       '(typically 32, 64 or 128), or None for no grouping.')
    if self.scale_dtype not in _SCALE_DTYPES:
      raise ValueError(f'QFormat: scale_dtype={self.scale_dtype!r} is not a floating dtype '
                       f'we store scales in; use one of {_SCALE_DTYPES}.')
    if self.calibration not in CALIBRATIONS:
      raise ValueError(f'QFormat: calibration={self.calibration!r} is unknown; use one of '
                       f'{CALIBRATIONS}.')
    if self.calibration == 'percentile':
      p = self.calibration_arg
      if p is None or not 50.0 < p <= 100.0:
        raise ValueError(f'QFormat: percentile calibration needs calibration_arg in (50, 100], '
                         f'got {p!r}; e.g. calibration_arg=99.9.')

    if self.calibration == 'mse' and self.calibration_arg is not None:
      n = self.calibration_arg
      if isinstance(n, bool) or not float(n).is_integer() or not 2 <= n <= MSE_MAX_GRID:
        raise ValueError(f'QFormat: mse calibration_arg={n!r} is the number of clip ratios '
                         f'tried; it must be an integer in [2, {MSE_MAX_GRID}] (e.g. 20), or '
                         'None for the default.')

  # ---- derived facts -------------------------------------------------------------------
  @property
  def is_float(self) -> bool:
    return self.kind != 'int'

  @property
  def qmin(self) -> float:
    """Smallest code (symmetric ints use the narrow range -qmax)."""
    if self.is_float:
      return -self.qmax
    return -self.qmax if self.symmetric else -(2 ** (self.bits - 1))

  @property
  def qmax(self) -> float:
    if self.is_float:
      return float(ml_dtypes.finfo(FLOAT_KINDS[self.kind]).max)
    return 2 ** (self.bits - 1) - 1

  @property
  def code_dtype(self):
    """Dtype of unpacked codes (int8 for every integer width)."""
    return FLOAT_KINDS[self.kind] if self.is_float else jnp.int8

  @property
  def packed(self) -> bool:
    """Whether codes are bit-packed in storage (2, 3, 4 bits)."""
    return not self.is_float and self.bits in (2, 3, 4)

  @property
  def storage_bits(self) -> int:
    """Bits one code occupies in storage (5- and 6-bit codes take a full byte)."""
    return self.bits if self.packed else 8

  @property
  def name(self) -> str:
    """Short human label, e.g. 'int4-g128-asym' or 'fp8e4m3-ch1'."""
    s = f'fp8{self.kind}' if self.is_float else f'int{self.bits}'
    if self.group_size:
      s += f'-g{self.group_size}'
    if self.channel_axes:
      s += '-ch' + ''.join(str(a) for a in self.channel_axes)
    if not self.group_size and not self.channel_axes:
      s += '-tensor'
    if not self.symmetric:
      s += '-asym'
    if self.pow2_scale:
      s += '-pow2'
    if self.calibration not in ('absmax', 'minmax'):
      s += f'-{self.calibration}'
    return s

  def replace(self, **kw) -> 'QFormat':
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def int_format(bits: int, *, group_size: Optional[int] = None, channel_axes=(),
               symmetric: bool = True, **kw) -> QFormat:
  """An integer format; e.g. `int_format(4, group_size=128, channel_axes=(1,))`."""
  return QFormat(bits=bits, kind='int', group_size=group_size, channel_axes=tuple(channel_axes),
                 symmetric=symmetric, **kw)


def fp8_format(kind: str = 'e4m3', *, group_size: Optional[int] = None, channel_axes=(),
               **kw) -> QFormat:
  """An fp8 format with a scale ('e4m3': max 448, 'e5m2': max 57344)."""
  return QFormat(bits=8, kind=kind, group_size=group_size, channel_axes=tuple(channel_axes),
                 **kw)


def normalize_axis(axis: int, ndim: int, what: str) -> int:
  """Resolve a possibly negative axis, with a clear error when out of range."""
  if not -ndim <= axis < ndim:
    raise ValueError(f'{what}: axis {axis} is out of range for a {ndim}-d tensor; '
                     f'use an axis in [{-ndim}, {ndim - 1}].')
  return axis % ndim
