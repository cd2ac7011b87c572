"""What a compiled (optimized, scheduled) HLO module says about a program: its custom calls
(the kernels present, and the Pallas kernels by name) and the bytes its top-level ops move.

XLA's own cost analysis gives 'bytes accessed' for TPU programs; for a compile-only GPU it
gives none, so `bytes_moved` counts them from the module text: every op that touches memory
(a fusion, custom call, copy, collective; not parameters, tuples, bitcasts) reads its operands
and writes its result, a `while` body counts once per known trip, and a fusion that updates a
buffer in place (`dynamic-update-slice` or `scatter` at its root) or only slices an operand
counts the update and the slice, not the whole buffer; a `call` counts its computation once and a
`conditional` its costliest branch. It is an upper bound of HBM traffic (a fusion
that reads part of an operand counts all of it) and the same rule for every format, so ratios
between formats compare like with like.
"""

from __future__ import annotations

import collections
import re
from typing import Optional

import numpy as np

_ITEM_BITS = {'pred': 8, 's2': 2, 'u2': 2, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8, 's16': 16,
              'u16': 16, 's32': 32, 'u32': 32, 's64': 64, 'u64': 64, 'f16': 16, 'bf16': 16,
              'f32': 32, 'f64': 64, 'c64': 64, 'c128': 128, 'f8e4m3fn': 8, 'f8e5m2': 8,
              'f8e4m3': 8, 'f8e4m3fnuz': 8, 'f8e5m2fnuz': 8, 'f8e4m3b11fnuz': 8,
              'f8e8m0fnu': 8, 'f4e2m1fn': 4}
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([\d,]*)\]')
_INSTR = re.compile(r'^\s*(ROOT\s+)?%(\S+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$')
_HEADER = re.compile(r'^(ENTRY\s+)?%(\S+)\s*\(.*\)\s*->.*\{\s*$')
_OPERAND = re.compile(r'%([\w.\-]+)')
_CALLS = re.compile(r'calls=%([\w.\-]+)')
_BODY = re.compile(r'body=%([\w.\-]+)')
_TO_APPLY = re.compile(r'to_apply=%([\w.\-]+)')
_BRANCHES = re.compile(r'(?:true_computation|false_computation)=%([\w.\-]+)')
_BRANCH_LIST = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[a-z_]+)"')

# Ops that only name or reshape buffers already counted, or that nest computations.
_FREE = {'parameter', 'get-tuple-element', 'tuple', 'bitcast', 'constant', 'while', 'call',
         'conditional', 'after-all', 'partition-id', 'replica-id', 'opt-barrier',
         'copy-done', 'all-gather-done', 'all-reduce-done', 'collective-permute-done',
         'async-done', 'add-dependency', 'iota'}

# Custom-call targets -> the kernel family a report names.
KERNEL_FAMILIES = (
    ('tpu_custom_call', 'mosaic'),
    ('__gpu$xla.gpu.triton', 'triton'),
    ('mosaic_gpu', 'mosaic_gpu'),
    ('__cudnn$', 'cudnn'),
    ('__cublas$', 'cublas'),
    ('qjax_gemv', 'qjax_cpu_kernel'),
)


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in an HLO type string (a tuple sums its elements)."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    bits = _ITEM_BITS.get(dtype)
    if bits is None:
      continue
    n = int(np.prod([int(d) for d in dims.split(',') if d])) if dims else 1
    total += -(-n * bits // 8)
  return total


class _Instr(collections.namedtuple('_Instr', 'name type op rest root')):
  """One HLO instruction: its name, result type text, opcode, the rest of its line."""


def parse(text: str) -> dict:
  """{computation name: [instructions]}, with the entry computation under 'ENTRY'."""
  comps, current = {}, None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      current = 'ENTRY' if h.group(1) else h.group(2)
      comps[current] = []
      continue
    if current is None:
      continue
    if line.startswith('}'):
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[current].append(_Instr(m.group(2), m.group(3), m.group(4), m.group(5),
                                   bool(m.group(1))))
  return comps


def custom_calls(text: str) -> dict:
  """{custom-call target: count} in the module, plus XLA's Triton GEMM fusions
  ('__triton_gemm' and its kinds) counted under their fusion kind."""
  out = collections.Counter(_TARGET.findall(text))
  for line in text.splitlines():
    if 'kind=kCustom' in line:
      for kind in _FUSION_KIND.findall(line):
        out[kind] += 1
  return dict(out)


_KERNEL_CALL = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+?)(?:\.\d+)*\s*=.*custom_call_target="'
                          r'(tpu_custom_call|__gpu\$xla\.gpu\.triton|mosaic_gpu[^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GENERIC = {'pallas_call', 'custom-call', 'custom_call'}


def kernel_names(text: str) -> dict:
  """{kernel name: count} of the module's Pallas / Mosaic / Triton kernel calls: the name a
  kernel was given (`pallas_call(name=...)`), as the compiler keeps it in the call's
  instruction name or, where that is generic, in the op name's scope (`.../name/pallas_call`;
  a jitted wrapper's scope `jit(f)` gives `f`)."""
  out = collections.Counter()
  for line in text.splitlines():
    m = _KERNEL_CALL.match(line)
    if not m:
      continue
    name = m.group(1)
    if name in _GENERIC:
      op = _OP_NAME.search(line)
      scopes = [s for s in (op.group(1).split('/') if op else []) if s not in _GENERIC]
      name = scopes[-1] if scopes else name
      name = re.sub(r'^(?:jit|pjit)\((.*)\)$', r'\1', name)
    out[name] += 1
  return dict(out)


def kernel_families(calls: dict) -> list:
  """The kernel families (`KERNEL_FAMILIES`) present among `custom_calls`' targets."""
  found = []
  for needle, family in KERNEL_FAMILIES:
    if any(needle in name for name in calls) and family not in found:
      found.append(family)
  return found


# Ops that update their first operand's buffer in place, by the index of their update: a
# dynamic-update-slice (operand, update, indices...) and a scatter (operand, indices, updates)
# write only the update (XLA aliases a dead operand's buffer; a live one gets a copy op).
_IN_PLACE = {'dynamic-update-slice': 1, 'scatter': 2}


def _fused_read_bytes(comp: list, n_operands: int) -> Optional[list]:
  """Per-operand bytes a fused computation reads: a parameter used only by dynamic-slices
  counts their results; a parameter that is the buffer a root dynamic-update-slice writes
  into counts nothing (it is updated in place). None when the computation is unknown."""
  if comp is None:
    return None
  params = {}
  for ins in comp:
    if ins.op == 'parameter':
      m = re.match(r'\s*(\d+)\)', ins.rest)
      if m:
        params[ins.name] = int(m.group(1))
  reads = [None] * n_operands
  users = collections.defaultdict(list)
  for ins in comp:
    for name in _OPERAND.findall(ins.rest.split('),')[0]):
      users[name].append(ins)
  root = next((ins for ins in comp if ins.root), None)
  in_place = None
  if root is not None and root.op in _IN_PLACE:
    ops = _OPERAND.findall(root.rest)
    in_place = ops[0] if ops else None
  for name, index in params.items():
    if index >= n_operands:
      continue
    uses = users.get(name, [])
    if name == in_place:
      reads[index] = 0
    elif uses and all(u.op == 'dynamic-slice' for u in uses):
      reads[index] = sum(shape_bytes(u.type) for u in uses)
  return reads


def _written_bytes(ins: _Instr, comps: dict) -> int:
  """Bytes an op writes: its result, or the update of an in-place dynamic-update-slice or
  scatter."""
  called = _CALLS.search(ins.rest)
  comp = comps.get(called.group(1)) if called else None
  if ins.op in _IN_PLACE or (comp and any(i.root and i.op in _IN_PLACE for i in comp)):
    inner = comp if comp else [ins]
    root = next((i for i in inner if i.root), ins) if comp else ins
    shapes = {i.name: i.type for i in inner}
    ops = _OPERAND.findall(root.rest)
    update = _IN_PLACE.get(root.op)
    if update is not None and len(ops) > update and ops[update] in shapes:
      return shape_bytes(shapes[ops[update]])
  return shape_bytes(ins.type)


def _computation_bytes(name: str, comps: dict, depth: int = 0) -> int:
  comp = comps.get(name, [])
  types = {ins.name: ins.type for ins in comp}
  total = 0
  for ins in comp:
    if ins.op in ('call', 'conditional') and depth < 8:
      if ins.op == 'call':
        called = _TO_APPLY.findall(ins.rest)
      else:
        listed = _BRANCH_LIST.search(ins.rest)
        called = (_OPERAND.findall(listed.group(1)) if listed else _BRANCHES.findall(ins.rest))
      total += max([_computation_bytes(c, comps, depth + 1) for c in called], default=0)
      continue
    if ins.op == 'while' and depth < 8:
      body = _BODY.search(ins.rest)
      trips = _TRIPS.search(ins.rest)
      if body:
        total += (int(trips.group(1)) if trips else 1) * _computation_bytes(
            body.group(1), comps, depth + 1)
      continue
    if ins.op in _FREE or ins.op.endswith('-done'):
      continue
    operands = _OPERAND.findall(ins.rest.split('),')[0] + ')')
    operands = [o for o in operands if o in types]
    called = _CALLS.search(ins.rest)
    reads = None
    if ins.op == 'fusion' and called:
      reads = _fused_read_bytes(comps.get(called.group(1)), len(operands))
    for i, o in enumerate(operands):
      r = reads[i] if reads is not None and reads[i] is not None else None
      total += shape_bytes(types[o]) if r is None else r
    total += _written_bytes(ins, comps)
  return total


def bytes_moved(text: str) -> int:
  """Bytes the module's top-level ops read and write (module docstring's rules)."""
  return _computation_bytes('ENTRY', parse(text))


_COLLECTIVE = re.compile(r'=\s*\S.*?\s(all-gather|reduce-scatter|all-reduce|all-to-all|'
                         r'collective-permute)(?:-start)?\(')


def collective_counts(text: str) -> dict:
  """{collective kind: count} of the module's collective ops (async pairs counted once)."""
  return dict(collections.Counter(m.group(1) for line in text.splitlines()
                                  for m in [_COLLECTIVE.search(line)] if m))
