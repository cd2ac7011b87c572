"""From a rules table to shardings of concrete pytrees: model state, QArrays, KV caches.

A quantized weight keeps the float weight's logical axes (`QWeight.logical_axes`); they map
onto its leaves as follows. Codes (`data`) have the weight's dims, the last one bit-packed,
so a shard along it must hold whole byte groups. Scales and zero points have the data's rank
and take the same logical axes, except that a dim holding one scale is replicated; a split
dim must divide evenly, so every shard holds whole tiles.

Vectors (norm scales) are replicated under every layout: a D- or H-vector costs nothing to
copy, and a sharded one would need a gather at every use.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from qjax.core import QArray, packed_length
from qjax.nn import axes as ax
from qjax.nn.kvcache import KVCache
from qjax.sharding._rules import Rules, to_spec


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def qarray_logical(logical: Sequence, q: QArray) -> list:
  """Logical axes of each leaf of `q` (data, scale, zero point if any), None = replicated."""
  logical = tuple(logical)
  if len(logical) != q.ndim:
    raise ValueError(f'QArray of shape {q.shape} got {len(logical)} logical axes {logical}.')
  # Scales tile the data, so they are split like it (a dim of one scale stays whole).
  scale_names = tuple(None if n == 1 else name for name, n in zip(logical, q.scale.shape))
  out = [logical, scale_names]
  if q.zero_point is not None:
    out.append(scale_names)
  return out


def leaf_mesh_axes(rules: Rules, logical: Sequence, value, what: str, *,
                   compute: bool = False) -> list:
  """Per leaf of `value` (an array or a QArray), per dim, the mesh axes it is split over.

  Args:
    rules: the layout.
    logical: the tensor's logical axes.
    value: the array or QArray (its shapes decide the leaf layout).
    what: the tensor's name, for errors.
    compute: the weight as used (gathered axes removed), not as stored.
  """
  if isinstance(value, QArray):
    leaf_names = qarray_logical(logical, value)
  elif getattr(value, 'ndim', 0) <= 1:
    leaf_names = [(None,) * getattr(value, 'ndim', 0)]  # vectors and scalars: replicated
  else:
    leaf_names = [tuple(logical)]
  out = []
  for names in leaf_names:
    per_dim = rules.mesh_axes_of(names, what)
    if compute:
      per_dim = tuple(() if n is None else rules.compute_axes(n, what) for n in names)
    out.append(per_dim)
  return out


def _ways(mesh, mesh_axes) -> int:
  return math.prod(mesh.shape[a] for a in mesh_axes)


def _check_divisible(mesh, value, leaf_axes: list, what: str, layout) -> None:
  """Every split dim of every leaf divides evenly; a QArray's shards hold whole tiles/bytes."""
  is_q = isinstance(value, QArray)
  leaves = [x for x in (value.data, value.scale, value.zero_point) if x is not None] \
      if is_q else [value]
  for leaf, per_dim, kind in zip(leaves, leaf_axes, ('codes', 'scales', 'zero points')):
    for dim, mesh_axes in enumerate(per_dim):
      k, size = _ways(mesh, mesh_axes), leaf.shape[dim]
      if size % k:
        raise ValueError(
            f'Layout {layout}: {what}{f" {kind}" if is_q else ""} dim {dim} (size {size}) is '
            f'split over mesh axes {"*".join(mesh_axes)}={k}, which does not divide {size}. '
            f'Use a mesh whose {"*".join(mesh_axes)} divides {size}, or another layout.')
  if is_q:
    _check_qarray_shards(mesh, value, leaf_axes[0], what, layout)


def _check_qarray_shards(mesh, q: QArray, data_axes, what: str, layout) -> None:
  # Whole tiles per shard follow from the scales' dims dividing (checked above): a dim of
  # one scale is replicated, k scales split w ways leave k/w whole tiles per shard.
  k = _ways(mesh, data_axes[-1])
  if q.qtype.packed and k > 1 and (q.last_dim % k or packed_length(
      q.last_dim // k, q.bits) * k != q.data.shape[-1]):
    raise ValueError(
        f'Layout {layout}: {what} packs {q.bits}-bit codes along its last axis '
        f'({q.last_dim}), split {k} ways; each shard must hold whole packed bytes. Use a '
        f'last dim divisible by {k} times the codes per byte group.')


def _variable_logical(path, var) -> tuple:
  meta = var.get_metadata()
  logical = meta.get('logical_axes') or meta.get('out_sharding')
  value = var.get_value()
  if logical is None:
    if getattr(value, 'ndim', 0) <= 1:
      return (None,) * getattr(value, 'ndim', 0)
    raise ValueError(f'{_path_str(path)}: a {getattr(value, "ndim", 0)}-d variable without '
                     'logical axes (out_sharding / logical_axes metadata); name its axes with '
                     'qjax.nn.axes so a layout can place it.')
  return tuple(logical)


def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def state_shardings(state, rules: Rules, mesh, *, check: bool = True):
  """NamedShardings of every leaf of an NNX state (float and quantized weights).

  Args:
    state: `nnx.state(model)` (or the state of `nnx.split`).
    rules: the layout.
    mesh: a mesh with axes ('x', 'y', 'z').
    check: raise for matrices left (partly) replicated by mistake: each must be split
      over every mesh axis of size > 1 unless `rules.replicated_ok` lists it.

  Returns:
    A pytree with the structure of `state` and NamedSharding leaves.
  """
  leaves, treedef = jax.tree_util.tree_flatten(state)
  out, unsharded = [], []
  split_axes = {a for a in mesh.axis_names if mesh.shape[a] > 1}
  for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]:
    value = var.get_value() if _is_var(var) else var
    what = _path_str(path)
    logical = _variable_logical(path, var) if _is_var(var) else (None,) * value.ndim
    per_leaf = leaf_mesh_axes(rules, logical, value, what)
    _check_divisible(mesh, value, per_leaf, what, rules)
    out.extend(NamedSharding(mesh, to_spec(d)) for d in per_leaf)
    missing = split_axes - {a for d in per_leaf[0] for a in d}
    if len(value.shape) >= 2 and missing and logical not in rules.replicated_ok:
      unsharded.append(f'{what} {logical} over {sorted(missing)}')
  if len(out) != len(leaves):
    raise ValueError('state_shardings: variables and leaves disagree; pass nnx.state(model).')
  if check and unsharded:
    raise ValueError(f'Layout {rules}: weights left unsharded (replicated) by the rules '
                     f'table: {unsharded}. Every matrix should be split over every mesh axis; '
                     'map its logical axes to the missing mesh axes, or list its logical '
                     'axes in Rules.replicated_ok if the layout replicates it on purpose.')
  return jax.tree_util.tree_unflatten(treedef, out)


def cache_shardings(cache: KVCache, rules: Rules, mesh) -> KVCache:
  """NamedShardings of a (float or quantized) KV cache under the attention layout."""
  def one(a, what):
    per_leaf = leaf_mesh_axes(rules, ax.KV_CACHE_AXES, a, what)
    _check_divisible(mesh, a, per_leaf, what, rules)
    s = [NamedSharding(mesh, to_spec(d)) for d in per_leaf]
    if isinstance(a, QArray):
      return a.rebuild(s)
    return s[0]
  return KVCache(k=tuple(one(a, f'KV cache k[{i}]') for i, a in enumerate(cache.k)),
                 v=tuple(one(a, f'KV cache v[{i}]') for i, a in enumerate(cache.v)),
                 length=NamedSharding(mesh, PartitionSpec()), qformat=cache.qformat,
                 windows=cache.windows, capacity=cache.capacity)


def shard_bytes(value, sharding: NamedSharding) -> int:
  """Bytes one device holds of `value` under `sharding` (each split dim divides evenly)."""
  ways = 1
  for entry in sharding.spec:
    for a in (entry,) if isinstance(entry, str) else (entry or ()):
      ways *= sharding.mesh.shape[a]
  return value.size * value.dtype.itemsize // ways


def bytes_per_device(values, shardings) -> int:
  """Predicted bytes per device of a pytree under a sharding pytree of the same structure."""
  return sum(shard_bytes(v, s) for v, s in zip(jax.tree.leaves(values),
                                               jax.tree.leaves(shardings)))
