"""Indexing and reshaping of a `QArray`'s leaves without dequantizing them.

Scales and zero points tile the data (`qjax.core.numerics`), so an index or a reshape that keeps
every tile whole acts on codes and scales alike; one that would cut a tile or a packed byte is
refused with the reason. `QArray.__getitem__` and `QArray.reshape` call these and wrap the new
leaves they return, so this module sits below `qarray` and does not import it.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core import packing

# The new QArray's (data, scale, zero_point, last_dim): its leaves and its static last dim.
Leaves = tuple[jax.Array, jax.Array, Optional[jax.Array], int]


def _expand_index(idx, ndim: int) -> list:
  """`idx` as one entry per data axis (None entries kept in place), Ellipsis expanded."""
  idx = list(idx) if isinstance(idx, tuple) else [idx]
  n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
  if sum(i is Ellipsis for i in idx) > 1:
    raise IndexError('QArray: an index can only have a single ellipsis.')
  if Ellipsis in idx:
    k = idx.index(Ellipsis)
    idx = idx[:k] + [slice(None)] * (ndim - n_real) + idx[k + 1:]
  else:
    idx = idx + [slice(None)] * (ndim - n_real)
  if sum(1 for i in idx if i is not None) != ndim:
    raise IndexError(f'QArray: too many indices for a {ndim}-d QArray.')
  return idx


def getitem(q, idx) -> Leaves:
  """The leaves of `q[idx]` (q a QArray) for ints, slices, integer arrays, None and Ellipsis,
  tile by tile.

  An integer (array) index on an axis picks each element's scale (`i // tile`); a slice on
  an axis must start and stop on tile boundaries (or the axis has one scale for all). On a
  packed last axis only whole byte groups can be sliced.
  """
  parts = _expand_index(idx, q.ndim)
  tiles, last = q.tile_shape, q.ndim - 1
  d_idx, s_idx, axis, last_dim = [], [], 0, q.last_dim
  for p in parts:
    if p is None:
      if q.qtype.packed and axis > last:
        raise IndexError('QArray: a new axis after the packed last axis would move it; '
                         'dequantize first.')
      d_idx.append(None)
      s_idx.append(None)
      continue
    n, t, k = q.shape[axis], tiles[axis], q.scale.shape[axis]
    packed_here = q.qtype.packed and axis == last
    if isinstance(p, slice):
      start, stop, step = p.indices(n)
      stop = max(stop, start)
      if step != 1 and (packed_here or (t != 1 and k != 1)):
        raise IndexError(f'QArray: a strided slice {p} on axis {axis} needs a scale per '
                         f'element there, or one for the whole axis (tile {t}).')
      if k == 1:
        s_idx.append(slice(None))
      elif start % t or (stop % t and stop != n):
        raise IndexError(f'QArray: slice {p} on axis {axis} cuts tiles of {t}; slice on '
                         f'multiples of {t}.')
      else:
        s_idx.append(slice(start // t, -(-stop // t), step))
      if packed_here:
        per, nb = packing.GROUPS[q.qtype.bits]
        if start % per or (stop % per and stop != n):
          raise IndexError(f'QArray: slice {p} of the packed last axis cuts {q.qtype.name} '
                           f'byte groups of {per} codes; slice on multiples of {per}.')
        d_idx.append(slice(start // per * nb, -(-stop // per) * nb))
        last_dim = stop - start
      else:
        d_idx.append(slice(start, stop, step))
    else:  # an integer or an integer array
      if packed_here:
        raise IndexError(f'QArray: cannot gather single codes of the packed {q.qtype.name} last '
                         'axis; slice whole byte groups, or dequantize first.')
      a = p if isinstance(p, (int, np.integer)) else jnp.asarray(p)
      if not isinstance(a, (int, np.integer)) and not jnp.issubdtype(a.dtype, jnp.integer):
        raise IndexError(f'QArray: index {p!r} on axis {axis} is not an integer (array).')
      d_idx.append(a)
      s_idx.append((a % n) // t)
    axis += 1
  data = q.data[tuple(d_idx)]
  if data.ndim == 0:
    raise IndexError('QArray: indexing down to a scalar; dequantize first.')
  scale = q.scale[tuple(s_idx)]
  zp = None if q.zero_point is None else q.zero_point[tuple(s_idx)]
  return data, scale, zp, last_dim if q.qtype.packed else data.shape[-1]


def reshape(q, shape: tuple[int, ...]) -> Leaves:
  """The leaves of `q` (a QArray) reshaped keeping tiles whole: axes are matched in runs of
  equal size (merged or split)."""
  if -1 in shape:
    known = math.prod(d for d in shape if d != -1)
    shape = tuple(q.size // known if d == -1 else d for d in shape)
  if math.prod(shape) != q.size or not shape:
    raise ValueError(f'QArray.reshape: cannot reshape {q.shape} to {shape}.')
  if q.qtype.packed and shape[-1] != q.shape[-1]:
    raise ValueError(f'QArray.reshape: {q.qtype.name} codes are packed along the last axis '
                     f'({q.shape[-1]}); a reshape to {shape} must keep it.')
  old, tiles = q.shape, q.tile_shape
  oi = [k for k, d in enumerate(old) if d != 1]  # size-1 axes carry one scale: skip them
  nj = [k for k, d in enumerate(shape) if d != 1]
  new_scale = [1] * len(shape)
  i = j = 0
  while i < len(oi):
    i2, j2 = i + 1, j + 1
    po, pn = old[oi[i]], shape[nj[j]]
    while po != pn:
      if po < pn:
        po, i2 = po * old[oi[i2]], i2 + 1
      else:
        pn, j2 = pn * shape[nj[j2]], j2 + 1
    dims = _retile([old[k] for k in oi[i:i2]], [tiles[k] for k in oi[i:i2]],
                   [shape[k] for k in nj[j:j2]], q)
    for k, d in zip(nj[j:j2], dims):
      new_scale[k] = d
    i, j = i2, j2
  r = lambda a: None if a is None else a.reshape(tuple(new_scale))
  data = q.data.reshape(shape[:-1] + (q.data.shape[-1],)) if q.qtype.packed else (
      q.data.reshape(shape))
  return data, r(q.scale), r(q.zero_point), shape[-1]


def _retile(old, tiles, new, q) -> list:
  """Scale dims for new axes `new` that replace old axes `old` (tiled by `tiles`)."""
  # The run's elements in row-major order: the tiling is "t_flat" contiguous elements per
  # scale iff axes before some p have tile 1 and axes after p are whole.
  p = next((k for k, t in enumerate(tiles) if t != 1), len(old))
  if any(t != d for t, d in zip(tiles[p + 1:], old[p + 1:])):
    raise ValueError(f'QArray.reshape: {q.layout_name} of shape {q.shape} has tiles that '
                     f'{tuple(old)} -> {tuple(new)} would cut; dequantize first.')
  flat = (tiles[p] * math.prod(old[p + 1:])) if p < len(old) else 1
  out = []
  for d in reversed(new):  # split `flat` elements per scale over the new axes, last first
    if flat >= d and flat % d == 0:
      out.append(1)
      flat //= d
    elif d % flat == 0:
      out.append(d // flat)
      flat = 1
    else:
      raise ValueError(f'QArray.reshape: tiles of {flat} elements do not fit axis {d} in '
                       f'{tuple(old)} -> {tuple(new)}; dequantize first.')
  return out[::-1]
