"""Layouts as data: one table per Pope et al. layout, logical axis -> mesh axes (x, y, z).

Names follow `qjax.costmodel` ('2d_ws+mq_batch'). A table maps every logical axis of
`qjax.nn.axes` to a tuple of mesh axes, major first (`()` = replicated on purpose). Weight
axes say how weights are *stored*; the activation axes (`act_*`, `batch`, `cache_batch`) say
how activations and the KV cache are split.

Stored weights (so prefill and decode can switch layouts without moving weights):
  1d_ws                 E F_xyz, heads and vocab like F.
  2d_ws, wg_x/xy/xyz    E_x F_zy, heads and vocab like F. z is major in F_zy so that the
                        weight-gathered layouts, which gather the *minor* mesh axes of a dim,
                        leave contiguous blocks (wg_xy gathers y: F_zy -> F_z).
Activations between layers (the residual stream BTD), MLP hidden (BTF), heads:
  1d_ws   B, E, F_xyz, heads_xyz: the residual stream is whole on every chip (as in Megatron),
          so a block's input needs no gather and its output projection all-reduces. The
          bytes are those of Pope et al.'s gather-in / scatter-out of an E_xyz residual, but
          the TPU compiler all-reduces that gather and scatter too when E / chips is not whole
          128-lane tiles (PaLM 540B: 18432 / 64 = 288), which doubled them.
  2d_ws   B, E_xzy, F_zyx, heads_zyx: an input all-gathers over zy (-> E_x), a projection
          reduce-scatters its partial sums over x (-> F_zyx), the output projection
          all-gathers x and reduce-scatters over zy.
  wg_*    B over the gathered axes, 1D weight-stationary over the others; weights are
          all-gathered over the gathered axes just before use.
Attention:
  multihead  kv heads split like query heads; the cache follows.
  mq_heads   query heads split, the single kv head replicated (cache replicated over the
             head axes).
  mq_batch   queries all-to-all from head-split to batch-split over the head axes, so the
             cache batch is split over every axis (batch % chips == 0), then back.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec

from qjax import costmodel
from qjax.nn import axes as ax

MESH_AXES = ('x', 'y', 'z')
_XYZ, _ZY, _ZYX, _XZY = ('x', 'y', 'z'), ('z', 'y'), ('z', 'y', 'x'), ('x', 'z', 'y')
_WEIGHT_NAMES = (ax.EMBED, ax.MLP, ax.Q_HEADS, ax.KV_HEADS, ax.HEAD_DIM, ax.VOCAB)

_STORED_1D = {ax.EMBED: (), ax.MLP: _XYZ, ax.Q_HEADS: _XYZ, ax.KV_HEADS: _XYZ,
              ax.VOCAB: _XYZ, ax.HEAD_DIM: ()}
_STORED_2D = {ax.EMBED: ('x',), ax.MLP: _ZY, ax.Q_HEADS: _ZY, ax.KV_HEADS: _ZY,
              ax.VOCAB: _ZY, ax.HEAD_DIM: ()}


def _acts(batch, embed, hidden):
  """Activation rules: batch split, residual D, and the split of F, heads and vocab."""
  return {ax.BATCH: batch, ax.ACT_EMBED: embed, ax.ACT_MLP: hidden, ax.ACT_HEADS: hidden,
          ax.ACT_VOCAB: hidden, ax.LENGTH: (), ax.CACHE_LENGTH: ()}


# ffn layout -> (stored weights, gather axes, activations)
FFN_TABLES = {
    '1d_ws': (_STORED_1D, (), _acts((), (), _XYZ)),
    '2d_ws': (_STORED_2D, (), _acts((), _XZY, _ZYX)),
    'wg_x': (_STORED_2D, ('x',), _acts(('x',), _ZY, _ZY)),
    'wg_xy': (_STORED_2D, ('x', 'y'), _acts(('x', 'y'), ('z',), ('z',))),
    'wg_xyz': (_STORED_2D, _XYZ, _acts(_XYZ, (), ())),
}


def _attention(attn: str, acts: Mapping) -> dict:
  """Rules for kv heads (weights, activations, cache) and the cache batch."""
  if attn == 'multihead':
    return {ax.ACT_KV_HEADS: acts[ax.ACT_HEADS], ax.CACHE_BATCH: acts[ax.BATCH]}
  mq = {ax.KV_HEADS: (), ax.ACT_KV_HEADS: ()}
  if attn == 'mq_heads':
    return {**mq, ax.CACHE_BATCH: acts[ax.BATCH]}
  return {**mq, ax.CACHE_BATCH: acts[ax.BATCH] + acts[ax.ACT_HEADS]}


@dataclasses.dataclass(frozen=True)
class Rules:
  """One layout's rules table.

  Attributes:
    layout: the costmodel `Layout` (ffn + attention names).
    table: (logical axis, mesh axes) pairs; mesh axes major first, () = replicated.
    gather: mesh axes weights are all-gathered over just before use (weight-gathered).
    replicated_ok: logical-axes tuples of weights the layout replicates on purpose (the
      multiquery kv projections); any other fully replicated matrix is an error.
  """

  layout: costmodel.Layout
  table: tuple
  gather: tuple = ()
  replicated_ok: frozenset = frozenset()

  def __post_init__(self):
    names = [name for name, _ in self.table]
    if len(set(names)) != len(names):
      dup = sorted({n for n in names if names.count(n) > 1})
      raise ValueError(f'Rules {self.layout}: logical axes {dup} have more than one rule.')
    for name, mesh_axes in self.table:
      _check_mesh_axes(f'Rules {self.layout}: rule {name!r}', mesh_axes)
    _check_mesh_axes(f'Rules {self.layout}: gather', self.gather)
    for what, names in _SIGNATURES.items():  # collisions, before any tensor exists
      self.mesh_axes_of(names, what)

  def __str__(self) -> str:
    return str(self.layout)

  @property
  def as_dict(self) -> dict:
    return dict(self.table)

  def axes(self, name: str, what: str = 'a tensor') -> tuple:
    """Mesh axes of one logical axis; a name with no rule is an error, never replicated."""
    table = self.as_dict
    if name not in table:
      raise ValueError(
          f'Layout {self}: no rule for logical axis {name!r} of {what}. A tensor left out of '
          f'the table is not silently replicated: add ({name!r}, ()) to replicate it on '
          f'purpose, or map it to mesh axes. Rules exist for {sorted(table)}.')
    return table[name]

  def compute_axes(self, name: str, what: str = 'a weight') -> tuple:
    """Mesh axes of a weight axis when used: stored axes minus the gathered (minor) ones."""
    stored = self.axes(name, what)
    kept = tuple(a for a in stored if a not in self.gather)
    if stored[:len(kept)] != kept:
      raise ValueError(f'Layout {self}: {what} axis {name!r} is stored over {stored} and '
                       f'gathered over {self.gather}; gathered axes must be the minor ones '
                       'of a dim, or the gathered blocks are not contiguous.')
    return kept

  def mesh_axes_of(self, logical: Sequence, what: str) -> tuple:
    """Per dim mesh axes of a tensor with `logical` axes (None dims: replicated)."""
    out = tuple(() if name is None else self.axes(name, what) for name in logical)
    seen = {}
    for name, mesh_axes in zip(logical, out):
      for a in mesh_axes:
        if a in seen:
          raise ValueError(
              f'Layout {self}: {what} has logical axes {seen[a]!r} and {name!r} both on mesh '
              f'axis {a!r} (colliding axes); a mesh axis can split one dimension of a '
              'tensor only. Change one of the two rules.')
        seen[a] = name
    return out

  def spec(self, logical: Sequence, what: str = 'a tensor') -> PartitionSpec:
    """PartitionSpec of a tensor with `logical` axes."""
    return to_spec(self.mesh_axes_of(logical, what))

  def unused(self, used_names) -> list:
    """Rules that matched no logical axis in `used_names` (a report, as qwix does)."""
    return sorted(set(self.as_dict) - set(used_names))


def to_spec(mesh_axes_per_dim: Sequence[tuple]) -> PartitionSpec:
  """((), ('x',), ('z', 'y')) -> P(None, 'x', ('z', 'y'))."""
  return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a)
                         for a in mesh_axes_per_dim))


def _check_mesh_axes(what: str, mesh_axes) -> None:
  bad = [a for a in mesh_axes if a not in MESH_AXES]
  if not isinstance(mesh_axes, tuple) or bad or len(set(mesh_axes)) != len(mesh_axes):
    raise ValueError(f'{what}: {mesh_axes!r} must be a tuple of distinct mesh axes from '
                     f'{MESH_AXES}, e.g. ("z", "y") or () to replicate.')


# Every tensor kind a layer produces, by logical axes: checked for collisions up front.
_SIGNATURES = {
    **{f'weight {k}': v for k, v in ax.WEIGHT_AXES.items()},
    **{f'activation {k}': tuple(ax.ACT_AXES[c] for c in k)
       for k in ('BTD', 'BTF', 'BTNH', 'BTKH', 'BTV')},
    'the KV cache': ax.KV_CACHE_AXES,
}


def layout_rules(layout) -> Rules:
  """The rules table of a layout: a costmodel `Layout`, ('2d_ws', 'mq_batch') or '2d_ws+mq_batch'.

  Raises:
    ValueError: for an unknown layout name (with the closest valid one).
  """
  layout = costmodel.as_layout(layout)
  stored, gather, acts = FFN_TABLES[layout.ffn]
  table = {**stored, **acts}
  table.update(_attention(layout.attn, acts))
  ok = frozenset({ax.WEIGHT_AXES['DKH'], (ax.KV_HEADS, ax.HEAD_DIM)}
                 if layout.attn != 'multihead' else ())
  return Rules(layout=layout, table=tuple(sorted(table.items())), gather=gather,
               replicated_ok=ok)


def all_layouts() -> list:
  """Every (ffn, attention) pair, as costmodel Layouts."""
  return [costmodel.Layout(f, a) for f, a in itertools.product(costmodel.FFN_LAYOUTS,
                                                                costmodel.ATTN_LAYOUTS)]


def same_stored_weights(a: Rules, b: Rules) -> bool:
  """Whether two layouts store every weight identically (no resharding between them)."""
  return all(a.axes(n) == b.axes(n) for n in _WEIGHT_NAMES)
