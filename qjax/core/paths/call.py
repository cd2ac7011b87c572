"""`Call`: the static facts of one quantized matmul that decide its path.

Everything here is read from shapes and the weight's static code type, never from values, so
a call is described the same way for concrete arrays, tracers and `jax.ShapeDtypeStruct`s (a
record can name the path a layer takes at prefill and at decode without running it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from qjax.core import decode_paths
from qjax.core import tiled_path
from qjax.core.qarray import QType

# Row buckets the table names (`Call.bucket`): decode steps multiply a few rows, prefill many.
DECODE_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Call:
  """One `qeinsum(spec, x, w)` with a QArray weight, as the chooser sees it.

  Attributes:
    xs, ws, out: the parsed spec (activation, weight and output letters).
    x_shape: the activations' shape; x_dtype: their dtype's name.
    w_shape: the weight's logical shape.
    qtype: the weight's code type (kind, bits, storage layout).
    tile_shape: weight elements per scale along each axis (`QArray.tile_shape`).
    scale_shape: the scales' shape.
    zero_point: whether the weight has zero points (asymmetric).
    act: None (weight-only), 'int' (int8 activations) or an fp8 kind ('e4m3', 'e5m2').
    w: the weight itself (only its shapes are read; not part of equality).
  """

  xs: str
  ws: str
  out: str
  x_shape: tuple
  x_dtype: str
  w_shape: tuple
  qtype: QType
  tile_shape: tuple
  scale_shape: tuple
  zero_point: bool
  act: Optional[str] = None
  w: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  @classmethod
  def of(cls, spec_or_parts, x, w, act: Optional[str] = None) -> 'Call':
    """The Call of `qeinsum(spec, x, w)` (x and w concrete, traced or abstract)."""
    xs, ws, out = (tiled_path.parse_spec(spec_or_parts) if isinstance(spec_or_parts, str)
                   else spec_or_parts)
    return cls(xs, ws, out, tuple(x.shape), str(getattr(x.dtype, 'name', x.dtype)),
               tuple(w.shape), w.qtype, tuple(w.tile_shape), tuple(w.scale.shape),
               w.zero_point is not None, act, w)

  @property
  def spec(self) -> str:
    return f'{self.xs},{self.ws}->{self.out}'

  @property
  def rows(self) -> int:
    """M: activation elements per contracted slice (tokens times anything not in w)."""
    return math.prod(d for c, d in zip(self.xs, self.x_shape) if c not in self.ws)

  @property
  def bucket(self) -> str:
    """'decode' (at most DECODE_ROWS rows) or 'prefill'."""
    return 'decode' if self.rows <= DECODE_ROWS else 'prefill'

  @property
  def contracted(self) -> tuple[int, ...]:
    """Weight axes summed over."""
    return tuple(i for i, c in enumerate(self.ws) if c in self.xs and c not in self.out)

  @property
  def form(self) -> str:
    """'kn' (weight (contracted..., kept...): a free reshape to (K, N)), 'nk' (the tied head
    (N, K), 'BTD,VD->BTV') or 'other'."""
    if tiled_path.canonical_axes(self.xs, self.ws, self.out) is not None:
      return 'kn'
    return 'nk' if decode_paths.head_axes(self.xs, self.ws, self.out) else 'other'

  @property
  def k(self) -> int:
    return math.prod(self.w_shape[i] for i in self.contracted)

  @property
  def n(self) -> int:
    return math.prod(d for i, d in enumerate(self.w_shape) if i not in self.contracted)

  @property
  def group(self) -> Optional[int]:
    """Contraction elements per scale (K for scales constant along the contraction), or None
    where scales vary along several contracted axes or per element of one."""
    contracted = self.contracted
    if all(self.scale_shape[i] == 1 for i in contracted):
      return self.k
    # Groups are runs of the flattened contraction: from the first contracted axis a scale
    # tile does not span by single elements, every later contracted axis is whole.
    p = next((j for j, i in enumerate(contracted) if self.tile_shape[i] != 1), len(contracted))
    if any(self.tile_shape[i] != self.w_shape[i] for i in contracted[p + 1:]):
      return None
    return math.prod(self.tile_shape[i] for i in contracted[p:])

  @property
  def per_channel(self) -> bool:
    """Scales constant along the contraction (one per output channel, or per tensor)."""
    return self.group == self.k

  @property
  def weight_name(self) -> str:
    g = self.group
    grouping = ('per channel' if g == self.k else f'g{g}' if g is not None else
                'scales along the contraction')
    return f"{self.qtype.name} {self.qtype.layout} {grouping}{' asym' if self.zero_point else ''}"
