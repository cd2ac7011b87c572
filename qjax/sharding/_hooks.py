"""The layout inside the layers: `LayoutHooks`, installed by `qjax.nn.shard_hooks.use`.

* Projections run under `jax.shard_map` with the collectives of the layout written out
  (Pope et al. sec. 3.2): weights all-gathered over the gathered axes (weight-gathered),
  the input all-gathered over the mesh axes its contracted dims are split over beyond the
  weight's, the product reduce-scattered (`psum_scatter`) into the output dim whose rule
  extends the weight's, and psum-ed over whatever partial-sum axes are left.
* Attention runs under `jax.shard_map` too: heads-sharded layouts attend locally;
  'mq_batch' moves queries from head-split to batch-split by `all_to_all` over the head
  axes, writes and reads the batch-split cache, and moves the output back.
* Everything else (norms, RoPE, residual adds, the embedding lookup) is left to GSPMD, with
  the residual stream constrained at every block boundary. So are the products whose
  result on shards would differ from the whole (`_exact_on_shards`): fake-quant (QAT)
  weights, and W8A8 / fp8 products whose contraction is split (their per-token activation
  scale spans the whole contracted row); GSPMD keeps their global semantics.

`check_vma=False`: a tiled `all_gather` result is typed as varying over the gathered axes
(jax 0.10 has no public invariant gather), so the replication of the outputs, which the
collectives above guarantee, cannot be inferred; the tests compare against one device.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding

from qjax.core import QArray, choose_path
from qjax.nn import axes as ax
from qjax.nn import shard_hooks
from qjax.nn.layers import parse_spec
from qjax.sharding import _specs
from qjax.sharding._rules import Rules, to_spec


def _suffix(full: tuple, prefix: tuple, what: str) -> tuple:
  if full[:len(prefix)] != prefix:
    raise ValueError(f'{what}: mesh axes {prefix} are not a prefix of {full}; the layout '
                     'would need a reshuffle, not a gather or a scatter.')
  return full[len(prefix):]


def _gather(x, dims_axes: dict, mesh):
  """All-gather `x` along each dim over its mesh axes (tiled: shards concatenated in order).

  The dim gathered over the most chips goes last: while the last gather writes the whole,
  its input (the whole over that many chips) is live too, so this keeps it smallest."""
  ways = lambda item: math.prod(mesh.shape[a] for a in item[1])  # noqa: E731
  for dim, mesh_axes in sorted(dims_axes.items(), key=ways):
    if mesh_axes:
      x = jax.lax.all_gather(x, mesh_axes, axis=dim, tiled=True)
  return x


class LayoutHooks(shard_hooks.ShardHooks):
  """Runs the layers of `qjax.nn` under one layout on one mesh (hashable: a jit static)."""

  def __init__(self, rules: Rules, mesh):
    self.rules, self.mesh = rules, mesh

  def __hash__(self):
    return hash((self.rules, self.mesh))

  def __eq__(self, other):
    return (isinstance(other, LayoutHooks) and self.rules == other.rules
            and self.mesh == other.mesh)

  def _act(self, letter: str) -> tuple:
    return self.rules.axes(ax.ACT_AXES[letter], f'activation letter {letter!r}')

  def _sharding(self, per_dim) -> NamedSharding:
    return NamedSharding(self.mesh, to_spec(per_dim))

  # ---- activations -------------------------------------------------------------------
  def constrain(self, x, letters: str):
    return jax.lax.with_sharding_constraint(
        x, self._sharding([self._act(c) for c in letters]))

  def embed_rows(self, layer, x_BTD):
    # The gathered rows keep the table's D sharding first (the gather passes that dim
    # through); the caller then constrains them to the 'BTD' activation layout. Without this
    # step jaxlib 0.11's SPMD partitioner aborts the process when the table's D axes differ
    # from the activation's (a CHECK in AlignGroupsWith: 2d_ws layouts on a 2x2x2 mesh).
    d_axes = self.rules.mesh_axes_of(layer.axes, 'the embedding table')[1]
    return jax.lax.with_sharding_constraint(x_BTD, self._sharding([(), (), d_axes]))

  # ---- projections -------------------------------------------------------------------
  def einsum(self, layer, x, w, compute):
    r, what = self.rules, f'{type(layer).__name__} {layer.spec} {layer.axes}'
    xs, ws, out = parse_spec(layer.spec)
    w_use = {c: r.compute_axes(n, what) for c, n in zip(ws, layer.axes)}
    partial = [a for c in ws if c not in out for a in w_use[c]]
    if not _exact_on_shards(layer, w, split_contraction=bool(partial)):
      return self.constrain(compute(x, w), out)  # GSPMD keeps the global semantics
    stored = _specs.leaf_mesh_axes(r, layer.axes, w, what)
    used = _specs.leaf_mesh_axes(r, layer.axes, w, what, compute=True)
    x_in = [self._act(c) for c in xs]
    x_gather = {i: _suffix(x_in[i], w_use[c], what) for i, c in enumerate(xs) if c in ws}
    y_axes = [x_in[xs.index(c)] if c in xs else w_use[c] for c in out]
    target = [self._act(c) for c in out]
    scatters = {i: _suffix(target[i], y_axes[i], what) for i in range(len(out))}
    scatters = {i: extra for i, extra in scatters.items() if extra}
    if not {a for e in scatters.values() for a in e} <= set(partial):
      raise ValueError(f'Layout {r}: {what} outputs want mesh axes {target}, but the product '
                       f'is split over {y_axes} with partial sums over {partial}; the rules '
                       'table is inconsistent.')
    reduce = tuple(a for a in partial if not any(a in e for e in scatters.values()))

    gathers = stored != used

    def local(x, *w_leaves):
      if gathers:
        # The gather may not start before its product's input exists: otherwise the TPU
        # compiler hoists every layer's weight gathers (and the output head's) to the start
        # of the step to hide their latency, and holds them all gathered at once. Only the
        # weight takes the barrier's output: products of the same input (q, k, v; gate, up)
        # then gather that input once, not once each.
        _, w_leaves = jax.lax.optimization_barrier((x, list(w_leaves)))
      with jax.named_scope('gather_weight'):
        w_leaves = [_gather(leaf, {d: _suffix(s[d], u[d], what) for d in range(len(s))},
                            self.mesh)
                    for leaf, s, u in zip(w_leaves, stored, used)]
      with jax.named_scope('gather_input'):
        x = _gather(x, x_gather, self.mesh)
      y = compute(x, _rebuild(w, w_leaves, used[0], self.mesh))
      for dim, mesh_axes in scatters.items():
        y = _scatter(y, mesh_axes, dim, self.mesh, split=out[dim] != 'V')
      return jax.lax.psum(y, reduce) if reduce else y

    fn = jax.shard_map(local, mesh=self.mesh,
                       in_specs=(to_spec(x_in),) + tuple(to_spec(s) for s in stored),
                       out_specs=to_spec(target), check_vma=False)
    return fn(x, *jax.tree.leaves(w))

  # ---- attention ---------------------------------------------------------------------
  def attention(self, core, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache):
    r = self.rules
    batch = self._act('B')
    a2a = _suffix(r.axes(ax.CACHE_BATCH), batch, f'Layout {r} cache batch')
    if a2a and a2a != self._act('N'):
      raise ValueError(f'Layout {r}: batch-sharded attention moves the batch over the '
                       f'query-head axes {self._act("N")}, but the cache batch extends the '
                       f'activation batch by {a2a}.')
    if k_BTKH.shape[2] > 1 and self._act('N') and not self._act('K'):
      raise ValueError(f'Layout {r}: multiquery attention layouts replicate the kv head and '
                       f'split query heads, which needs one kv head, but the model has '
                       f'{k_BTKH.shape[2]}. Use attention layout \'multihead\' (kv heads split '
                       'with their query heads).')
    q_spec = to_spec([batch, (), self._act('N'), ()])
    kv_spec = to_spec([batch, (), self._act('K'), ()])
    n_a2a = math.prod(self.mesh.shape[a] for a in a2a)
    cache_specs = None
    if cache is not None:
      cache_specs = jax.tree.map(lambda s: s.spec, _specs.cache_shardings(cache, r, self.mesh))

    def local(q, k, v, pos, cache):
      if a2a:  # heads-split -> batch-split: split B, concatenate N
        q = jax.lax.all_to_all(q, a2a, 0, 2, tiled=True)
        b = q.shape[0]
        start = jax.lax.axis_index(a2a) * b
        k, v, pos = (jax.lax.dynamic_slice_in_dim(t, start, b, axis=0) for t in (k, v, pos))
      out, cache = core(q, k, v, pos, cache)
      if a2a:
        out = jax.lax.all_to_all(out, a2a, 2, 0, tiled=True)
      return out, cache

    ways = n_a2a * math.prod(self.mesh.shape[a] for a in batch)
    if q_BTNH.shape[0] % ways:
      raise ValueError(f'Layout {r}: batch {q_BTNH.shape[0]} does not split over mesh axes '
                       f'{"*".join(batch + a2a)}={ways}; use a batch that is a multiple of '
                       f'{ways}, or a heads-sharded attention layout.')
    args, specs = [q_BTNH, k_BTKH, v_BTKH, positions_BT], [q_spec, kv_spec, kv_spec,
                                                          to_spec([batch, ()])]
    if cache is None:
      fn = jax.shard_map(lambda *a: local(*a, None)[0], mesh=self.mesh,
                         in_specs=tuple(specs), out_specs=q_spec, check_vma=False)
      return fn(*args), None
    fn = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs) + (cache_specs,),
                       out_specs=(q_spec, cache_specs), check_vma=False)
    return fn(*args, cache)


def _scatter(y, mesh_axes: tuple, dim: int, mesh, split: bool = True):
  """`psum_scatter` of `y` along `dim`, split into (shards, rest) first so that the shard
  index is a dimension of its own: the TPU compiler lowers a reduce-scatter to an all-reduce
  and a slice, and fuses them back into one reduce-scatter only where the slice is along a
  major dimension; along the minor one (the features) it would all-reduce, twice the bytes.
  Logits are not split (`split=False`): the compiler would move the split onto the
  output-embedding table and copy the whole table at every step."""
  if not split:
    return jax.lax.psum_scatter(y, mesh_axes, scatter_dimension=dim, tiled=True)
  k = math.prod(mesh.shape[a] for a in mesh_axes)
  shape = y.shape
  grouped = shape[:dim] + (k, shape[dim] // k) + shape[dim + 1:]
  y = jax.lax.psum_scatter(y.reshape(grouped), mesh_axes, scatter_dimension=dim, tiled=True)
  return y.reshape(shape[:dim] + (shape[dim] // k,) + shape[dim + 1:])


def _exact_on_shards(layer, w, split_contraction: bool) -> bool:
  """Whether computing on shards gives exactly the product on whole tensors.

  Not so when something takes a max over the whole weight or a whole contracted row:
  fake-quant scales (QAT) and, with a split contraction, the per-token activation scales of
  the W8A8 / fp8 paths.
  """
  quant = layer.quant
  if not isinstance(w, QArray):
    return quant.fake_fmt is None and quant.fake_act_fmt is None
  path = 'int8' if quant.outlier_threshold is not None else quant.path  # LLM.int8(): int8 x int8
  if path == 'auto':
    path = choose_path(w.qtype, quant.act_fmt)
  return path in ('dequant', 'tiled', 'native', 'pallas') or not split_contraction


def _rebuild(proto, leaves, data_axes, mesh):
  """The local weight: an array, or a QArray whose static last dim is the local one."""
  if not isinstance(proto, QArray):
    return leaves[0]
  ways = math.prod(mesh.shape[a] for a in data_axes[-1])
  return proto.rebuild(leaves, last_dim=proto.last_dim // ways)


def use_layout(rules: Rules, mesh):
  """Context manager: trace the layers under `rules` on `mesh` (inside a jitted function)."""
  return shard_hooks.use(LayoutHooks(rules, mesh))

