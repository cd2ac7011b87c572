"""Collectives in compiled HLO, with the mesh axes each one runs over.

XLA prints replica groups in three forms: explicit (`{{0,2},{1,3}}`), iota
(`[4,2]<=[2,2,2]T(0,2,1)`) and mesh (`mesh['axis_0'=2,...] {'axis_1'}` with optional
`device_ids=(...)`). Ids are positions in the mesh's flattened device order. A group set is
named by the smallest set of mesh axes (of size > 1) whose chips it connects.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from typing import Optional

import numpy as np

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
_OP = re.compile(r'=\s*(\S+|\(.*?\))\s+(' + '|'.join(KINDS) + r')(?:-start)?\(')
_EXPLICIT = re.compile(r'replica_groups=(\{(?:\{[\d,]*\},?)*\})')
_IOTA = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[[\d,]+\]"
                   r"(?:T\([\d,]+\))?\))?\s*\{([^}]*)\}")
_DEVICE_IDS = re.compile(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)')
_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op: kind ('all-gather', ...), result shape, mesh axes, op name."""

  kind: str
  shape: str
  axes: Optional[tuple]
  op_name: str = ''


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
    sizes = [(k.strip("'"), int(v)) for k, v in (p.split('=') for p in m.group(1).split(','))]
    names = [k for k, _ in sizes]
    along = [names.index(a.strip().strip("'")) for a in m.group(2).split(',') if a.strip()]
    d = _DEVICE_IDS.search(line)
    ids = _iota([int(x) for x in d.group(1).split(',')],
                [int(p) for p in d.group(2).split(',')] if d and d.group(2) else None) \
        if d else np.arange(int(np.prod([v for _, v in sizes])))
    ids = ids.reshape([v for _, v in sizes])
    rest = [i for i in range(len(sizes)) if i not in along]
    return ids.transpose(rest + along).reshape(-1, int(np.prod(
        [sizes[i][1] for i in along]) or 1)).tolist()
  return None


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


def collectives(hlo_text: str, mesh) -> list:
  """Every collective in `hlo_text` (compiled HLO), with the mesh axes it spans.

  `axes` is () for a collective within one chip and None when the groups match no set of
  mesh axes (or are printed in a form not parsed here).
  """
  named = mesh_groupings(mesh)
  out = []
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    groups = _groups(line)
    axes = None
    if groups is not None:
      key = frozenset(frozenset(g) for g in groups)
      axes = () if all(len(g) <= 1 for g in groups) else named.get(key)
    name = _NAME.search(line)
    out.append(Collective(m.group(2), m.group(1), axes, name.group(1) if name else ''))
  return out


def count_collectives(hlo_text: str, mesh) -> collections.Counter:
  """Counter of (kind, mesh axes) over the collectives of `hlo_text`."""
  return collections.Counter((c.kind, c.axes) for c in collectives(hlo_text, mesh))
