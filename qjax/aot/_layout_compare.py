"""The cost model beside the TPU compiler: per layout, predicted vs compiled memory per chip,
collective bytes per chip and step time, and whether both rank the layouts alike.

    rows = sharding.compare_layouts('palm_540b', 'v4:4x4x4', workload, 'decode')
    print(sharding.format_rows(rows))

Each layout is compiled on the mesh the cost model finds best for it on the slice's chip
count (`costmodel.plan`); the cost model is asked about the same shape as compiled (a serial
block, heads padded where the layout needs it: `_compile.serial_shape`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from qjax import costmodel
from qjax.aot import _layout_compile as _compile
from qjax.aot import _slices

# Targets the comparison is held to (docs/costmodel.md).
MEMORY_TOLERANCE = 0.10
COMM_TOLERANCE = 0.20


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One layout: the cost model's estimate and the compiler's figures for the same step."""

  estimate: costmodel.Estimate
  compiled: _compile.CompiledStep

  @property
  def layout(self) -> str:
    return str(self.estimate.layout)

  @property
  def predicted_bytes(self) -> float:
    """The planner's per-chip memory: weights + KV + the step's activations."""
    return self.estimate.memory.total_bytes

  @property
  def memory_ratio(self) -> float:
    return self.compiled.peak_bytes / self.predicted_bytes

  @property
  def predicted_comm_bytes(self) -> float:
    return sum(self.estimate.comm_bytes.values())

  @property
  def comm_ratio(self) -> float:
    predicted = self.predicted_comm_bytes
    if not predicted:
      return 1.0 if not self.compiled.total_comm_bytes else float('inf')
    return self.compiled.total_comm_bytes / predicted

  @property
  def compiled_s(self) -> float:
    """The compiler's roofline for the step (`CompiledStep.roofline_s`)."""
    return self.compiled.roofline_s(self.estimate.workload.compute_bits)

  @property
  def time_ratio(self) -> float:
    return self.compiled_s / self.estimate.step_latency_s

  @property
  def memory_ok(self) -> bool:
    return abs(self.memory_ratio - 1) <= MEMORY_TOLERANCE

  @property
  def comm_ok(self) -> bool:
    return abs(self.comm_ratio - 1) <= COMM_TOLERANCE


def _formats(workload: costmodel.Workload) -> tuple:
  for field in ('weight_bits', 'kv_bits'):
    if getattr(workload, field) not in (8, 16):
      raise ValueError(f'Workload.{field}={getattr(workload, field)!r}: the compiled check runs '
                       'int8 (8) or bf16 (16) weights and KV.')
  return ('int8' if workload.weight_bits == 8 else 'bf16',
          'int8' if workload.kv_bits == 8 else 'bf16')


def compare(model, layout, slice_name: str, workload: costmodel.Workload, phase: str, *,
            mesh='', depths: Optional[Sequence[int]] = (1, 2),
            interconnect: str = 'all_links') -> Comparison:
  """The estimate and the compiled step of one layout on one mesh of a slice.

  Args:
    model: a costmodel preset or shape.
    layout: a layout name.
    slice_name: the TPU slice ('v4:4x4x4').
    workload: batch, token counts and bits (8 or 16 for weights and KV).
    phase: 'prefill' or 'decode' (one step: the cache then holds prompt + generated slots).
    mesh: the logical mesh ('' = the torus).
    depths: see `_compile.compile_step`.
    interconnect: the cost model's interconnect model.

  Returns:
    A `Comparison`.
  """
  s = _slices.parse_slice(slice_name)
  weights, kv = _formats(workload)
  context = workload.history_len + workload.prompt_len + workload.gen_len
  compiled = _compile.compile_step(model, layout, s.name, phase=phase, batch=workload.batch,
                                   context=context, prompt=workload.prompt_len, mesh=mesh,
                                   weights=weights, kv=kv, depths=depths)
  lay = costmodel.as_layout(layout)
  lay = costmodel.Layout(lay.ffn, lay.attn, pad_heads=True)
  shape = _compile.compiled_shape(model, compiled.mesh, lay, workload.batch)
  est = costmodel.estimate(shape, s.chip, compiled.mesh, lay, workload, phase,
                           interconnect=interconnect)
  return Comparison(est, compiled)


@dataclasses.dataclass(frozen=True)
class NotCompiled:
  """A layout the cost model ranks but that did not compile here, and why."""

  layout: str
  mesh: str
  reason: str


def best_meshes(model, slice_name: str, workload: costmodel.Workload, phase: str,
                layouts: Optional[Sequence] = None) -> dict:
  """{layout: the cost model's best mesh on the slice's chips} for the layouts that can run."""
  s = _slices.parse_slice(slice_name)
  lays = [costmodel.Layout(*str(x).split('+'), pad_heads=True) for x in layouts] \
      if layouts is not None else costmodel.all_layouts(pad_heads=True)
  if costmodel.model_from_spec(model).n_kv_heads > 1:
    # qjax's multiquery layouts replicate one kv head; a GQA model runs 'multihead' only.
    lays = [lay for lay in lays if lay.attn == 'multihead']
  result = costmodel.plan(_compile.serial_shape(model), s.chip, workload, s.n_chips, phase,
                          layouts=lays, require_fit=False)
  return {name: str(est.mesh) for name, est in result.best_per_layout().items()}


def compare_layouts(model, slice_name: str, workload: costmodel.Workload, phase: str, *,
                    layouts: Optional[Sequence] = None, depths=(1, 2),
                    say=None) -> list:
  """`compare` for every layout that can run, each on its best mesh (`best_meshes`); a
  layout the layout code or the compiler refuses is a `NotCompiled` row with the reason."""
  rows = []
  for name, mesh in best_meshes(model, slice_name, workload, phase, layouts).items():
    try:
      row = compare(model, name, slice_name, workload, phase, mesh=mesh, depths=depths)
    except Exception as e:  # pylint: disable=broad-except  (the refusal is the result)
      row = NotCompiled(name, mesh, f'{type(e).__name__}: {str(e).splitlines()[0][:300]}')
    if say:
      say(format_rows([row], header=False))
    rows.append(row)
  return rows


def compiled(rows: Sequence) -> list:
  """The rows that compiled (`Comparison`s)."""
  return [r for r in rows if isinstance(r, Comparison)]


def best_agrees(rows: Sequence, slack: float = 0.10) -> bool:
  """Whether the cost model's fastest layout is the compiler's, or within `slack` of it
  (over the layouts that compiled)."""
  rows = compiled(rows)
  model_best = min(rows, key=lambda r: r.estimate.step_latency_s)
  compiled_best = min(r.compiled_s for r in rows)
  return model_best.compiled_s <= (1 + slack) * compiled_best


def _gb(b: float) -> str:
  return f'{b / 1e9:.3f}'


def format_rows(rows: Sequence, header: bool = True) -> str:
  """A table: per layout, predicted vs compiled memory, collective bytes and step time."""
  cols = ('layout', 'mesh', 'mem GB pred', 'mem GB compiled', 'ratio', 'fits',
          'comm MB pred', 'comm MB compiled', 'ratio', 'step ms model', 'step ms compiler',
          'ratio')
  out = [cols] if header else []
  refused = []
  for r in rows:
    if isinstance(r, NotCompiled):
      refused.append(f'  {r.layout} on {r.mesh}: not compiled: {r.reason}')
      continue
    c = r.compiled
    out.append((r.layout, c.mesh, _gb(r.predicted_bytes), _gb(c.peak_bytes),
                f'{r.memory_ratio:.3f}', 'yes' if c.fits else 'NO',
                f'{r.predicted_comm_bytes / 1e6:.2f}', f'{c.total_comm_bytes / 1e6:.2f}',
                f'{r.comm_ratio:.3f}', f'{r.estimate.step_latency_s * 1e3:.4g}',
                f'{r.compiled_s * 1e3:.4g}', f'{r.time_ratio:.2f}'))
  if not out:
    return '\n'.join(refused)
  widths = [max(len(row[i]) for row in out) for i in range(len(cols))]
  return '\n'.join(['  '.join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in out]
                   + refused)
