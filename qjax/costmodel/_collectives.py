"""The collectives one transformer layer issues under a layout, and how long each takes.

Time of a collective over a group of K chips whose per-chip tensor is D bytes:
  all-gather (D = output) and reduce-scatter (D = input): D (K-1)/K / bw   (Pope et al. A.1,
    keeping the (K-1)/K they drop, so a one-chip group costs nothing);
  all-reduce: twice that (reduce-scatter then all-gather);
  all-to-all (D = the shard a chip holds): on a switch D (K-1)/K / bw; on a torus every byte
    travels the mean ring distance summed over the group's axes (k/4 for an even ring of k),
    so D * hops / bw when traffic spreads evenly over the links.
`bw` comes from the interconnect model:
  'all_links' (the paper's): every collective gets the chip's full `ici_bw`, whatever axes it
    runs over, which is optimistic for single-axis collectives on a torus;
  'per_axis': a collective gets 2 links per torus axis it spans (`Chip.axis_bw` each), capped
    at `ici_bw`; on a switch every group gets the full port.
Either way a group that leaves the chip's fast domain (8 GPUs on an HGX board) runs at
`Chip.scaleout_bw`.
"""

from __future__ import annotations

import dataclasses

from qjax.costmodel import _chips
from qjax.costmodel import _layouts
from qjax.costmodel import _names

INTERCONNECTS = ('all_links', 'per_axis')
LANES = 128  # a TPU vector register's lanes: the tile a minor dimension is padded to
KINDS = ('all_gather', 'reduce_scatter', 'all_reduce', 'all_to_all')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective: its kind, per-chip bytes (see the module docstring), axes, purpose."""

  kind: str
  nbytes: float
  axes: tuple
  what: str


def check_interconnect(interconnect: str) -> str:
  if interconnect not in INTERCONNECTS:
    raise _names.unknown_name('interconnect model', interconnect, INTERCONNECTS)
  return interconnect


def _within_domain(chip: _chips.Chip, mesh: _layouts.Mesh, axes: tuple) -> bool:
  """Whether a group over `axes` stays inside one aligned block of `domain_size` chips."""
  if chip.domain_size is None:
    return True
  spans = [mesh.stride(a) * mesh.size((a,)) for a in axes if mesh.size((a,)) > 1]
  span = max(spans, default=1)
  return span <= chip.domain_size and chip.domain_size % span == 0


def group_bandwidth(chip: _chips.Chip, mesh: _layouts.Mesh, axes: tuple,
                    interconnect: str = 'all_links') -> float:
  """Bytes/s a collective over mesh `axes` gets under the interconnect model.

  Args:
    chip: the chip.
    mesh: the mesh.
    axes: the axes the collective spans.
    interconnect: 'all_links' or 'per_axis'.

  Returns:
    Bandwidth in bytes/s.
  """
  check_interconnect(interconnect)
  if not _within_domain(chip, mesh, axes):
    return chip.scaleout_bw
  if interconnect == 'all_links' or chip.topology == 'switch':
    return chip.ici_bw
  used = sum(1 for a in axes if mesh.size((a,)) > 1)
  return min(chip.ici_bw, used * chip.axis_bw)


def _ring_mean_distance(k: int) -> float:
  """Mean hop count from one chip to each chip (itself included) of a bidirectional ring."""
  return sum(min(d, k - d) for d in range(k)) / k


def collective_seconds(c: Collective, chip: _chips.Chip, mesh: _layouts.Mesh,
                       interconnect: str = 'all_links') -> float:
  """Seconds collective `c` takes at full bandwidth (see the module docstring)."""
  k = mesh.size(c.axes)
  if k == 1 or c.nbytes == 0:
    return 0.0
  bw = group_bandwidth(chip, mesh, c.axes, interconnect)
  fraction = (k - 1) / k
  if c.kind in ('all_gather', 'reduce_scatter'):
    return c.nbytes * fraction / bw
  if c.kind == 'all_reduce':
    return 2 * c.nbytes * fraction / bw
  if c.kind == 'all_to_all':
    if chip.topology == 'switch':
      return c.nbytes * fraction / bw
    hops = sum(_ring_mean_distance(mesh.size((a,))) for a in c.axes)
    return c.nbytes * hops / bw
  raise _names.unknown_name('collective kind', c.kind, KINDS)


def head_collectives(plan: _layouts.ShardPlan, mesh: _layouts.Mesh, layout: _layouts.Layout,
                     tokens: int, rows: int, act_bytes: float, weight_bytes: float) -> list:
  """The collectives of the embedding lookup and the output head, once per forward pass.

  The table is stored V over the F axes and E over x (1d_ws: E whole): a lookup reads the
  rows it holds and all-reduces them over the vocab axes, in the stored format. The head
  computes logits (float32) of the last position only (`rows` = the batch): 1d_ws needs
  nothing more (its residual is whole); 2d_ws all-gathers its input over y*z and
  reduce-scatters the partial logits over x, which the TPU compiler turns into an all-reduce
  where a chip's share of the vocabulary is not whole 128-lane tiles; weight-gathered
  layouts gather the head's weights like a layer's.

  Args:
    plan, mesh, layout: as `layer_collectives`.
    tokens: tokens embedded in this pass (B L; B when decoding).
    rows: positions whose logits are computed (the batch).
    act_bytes, weight_bytes: bytes per activation element and per stored weight.

  Returns:
    A list of `Collective`.
  """
  m = plan.model
  e, v = m.d_model, m.vocab
  out = []

  def add(kind, nbytes, axes, what):
    out.append(Collective(kind, nbytes, tuple(axes), what))

  if layout.ffn == '1d_ws':  # the residual is whole: the head needs no gather
    add('all_reduce', tokens * e * weight_bytes, _layouts.AXES, 'embedding rows')
    return out
  add('all_reduce', tokens * e / mesh.x * weight_bytes, ('y', 'z'), 'embedding rows')
  if layout.ffn == '2d_ws':
    yz = mesh.y * mesh.z
    add('all_gather', rows * e / mesh.x * act_bytes, ('y', 'z'), 'head input')
    whole_tiles = v % (yz * mesh.x * LANES) == 0
    add('reduce_scatter' if whole_tiles else 'all_reduce', rows * v / yz * 4, ('x',), 'logits')
    return out
  vocab_axes = tuple(a for a in ('z', 'y') if a not in plan.gather_axes)
  add('all_gather', m.head_params * weight_bytes / mesh.size(vocab_axes), plan.gather_axes,
      'head weights')
  add('all_gather', rows / mesh.size(plan.gather_axes) * e * act_bytes, plan.model_axes,
      'head input')
  return out


def sent_bytes(c: Collective, mesh: _layouts.Mesh) -> float:
  """Bytes one chip sends for collective `c`: D (K-1)/K, twice that for an all-reduce."""
  k = mesh.size(c.axes)
  if k == 1:
    return 0.0
  return (2 if c.kind == 'all_reduce' else 1) * c.nbytes * (k - 1) / k


def layer_collectives(plan: _layouts.ShardPlan, mesh: _layouts.Mesh, layout: _layouts.Layout,
                      tokens: int, act_bytes: float, weight_bytes: float) -> list:
  """The collectives of one transformer layer for one forward pass.

  Unlike the paper's closed forms (`_formulas`), this counts every projection: a gated FFN
  reduce-scatters both input projections before the nonlinearity, the attention projections
  travel with the FFN ones (one pair per layer for a parallel block, two for a serial one),
  and weight-gathered layouts gather the attention weights too.

  Args:
    plan: where the layout puts each dimension (from `shard_plan`).
    mesh: the mesh.
    layout: the layout.
    tokens: T, tokens in this pass over the whole batch (B L; B when decoding).
    act_bytes: bytes per activation element.
    weight_bytes: bytes per stored weight.

  Returns:
    A list of `Collective`.
  """
  m = plan.model
  e, f, h = m.d_model, m.d_ff, m.head_dim
  q_width, kv_width = m.n_heads * h, 2 * m.n_kv_heads * h
  pairs = 1 if m.parallel_block else 2
  out = []

  def add(kind, nbytes, axes, what):
    out.append(Collective(kind, nbytes, tuple(axes), what))

  if layout.ffn == '2d_ws':
    x, yz = mesh.x, mesh.y * mesh.z
    for _ in range(pairs):
      add('all_gather', tokens * e / x * act_bytes, ('y', 'z'), 'activations in')
      add('reduce_scatter', tokens * e / x * act_bytes, ('y', 'z'), 'activations out')
    # Multiquery layouts replicate K and V (their projection is stored E_x only), so their
    # partial sums need an all-reduce over x rather than a scatter into the heads.
    scattered_kv = kv_width if layout.attn == 'multihead' else 0
    in_width = (m.n_ffn_matrices - 1) * f + q_width + scattered_kv
    add('reduce_scatter', tokens * in_width / yz * act_bytes, ('x',), 'in-projection sums')
    if layout.attn != 'multihead':
      add('all_reduce', tokens * kv_width * act_bytes, ('x',), 'k/v sums')
    add('all_gather', tokens * (f + q_width) / yz * act_bytes, ('x',), 'out-projection inputs')
  elif layout.ffn == '1d_ws':
    # qjax keeps the residual whole on every chip: one all-reduce per block output, the
    # bytes of the paper's gather-in + scatter-out (2 B L E (K-1)/K either way).
    for _ in range(pairs):
      add('all_reduce', tokens * e * act_bytes, plan.model_axes, 'activations out')
  else:
    n_gather = mesh.size(plan.gather_axes)
    # Multiquery K/V projections are stored E_x only (replicated over y*z): gathered whole.
    kv_proj = 0 if layout.attn == 'multihead' else e * kv_width
    add('all_gather', ((m.layer_params - kv_proj) * n_gather / mesh.n + kv_proj)
        * weight_bytes, plan.gather_axes, 'weights')
    for _ in range(pairs):
      add('all_gather', tokens / n_gather * e * act_bytes, plan.model_axes, 'activations in')
      add('reduce_scatter', tokens / n_gather * e * act_bytes, plan.model_axes,
          'activations out')
  if plan.a2a_axes:
    # Only the queries move: K and V are replicated over the head axes, so each chip slices
    # the rows of its own batch shard.
    add('all_to_all', tokens * q_width * act_bytes / mesh.n, plan.a2a_axes,
        'queries to batch-sharded')
    add('all_to_all', tokens * q_width * act_bytes / mesh.n, plan.a2a_axes,
        'attention out to head-sharded')
  return out
