"""Search over layouts and mesh factorizations for the best one that fits, and KV capacity."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

from qjax.costmodel import _chips
from qjax.costmodel import _collectives
from qjax.costmodel import _layouts
from qjax.costmodel import _models
from qjax.costmodel import _names
from qjax.costmodel import _roofline

OBJECTIVES = ('latency', 'cost')


def mesh_factorizations(n_chips: int) -> list:
  """Every ordered x * y * z = n_chips mesh (28 for 64 chips)."""
  if not (isinstance(n_chips, int) and n_chips >= 1):
    raise ValueError(f'n_chips must be a positive int, got {n_chips!r}.')
  divisors = [d for d in range(1, n_chips + 1) if n_chips % d == 0]
  return [_layouts.Mesh(x, y, n_chips // (x * y)) for x in divisors for y in divisors
          if (n_chips // x) % y == 0]


def all_layouts(pad_heads: bool = True, pad_kv_heads: bool = False) -> list:
  """Every feed-forward x attention layout pair (15)."""
  return [_layouts.Layout(f, a, pad_heads, pad_kv_heads) for f, a in
          itertools.product(_layouts.FFN_LAYOUTS, _layouts.ATTN_LAYOUTS)]


@dataclasses.dataclass(frozen=True)
class Plan:
  """The outcome of a search.

  Attributes:
    phase: 'prefill' or 'decode'.
    objective: 'latency' (shortest step) or 'cost' (fewest chip-seconds per token).
    candidates: estimates that meet the constraints, best first (those that fit first).
    rejected: '<layout> on <mesh>: <reason>' for everything else.
  """

  phase: str
  objective: str
  candidates: tuple
  rejected: tuple

  @property
  def best(self) -> _roofline.Estimate:
    return self.candidates[0]

  def best_per_layout(self) -> dict:
    """The best candidate of each layout, keyed by str(layout), in candidate order."""
    out = {}
    for est in self.candidates:
      out.setdefault(str(est.layout), est)
    return out


def _cost(est: _roofline.Estimate) -> float:
  """Chip-seconds per token."""
  return est.mesh.n * est.latency_s / est.tokens


def _spread(est: _roofline.Estimate) -> int:
  """Largest mesh axis: among equal estimates, prefer cube-like meshes (real TPU slices)."""
  return max(est.mesh.x, est.mesh.y, est.mesh.z)


def _too_large(model, chip, workload, n_chips: Sequence[int]) -> Optional[str]:
  """A message if the weights alone overflow HBM at every chip count, else None."""
  weights = model.weight_bytes(workload.weight_bits)
  n_max = max(n_chips)
  if weights / n_max <= chip.hbm_bytes:
    return None
  need = math.ceil(weights / chip.hbm_bytes)
  return (f'{model.name} does not fit: its {workload.weight_bits:g}-bit weights take '
          f'{weights:.4g} bytes, {weights / n_max:.4g} per chip on {n_max} chips, but one '
          f'{chip.name} holds {chip.hbm_bytes:.4g} bytes. Use at least {need} chips (before '
          f'the KV cache), or fewer weight bits ({workload.weight_bits / 2:g}-bit weights: '
          f'{weights / 2:.4g} bytes).')


def plan(model, chip, workload: _roofline.Workload, n_chips, phase: str = 'decode', *,
         layouts: Optional[Sequence] = None, meshes: Optional[Sequence] = None,
         objective: str = 'latency', max_step_latency_s: Optional[float] = None,
         interconnect: str = 'all_links', combine: str = 'serial',
         efficiency: _roofline.Efficiency = _roofline.Efficiency(),  # noqa: B008 (frozen)
         pad_heads: bool = True, require_fit: bool = True,
         pad_kv_heads: bool = False) -> Plan:
  """Finds the layout and mesh with the best objective that fits in HBM.

  Args:
    model: a `ModelShape` or preset name.
    chip: a `Chip` or preset name.
    workload: batch, token counts and bits.
    n_chips: chip count, or a sequence of counts to choose from.
    phase: 'prefill' or 'decode'.
    layouts: layouts to try (default: all 15).
    meshes: meshes to try (default: every factorization of each chip count).
    objective: 'latency' (shortest step) or 'cost' (fewest chip-seconds per token).
    max_step_latency_s: reject candidates whose step is slower than this.
    interconnect, combine, efficiency: passed to `estimate`.
    pad_heads: let heads-sharded layouts pad heads that do not divide (as Pope et al. did).
    pad_kv_heads: let 'multihead' attention pad kv heads to the group it splits them over.
    require_fit: drop candidates that overflow HBM (False: keep them, ranked after the
      ones that fit, e.g. to print them).

  Returns:
    A `Plan`; `plan(...).best` is the winner.

  Raises:
    ValueError: if the weights cannot fit at any chip count (with the bytes), or if nothing
      is left after the search (with the reasons).
  """
  model, chip = _models.model_from_spec(model), _chips.chip_from_spec(chip)
  if objective not in OBJECTIVES:
    raise _names.unknown_name('objective', objective, OBJECTIVES)
  counts = [n_chips] if isinstance(n_chips, int) else list(n_chips)
  for n in counts:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f'plan: n_chips={n!r} must be a positive integer (the chips to plan '
                       'for); e.g. n_chips=8.')
  if interconnect not in _collectives.INTERCONNECTS:  # before the search, not per candidate
    raise _names.unknown_name('interconnect model', interconnect, _collectives.INTERCONNECTS)
  if meshes is not None:
    for m in meshes:
      if _layouts.as_mesh(m).n not in counts:
        raise ValueError(f'plan: mesh {m!r} has {_layouts.as_mesh(m).n} chips, but n_chips is '
                         f'{n_chips}; give a mesh whose axes multiply to n_chips (e.g. '
                         f'{"x".join(map(str, (counts[0], 1, 1)))}), or drop the mesh to '
                         'search every factorization.')
  message = _too_large(model, chip, workload, counts)
  if message:
    raise ValueError(message)
  if layouts is None:
    layouts = all_layouts(pad_heads, pad_kv_heads)
  layouts = [_layouts.as_layout(lay) for lay in layouts]
  if meshes is None:
    meshes = [m for n in counts for m in mesh_factorizations(n)]
  meshes = [_layouts.as_mesh(m) for m in meshes]

  candidates, rejected, smallest_total = [], [], None
  for mesh, layout in itertools.product(meshes, layouts):
    where = f'{layout} on {mesh}'
    try:
      est = _roofline.estimate(model, chip, mesh, layout, workload, phase,
                               interconnect=interconnect, combine=combine,
                               efficiency=efficiency)
    except ValueError as e:
      rejected.append(f'{where}: {e}')
      continue
    mem = est.memory
    if not mem.fits:
      smallest_total = min(mem.total_bytes, smallest_total or math.inf)
      if not require_fit:
        candidates.append(est)
        continue
      rejected.append(f'{where}: needs {mem.total_bytes:.4g} bytes per chip (weights '
                      f'{mem.weights_bytes:.4g} + KV {mem.kv_bytes:.4g} + gathered '
                      f'{max(mem.workspace_bytes, mem.head_workspace_bytes):.4g}), {chip.name} '
                      f'holds {mem.capacity_bytes:.4g}')
      continue
    if max_step_latency_s is not None and est.step_latency_s > max_step_latency_s:
      rejected.append(f'{where}: step {est.step_latency_s:.4g} s > {max_step_latency_s:.4g} s')
      continue
    candidates.append(est)
  if not candidates:
    if smallest_total is not None:
      raise ValueError(
          f'{model.name} with batch {workload.batch} and '
          f'{workload.history_len + workload.prompt_len + workload.gen_len} tokens of '
          f'context does not fit on {counts} x {chip.name}: the best layout needs '
          f'{smallest_total:.4g} bytes per chip, a chip holds {chip.hbm_bytes:.4g}. Use more '
          f'chips, a smaller batch, or fewer weight/KV bits. First rejections: '
          + '; '.join(rejected[:3]))
    reasons = list(dict.fromkeys(r.split(': ', 1)[1] for r in rejected))
    raise ValueError(f'No layout can run {model.name} at batch {workload.batch} on '
                     f'{counts} x {chip.name}: ' + ' | '.join(reasons[:3]))
  if objective == 'latency':
    key = lambda e: (not e.memory.fits, e.step_latency_s, e.mesh.n, _spread(e))  # noqa: E731
  else:
    key = lambda e: (not e.memory.fits, _cost(e), _spread(e))  # noqa: E731
  return Plan(phase=phase, objective=objective, candidates=tuple(sorted(candidates, key=key)),
              rejected=tuple(rejected))


def max_context_len(model, chip, mesh, layout, batch: int, kv_bits: float = 16,
                    kv_fraction: float = 0.3) -> int:
  """Longest context whose KV cache fits in `kv_fraction` of each chip's HBM (Table 1).

  Args:
    model: a `ModelShape` or preset name.
    chip: a `Chip` or preset name.
    mesh: the mesh.
    layout: the layout (its attention part decides how the cache is split).
    batch: sequences.
    kv_bits: bits per cached element.
    kv_fraction: share of HBM reserved for the KV cache (Pope et al. use 0.3).

  Returns:
    Tokens of context per sequence.
  """
  model, chip = _models.model_from_spec(model), _chips.chip_from_spec(chip)
  mesh, layout = _layouts.as_mesh(mesh), _layouts.as_layout(layout)
  if not 0 < kv_fraction <= 1:
    raise ValueError(f'kv_fraction is a share of HBM in (0, 1], got {kv_fraction!r}.')
  plan_ = _layouts.shard_plan(model, mesh, layout, batch)
  per_token = batch * plan_.model.kv_bytes_per_token(kv_bits) / plan_.kv_shards
  return math.floor(kv_fraction * chip.hbm_bytes / per_token)
