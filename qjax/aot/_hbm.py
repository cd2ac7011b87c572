"""The HBM traffic of a compiled program, counted from its optimized HLO.

XLA:TPU's cost analysis ('bytes accessed') counts a weight its memory-space assignment
prefetches into VMEM several times (the HBM read, the VMEM write, the consumer's VMEM read), so
on a TPU it overstates what a step reads from HBM, and a format whose kernel reads its operands
in place looks cheaper than one XLA prefetches. `hbm_traffic` counts each transfer once, with
the same rule for every format and target; it is a model of the traffic, not a measurement.
"""

from __future__ import annotations

import re

from qjax.aot import _hlo

_COST = re.compile(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"')
_S1 = re.compile(r'S\(1\)')
_VMEM_OPS = ('copy-done', 'slice-done')


def _in_vmem(type_text: str) -> bool:
  return bool(_S1.search(type_text))


def _array_bytes(type_text: str, vmem: bool) -> int:
  """Bytes of the arrays in an HLO type that live in VMEM (vmem=True) or in HBM."""
  total = 0
  for m in re.finditer(r'[a-z][a-z0-9]*\[[\d,]*\]\{[^}]*\}|[a-z][a-z0-9]*\[[\d,]*\]', type_text):
    if _in_vmem(m.group(0)) == vmem:
      total += _hlo.shape_bytes(m.group(0).split('{')[0])
  return total


def _fused_reads(comp, n_operands: int):
  """`qjax.aot._hlo`'s per-operand reads of a fusion, and a table read only by gathers (an
  embedding lookup) counts the rows gathered, not the table."""
  reads = _hlo._fused_read_bytes(comp, n_operands)
  if comp is None or reads is None:
    return reads
  params = {}
  for ins in comp:
    m = re.match(r'\s*(\d+)\)', ins.rest) if ins.op == 'parameter' else None
    if m:
      params[ins.name] = int(m.group(1))
  users = {}
  for ins in comp:
    for i, name in enumerate(_hlo._OPERAND.findall(ins.rest.split('),')[0])):
      users.setdefault(name, []).append((ins, i))
  for name, index in params.items():
    uses = users.get(name, [])
    if index < n_operands and reads[index] is None and uses and all(
        u.op == 'gather' and i == 0 for u, i in uses):
      reads[index] = sum(_hlo.shape_bytes(u.type.split('{')[0]) for u, _ in uses)
  return reads


def hbm_traffic(hlo: str) -> dict:
  """An HBM-traffic estimate of a compiled TPU program, and the VMEM prefetch bytes.

  XLA:TPU's memory-space assignment copies operands that fit into VMEM (memory space S(1))
  ahead of their use, and its cost analysis counts each such copy's HBM read, its VMEM write
  and the consumer's VMEM read. Here each top-level op counts only what it reads from and
  writes to HBM: a copy or slice into VMEM its source, a Mosaic kernel the bytes it states
  less its operands and result already in VMEM, any other op its operands and result outside
  VMEM (a fusion that slices or updates a buffer in place its slice or update, as
  `qjax.aot._hlo` counts, and one that gathers rows of a table the rows). On a GPU (no VMEM)
  it is `qjax.aot._hlo.bytes_moved`'s op count with the gather rule. The same rule for every
  format; a model of the traffic, not a measurement.

  Returns:
    {'hbm': bytes, 'vmem_prefetch': bytes copied into VMEM ahead of use}.
  """
  comps = _hlo.parse(hlo)
  totals = {'hbm': 0, 'vmem_prefetch': 0}

  def walk(name: str, mult: int, depth: int = 0):
    comp = comps.get(name, [])
    types = {ins.name: ins.type for ins in comp}
    for ins in comp:
      if ins.op == 'while' and depth < 8:
        body, trips = _hlo._BODY.search(ins.rest), _hlo._TRIPS.search(ins.rest)
        if body:
          walk(body.group(1), mult * (int(trips.group(1)) if trips else 1), depth + 1)
        continue
      if ins.op in _hlo._FREE or ins.op in _VMEM_OPS:
        continue
      operands = [o for o in _hlo._OPERAND.findall(ins.rest.split('),')[0] + ')')
                  if o in types]
      if ins.op in ('copy-start', 'slice-start'):
        dest = ins.type.split('}), ', 1)[-1] if ins.op == 'slice-start' else ins.type
        first = re.match(r'\(?\(?([a-z][a-z0-9]*\[[\d,]*\]\{[^}]*\})', dest)
        moved = _hlo.shape_bytes(first.group(1).split('{')[0]) if first else 0
        if first and _in_vmem(first.group(1)):
          totals['vmem_prefetch'] += mult * moved
        totals['hbm'] += mult * moved  # an HBM read into VMEM, or an HBM write out of it
        continue
      cost = _COST.search(ins.rest) if 'tpu_custom_call' in ins.rest else None
      if cost:
        in_vmem = sum(_array_bytes(types[o], True) for o in operands)
        totals['hbm'] += mult * max(0, int(cost.group(1)) - in_vmem -
                                    _array_bytes(ins.type, True))
        continue
      called = _hlo._CALLS.search(ins.rest)
      reads = (_fused_reads(comps.get(called.group(1)), len(operands))
               if ins.op == 'fusion' and called else None)
      for i, o in enumerate(operands):
        if _in_vmem(types[o]):
          continue
        r = reads[i] if reads is not None and reads[i] is not None else None
        totals['hbm'] += mult * (_array_bytes(types[o], False) if r is None else r)
      if not _in_vmem(ins.type):
        totals['hbm'] += mult * min(_array_bytes(ins.type, False),
                                    _hlo._written_bytes(ins, comps))
  walk('ENTRY', 1)
  return totals
