"""Meshes, partitioning layouts (Pope et al. sec. 3) and what each layout shards where.

Feed-forward layouts (weights are always stored E_x F_yz, as in the paper, so prefill and
decode can use different layouts without moving weights):
  '1d_ws'   weight-stationary, F (and heads) split over all chips x*y*z.
  '2d_ws'   weight-stationary, E split over x, F over y*z.
  'wg_x', 'wg_xy', 'wg_xyz'   weight-gathered: weights all-gathered over the named axes,
            the batch split over them, 1D weight-stationary over the remaining axes.
Attention layouts:
  'multihead'  query and kv heads split like F (needs kv heads divisible by that group).
  'mq_heads'   query heads split, kv heads replicated on every chip of the group (the
               naive multiquery layout, Figure 4b).
  'mq_batch'   Q/K/V moved by all-to-all so attention and the KV cache are split over the
               batch (Figure 4c); the batch group is the largest of x*y*z, y*z, z dividing B.
               Queries are projected head-split first, so with `pad_heads` heads that do not
               divide the model axes are padded here too (unpadded otherwise: the paper's
               count, which qjax's layout cannot run).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from qjax.costmodel import _models
from qjax.costmodel import _names

FFN_LAYOUTS = ('1d_ws', '2d_ws', 'wg_x', 'wg_xy', 'wg_xyz')
ATTN_LAYOUTS = ('multihead', 'mq_heads', 'mq_batch')
AXES = ('x', 'y', 'z')
# Which axes each feed-forward layout gathers weights (and splits the batch) over.
_GATHER_AXES = {'1d_ws': (), '2d_ws': (), 'wg_x': ('x',), 'wg_xy': ('x', 'y'),
                'wg_xyz': AXES}
# Batch groups tried by 'mq_batch', largest first (the paper code's z, yz, yzx options).
_MQ_BATCH_GROUPS = (AXES, ('y', 'z'), ('z',))


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A logical x * y * z chip mesh (z varies fastest in chip numbering)."""

  x: int = 1
  y: int = 1
  z: int = 1

  def __post_init__(self):
    for axis in AXES:
      size = getattr(self, axis)
      if not (isinstance(size, int) and size >= 1):
        raise ValueError(f'Mesh axis {axis} must be a positive int, got {size!r}.')

  @property
  def n(self) -> int:
    return self.x * self.y * self.z

  def size(self, axes: Sequence[str]) -> int:
    """Chips in a group spanning `axes` (1 for no axes)."""
    return math.prod(getattr(self, a) for a in axes)

  def stride(self, axis: str) -> int:
    """Distance in chip numbering between neighbours along `axis`."""
    return {'x': self.y * self.z, 'y': self.z, 'z': 1}[axis]

  def __str__(self) -> str:
    return f'{self.x}x{self.y}x{self.z}'


def as_mesh(mesh: 'Mesh | Sequence[int] | str') -> Mesh:
  """Accepts a Mesh, a tuple like (4, 4, 4) (missing axes are 1) or a string '4x4x4'."""
  if isinstance(mesh, Mesh):
    return mesh
  if isinstance(mesh, str):
    try:
      sizes = [int(s) for s in mesh.lower().split('x')]
    except ValueError:
      raise ValueError(f'Mesh string {mesh!r} is not of the form "4x4x4".') from None
  else:
    sizes = list(mesh)
  if not 1 <= len(sizes) <= 3:
    raise ValueError(f'A mesh has 1 to 3 axes (x, y, z), got {mesh!r}.')
  return Mesh(*sizes)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A feed-forward layout, an attention layout, and whether heads may be padded.

  Attributes:
    ffn: one of FFN_LAYOUTS.
    attn: one of ATTN_LAYOUTS.
    pad_heads: if the heads do not divide the group they are split over, pad them up to a
      multiple instead of failing (Pope et al. padded PaLM 540B from 48 to 64 heads).
    pad_kv_heads: for 'multihead' attention, pad kv heads up to a multiple of the group they
      are split over instead of failing (each shard then holds whole kv heads; the padding
      costs cache memory and bandwidth).
  """

  ffn: str = '2d_ws'
  attn: str = 'mq_batch'
  pad_heads: bool = False
  pad_kv_heads: bool = False

  def __post_init__(self):
    if self.ffn not in FFN_LAYOUTS:
      raise _names.unknown_name('feed-forward layout', self.ffn, FFN_LAYOUTS)
    if self.attn not in ATTN_LAYOUTS:
      raise _names.unknown_name('attention layout', self.attn, ATTN_LAYOUTS)

  def __str__(self) -> str:
    return f'{self.ffn}+{self.attn}'


def as_layout(layout: 'Layout | Sequence[str] | str') -> Layout:
  """Accepts a Layout, a pair ('2d_ws', 'mq_batch') or a string '2d_ws+mq_batch'."""
  if isinstance(layout, Layout):
    return layout
  if isinstance(layout, str):
    layout = layout.split('+')
  return Layout(*layout)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Where one layout puts each dimension on one mesh, after validation.

  Attributes:
    model: the model as run (heads padded if the layout asked for it).
    gather_axes: axes weights are all-gathered over (and the batch split over); () for WS.
    model_axes: axes F is split over by the 1D part (1d_ws: all; wg_*: the rest).
    head_axes: axes query heads are split over when attention is heads-sharded.
    kv_batch_axes: axes the KV cache's batch dimension is split over.
    a2a_axes: axes of the 'mq_batch' all-to-all (empty if none is needed).
    kv_shards: chips one copy of the KV cache is split over (the rest replicate it).
  """

  model: _models.ModelShape
  gather_axes: tuple
  model_axes: tuple
  head_axes: tuple
  kv_batch_axes: tuple
  a2a_axes: tuple
  kv_shards: int


def _axes_str(mesh: Mesh, axes: Sequence[str]) -> str:
  if not axes:
    return 'no axes (1 chip)'
  return '*'.join(axes) + f'={mesh.size(axes)}'


def _divisors_hint(mesh: Mesh, count: int) -> str:
  ok = [d for d in range(1, mesh.n + 1) if mesh.n % d == 0 and count % d == 0]
  return f'group sizes that divide {count}: {ok}'


def shard_plan(model: _models.ModelShape, mesh: Mesh, layout: Layout, batch: int) -> ShardPlan:
  """Checks that `layout` can run `model` at `batch` on `mesh` and says where things go.

  Args:
    model: the model shape.
    mesh: the chip mesh.
    layout: feed-forward and attention layouts.
    batch: sequences per forward pass.

  Returns:
    A `ShardPlan`.

  Raises:
    ValueError: naming the axis group and the count (batch or heads) it does not divide,
      and what would work.
  """
  gather = _GATHER_AXES[layout.ffn]
  model_axes = tuple(a for a in AXES if a not in gather)
  _check_not_degenerate(mesh, layout)
  if gather and batch % mesh.size(gather):
    fits = [f for f in ('wg_x', 'wg_xy', 'wg_xyz') if batch % mesh.size(_GATHER_AXES[f]) == 0]
    raise ValueError(
        f'Layout {layout.ffn!r} splits the batch over mesh axes {_axes_str(mesh, gather)}, '
        f'but batch={batch} is not divisible by {mesh.size(gather)}. Use a batch that is a '
        f'multiple of {mesh.size(gather)}, or a layout whose group divides it: '
        f'{fits + ["1d_ws", "2d_ws"]}.')
  # Heads split over the model-parallel axes: all of them for weight-stationary layouts
  # (2D reduce-scatters the QKV projection over x into the heads too, as Pope et al. always
  # scatter into the hidden dimension), the non-gathered ones for weight-gathered layouts.
  head_axes = model_axes
  n_head_groups = mesh.size(head_axes)
  if layout.attn == 'multihead' and model.n_kv_heads % n_head_groups and layout.pad_kv_heads:
    model = model.padded_kv(n_head_groups)
  if layout.attn == 'multihead' and model.n_kv_heads % n_head_groups:
    raise ValueError(
        f"Attention layout 'multihead' with {layout.ffn!r} splits kv heads over mesh axes "
        f'{_axes_str(mesh, head_axes)}, but {model.name} has {model.n_kv_heads} kv heads, not '
        f'divisible by {n_head_groups} (padding would invent kv heads). Use attention '
        f"'mq_batch' (cache split over the batch) or 'mq_heads' (cache replicated), "
        f'Layout(pad_kv_heads=True) to pad kv heads to {n_head_groups}'
        + (f', or a mesh whose {"*".join(head_axes)} group divides {model.n_kv_heads} '
           f'({_divisors_hint(mesh, model.n_kv_heads)}).' if model.n_kv_heads > 1 else '.'))
  if layout.attn in ('multihead', 'mq_heads') and model.n_heads % n_head_groups:
    if not layout.pad_heads:
      raise ValueError(
          f'Attention layout {layout.attn!r} with {layout.ffn!r} splits query heads over mesh '
          f'axes {_axes_str(mesh, head_axes)}, but {model.name} has {model.n_heads} heads, not '
          f'divisible by {n_head_groups}. Use a mesh whose {"*".join(head_axes)} group '
          f'divides {model.n_heads} ({_divisors_hint(mesh, model.n_heads)}), '
          f"Layout(pad_heads=True) to pad heads as Pope et al. did, or attention 'mq_batch'.")
    model = model.padded(n_head_groups)
  if layout.attn == 'mq_batch' and layout.pad_heads and model.n_heads % n_head_groups:
    # qjax's layout projects queries head-split over every model axis before the all-to-all
    # moves them to the batch, so the heads must split there too; Pope et al. padded.
    model = model.padded(n_head_groups)
  a2a_axes: tuple = ()
  if layout.attn == 'multihead':
    kv_batch_axes, kv_shards = gather, mesh.n
  elif layout.attn == 'mq_heads':
    kv_batch_axes = gather
    kv_shards = mesh.size(gather)
  else:
    kv_batch_axes = _mq_batch_group(mesh, batch, gather)
    kv_shards = mesh.size(kv_batch_axes)
    a2a_axes = tuple(a for a in kv_batch_axes if a not in gather)
  return ShardPlan(model=model, gather_axes=gather, model_axes=model_axes, head_axes=head_axes,
                   kv_batch_axes=kv_batch_axes, a2a_axes=a2a_axes, kv_shards=kv_shards)


def _check_not_degenerate(mesh: Mesh, layout: Layout) -> None:
  """Rejects a multi-chip mesh on which the layout is really a simpler one."""
  if mesh.n == 1:
    return  # one chip shards nothing; every layout is the same there
  if layout.ffn == '2d_ws' and (mesh.x == 1 or mesh.y * mesh.z == 1):
    raise ValueError(
        f"Layout '2d_ws' splits E over x and F over y*z, but mesh {mesh} leaves one of them "
        f"at 1, which is '1d_ws'. Use a mesh with x > 1 and y*z > 1, or '1d_ws'.")
  for axis in _GATHER_AXES[layout.ffn] if layout.ffn.startswith('wg') else ():
    if mesh.size((axis,)) == 1:
      raise ValueError(
          f'Layout {layout.ffn!r} gathers weights over {"*".join(_GATHER_AXES[layout.ffn])}, '
          f'but mesh {mesh} has {axis}=1, so it is a smaller layout under another name. Use a '
          f'mesh with {axis} > 1 or the weight-gathered layout over fewer axes.')


def _mq_batch_group(mesh: Mesh, batch: int, gather: tuple) -> tuple:
  """The largest batch group for 'mq_batch' that divides `batch` and contains `gather`."""
  candidates = [g for g in _MQ_BATCH_GROUPS if set(gather) <= set(g)] + [gather]
  for group in candidates:
    if batch % mesh.size(group) == 0 and (mesh.size(group) > 1 or mesh.n == 1):
      return tuple(group)
  sizes = ', '.join(_axes_str(mesh, g) for g in _MQ_BATCH_GROUPS if mesh.size(g) > 1)
  smallest = min(mesh.size(g) for g in _MQ_BATCH_GROUPS if mesh.size(g) > 1)
  mesh_hint = f', a mesh whose z axis divides {batch}' if batch > 1 else ''
  raise ValueError(
      f"Attention layout 'mq_batch' splits the batch over one of the mesh groups ({sizes}), "
      f'but batch={batch} is divisible by none of them. Use a batch that is a multiple of '
      f"{smallest}{mesh_hint}, or attention 'mq_heads' (heads-sharded, cache replicated).")
