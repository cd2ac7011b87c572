"""Collectives in compiled HLO: the mesh axes each runs over and the bytes it moves per chip.

XLA prints replica groups in three forms: explicit (`{{0,2},{1,3}}`), iota
(`[4,2]<=[2,2,2]T(0,2,1)`) and mesh (`mesh['axis_0'=2,...] {'axis_1'}` with optional
`device_ids=(...)`). Ids are positions in the mesh's flattened device order. A group set is
named by the smallest set of mesh axes (of size > 1) whose chips it connects.

Bytes follow `qjax.costmodel`'s convention, so the two compare directly. `nbytes` is D, the
per-chip tensor of the collective: an all-gather's output, a reduce-scatter's input, an
all-reduce's or all-to-all's tensor, a collective-permute's buffer. `sent_bytes` is what one
chip sends over K chips: D (K-1)/K (all-gather, reduce-scatter, all-to-all), twice that for
an all-reduce (a reduce-scatter then an all-gather), D for a collective-permute.

The TPU compiler's own forms are read as what they do: a `kCustom` fusion that calls an
`all-reduce-scatter` computation (an all-reduce followed by the slice each chip keeps) is one
reduce-scatter of the all-reduce's input; asynchronous `-start` ops count once; a collective
inside a `while` body counts once per known trip (`count`); an asynchronous collective
fusion (start, progress inside compute fusions, done) counts once.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from typing import Optional

import numpy as np

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
_OP = re.compile(r'=\s*(\S+|\(.*?\))\s+(' + '|'.join(KINDS) + r')(-start)?\(')
_EXPLICIT = re.compile(r'replica_groups=(\{(?:\{[\d,]*\},?)*\})')
_IOTA = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[[\d,]+\]"
                   r"(?:T\([\d,]+\))?\))?\s*\{([^}]*)\}")
_DEVICE_IDS = re.compile(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)')
_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')
_NAME = re.compile(r'op_name="([^"]*)"')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTR_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=')
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([\d,]*)\]')
_BODY = re.compile(r'body=%?([\w.\-]+)')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r'(?:calls|to_apply|condition|true_computation|false_computation)='
                     r'%?([\w.\-]+)|branch_computations=\{([^}]*)\}')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
_FUSION_CALL = re.compile(r'\sfusion\(.*kind=kCustom, calls=%?([\w.\-]+)')
_ITEM_BITS = {'pred': 8, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8, 's16': 16, 'u16': 16, 's32': 32,
              'u32': 32, 's64': 64, 'u64': 64, 'f16': 16, 'bf16': 16, 'f32': 32, 'f64': 64,
              'f8e4m3fn': 8, 'f8e5m2': 8, 'f8e4m3': 8, 'f8e4m3fnuz': 8, 'f8e5m2fnuz': 8,
              'f8e4m3b11fnuz': 8}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a compiled module.

  Attributes:
    kind: one of KINDS.
    shape: its result type as printed.
    axes: the mesh axes its groups span; () within one chip; None when unmatched.
    op_name: the jax op it came from (metadata), e.g. '.../shard_map/gather_input/...'.
    nbytes: D, the per-chip tensor (module docstring).
    group_size: K, chips per group (1 for a collective-permute).
    count: times it runs per call of the module (trips of the `while` loops around it).
  """

  kind: str
  shape: str
  axes: Optional[tuple]
  op_name: str = ''
  nbytes: int = 0
  group_size: int = 1
  count: int = 1

  @property
  def sent_bytes(self) -> float:
    """Bytes one chip sends per run (module docstring), times `count`."""
    k = self.group_size
    if self.kind == 'collective-permute':
      return float(self.nbytes * self.count)
    if k <= 1:
      return 0.0
    factor = 2 if self.kind == 'all-reduce' else 1
    return factor * self.nbytes * (k - 1) / k * self.count


def _iota(dims, perm) -> np.ndarray:
  a = np.arange(int(np.prod(dims))).reshape(dims)
  return a.transpose(perm) if perm else a


def _groups(line: str) -> Optional[list]:
  """The replica groups of one HLO instruction as lists of ids, or None if unparsed."""
  m = _EXPLICIT.search(line)
  if m:
    groups = re.findall(r'\{([\d,]*)\}', m.group(1)[1:-1])
    return [[int(i) for i in g.split(',') if i] for g in groups]
  m = _IOTA.search(line)
  if m:
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(',')]
    perm = [int(p) for p in m.group(4).split(',')] if m.group(4) else None
    return _iota(dims, perm).reshape(g, s).tolist()
  m = _MESH.search(line)
  if m:
    return _mesh_groups(line, m)
  m = _PAIRS.search(line)
  if m:  # a permute: the chips it connects, as groups of pairs
    return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)\}', m.group(1))]
  return None


_SUB_AXIS = re.compile(r"'?([\w.]+)'?(?::\((\d+)\)(\d+))?")


def _mesh_groups(line: str, m) -> list:
  """Groups of the `mesh[...] {axes}` form; an axis may be a sub-axis `'a':(p)s` (the s
  chips after the first p of each block of a's size)."""
  sizes = [(k.strip().strip("'"), int(v)) for k, v in (p.split('=') for p in m.group(1).split(','))]
  along = [_SUB_AXIS.fullmatch(a.strip()) for a in m.group(2).split(',') if a.strip()]
  factors, picked = [], []  # the mesh's axes as (name, pre, size) factors, major first
  for name, n in sizes:
    subs = [a for a in along if a.group(1) == name]
    if subs and subs[0].group(2):
      pre, size = int(subs[0].group(2)), int(subs[0].group(3))
      factors += [(name, 'pre', pre), (name, 'sub', size), (name, 'post', n // (pre * size))]
      picked.append(len(factors) - 2)
    else:
      factors.append((name, 'all', n))
      if subs:
        picked.append(len(factors) - 1)
  d = _DEVICE_IDS.search(line)
  total = int(np.prod([n for _, n in sizes]))
  ids = _iota([int(x) for x in d.group(1).split(',')],
              [int(p) for p in d.group(2).split(',')] if d and d.group(2) else None) \
      if d else np.arange(total)
  ids = ids.reshape([f[2] for f in factors])
  rest = [i for i in range(len(factors)) if i not in picked]
  k = int(np.prod([factors[i][2] for i in picked])) if picked else 1
  return ids.transpose(rest + picked).reshape(-1, k).tolist()


def mesh_groupings(mesh) -> dict:
  """{frozenset of groups: mesh axes} for every subset of the mesh axes of size > 1."""
  names = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  ids = np.arange(mesh.size).reshape([mesh.shape[a] for a in mesh.axis_names])
  out = {}
  for r in range(1, len(names) + 1):
    for axes in itertools.combinations(names, r):
      along = [mesh.axis_names.index(a) for a in axes]
      rest = [i for i in range(ids.ndim) if i not in along]
      groups = ids.transpose(rest + along).reshape(-1, int(np.prod(
          [ids.shape[i] for i in along])))
      out.setdefault(frozenset(frozenset(g) for g in groups.tolist()), tuple(axes))
  return out


def _array_bytes(text: str) -> list:
  """Bytes of each array in an HLO type string, in order (a tuple gives several)."""
  out = []
  for dtype, dims in _ARRAY.findall(text):
    bits = _ITEM_BITS.get(dtype)
    if bits is None:
      continue
    n = int(np.prod([int(d) for d in dims.split(',') if d])) if dims else 1
    out.append(-(-n * bits // 8))
  return out


def _per_chip_tensor(kind: str, result: str, is_start: bool, k: int) -> int:
  """D of one collective from its result type (module docstring)."""
  sizes = _array_bytes(result)
  if is_start and kind == 'all-gather':  # (operands, outputs)
    sizes = sizes[len(sizes) // 2:]
  if is_start and kind == 'collective-permute':  # (operand, output, contexts...)
    sizes = sizes[:1]
  total = sum(sizes)
  return total * k if kind == 'reduce-scatter' else total


def _split(hlo_text: str) -> dict:
  """{computation: [lines]}; lines outside any computation belong to 'ENTRY'."""
  comps, current, entry = collections.defaultdict(list), None, 'ENTRY'
  for line in hlo_text.splitlines():
    h = _HEADER.match(line)
    if h:
      current = h.group(2)
      if h.group(1):
        entry = current
      continue
    if line.startswith('}'):
      current = None
      continue
    comps[current or 'ENTRY'].append(line)
  if entry != 'ENTRY':
    comps[entry].extend(comps.pop('ENTRY', []))
  comps['__entry__'] = [entry]
  return comps


def _run_counts(comps: dict) -> tuple:
  """(times each reachable computation runs per module call, the computations of fused
  all-reduce-scatters). The TPU compiler runs an asynchronous collective as a start fusion,
  progress inside compute fusions (`async_collective_fusion.N`) and a done fusion, each
  holding the collective op: only the start's is counted."""
  entry = comps['__entry__'][0]
  counts, fused, skipped = collections.Counter({entry: 1}), set(), set()
  order = [entry]
  for name in order:  # breadth first: a caller's count is final before its callees'
    for line in comps.get(name, ()):
      m = _FUSION_CALL.search(line)
      if m and 'all-reduce-scatter' in m.group(1):
        fused.add(m.group(1))
        continue
      called = _CALLS.search(line)
      instr = _INSTR_NAME.match(line)
      if called and (called.group(1).startswith('async_collective_fusion') or (
          instr and instr.group(1).startswith('async-collective-done'))):
        skipped.add(called.group(1))  # the same collective as its async-collective-start
        continue
      trips = 1
      body = _BODY.search(line)
      if ' while(' in line and body:
        t = _TRIPS.search(line)
        trips = int(t.group(1)) if t else 1
        counts[body.group(1)] += counts[name] * trips
        if body.group(1) not in order:
          order.append(body.group(1))
      for a, b in _CALLED.findall(line):
        for callee in ([a] if a else [c.strip().lstrip('%') for c in b.split(',')]):
          if callee and callee not in order:
            counts[callee] += counts[name]
            order.append(callee)
  for name in skipped:
    counts.pop(name, None)
  return counts, fused


def collectives(hlo_text: str, mesh) -> list:
  """Every collective in `hlo_text` (compiled HLO), with its mesh axes and bytes.

  `axes` is () for a collective within one chip and None when the groups match no set of
  mesh axes (or are printed in a form not parsed here).
  """
  named = mesh_groupings(mesh)
  comps = _split(hlo_text)
  counts, fused = _run_counts(comps)
  out = []
  for comp, lines in comps.items():
    if comp == '__entry__' or comp not in counts:  # unreachable, or an async copy
      continue
    for line in lines:
      m = _OP.search(line)
      fusion = _FUSION_CALL.search(line)
      if fusion and fusion.group(1) in fused:
        inner = next((x for x in comps.get(fusion.group(1), ()) if _OP.search(x)), None)
        if inner is None:
          continue
        kind, result, is_start, groups_line = ('reduce-scatter', None, False, inner)
        operand = _OP.search(inner).group(1)
      elif m and comp not in fused:
        kind, result, is_start, groups_line = m.group(2), m.group(1), bool(m.group(3)), line
        operand = None
      else:
        continue
      groups = _groups(groups_line)
      axes, k = None, 1
      if groups is not None:
        k = max((len(g) for g in groups), default=1)
        if kind != 'collective-permute':
          key = frozenset(frozenset(g) for g in groups)
          axes = () if k <= 1 else named.get(key)
        else:
          axes = _permute_axes(groups, named)
      if operand is not None:  # a fused all-reduce-scatter: D is the all-reduce's input
        nbytes = sum(_array_bytes(operand))
        result = line.split('=', 1)[1].split(' fusion(')[0].strip()
      else:
        nbytes = _per_chip_tensor(kind, result, is_start, k)
      name = _NAME.search(line) or _NAME.search(groups_line)
      out.append(Collective(kind, result, axes, name.group(1) if name else '', nbytes,
                            1 if kind == 'collective-permute' else k,
                            counts[comp]))
  return out


def _permute_axes(pairs: list, named: dict) -> Optional[tuple]:
  """The smallest set of mesh axes whose groups contain every source-target pair."""
  for key, axes in sorted(named.items(), key=lambda kv: len(kv[1])):
    where = {i: g for g in key for i in g}
    if all(a in where and where[a] is where.get(b) for a, b in pairs):
      return axes
  return None


def count_collectives(hlo_text: str, mesh) -> collections.Counter:
  """Counter of (kind, mesh axes) over the collectives of `hlo_text`."""
  return collections.Counter((c.kind, c.axes) for c in collectives(hlo_text, mesh))


def sent_bytes(found: list) -> dict:
  """{kind: bytes one chip sends per module call} over `collectives(...)`' result."""
  out = collections.Counter()
  for c in found:
    out[c.kind] += c.sent_bytes
  return {k: out[k] for k in KINDS if out[k]}
