"""TPU pod slices as compile-only devices: a slice name -> its chips -> an ('x', 'y', 'z') mesh.

A slice is named as libtpu names its topology, '<generation>:<chips per torus axis>'
('v4:4x4x4', 'v5p:2x2x2', 'v5e:2x4', 'v6e:16x16'), or by a `qjax.aot` target name
('v5e-8'). Its devices come from `jax.experimental.topologies.get_topology_desc` with the
compile-only TPU toolchain (`qjax.aot.toolchain`): nothing runs on them, the TPU compiler
compiles for them. One jax device per chip: TPU v4 and v5p chips have two TensorCores,
which Cloud TPU runs as one megacore device (v4 needs `chip_config_name='megacore'` for
that; libtpu gives v5p one device a chip already).

The process must start its own backends without libtpu (`JAX_PLATFORMS=cpu`);
`qjax.aot.toolchain.activate` then reaches the toolchain for these topologies only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np
from jax.sharding import AxisType

from qjax import costmodel
from qjax.aot import _targets
from qjax.aot import toolchain
from qjax.sharding._rules import MESH_AXES

# Generation -> (costmodel chip, torus dims).
GENERATIONS = {'v4': ('tpu_v4', 3), 'v5p': ('tpu_v5p', 3), 'v5e': ('tpu_v5e', 2),
               'v6e': ('tpu_v6e', 2)}
_NAME = re.compile(r'^(v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})$')


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice.

  Attributes:
    name: the libtpu topology name ('v4:4x4x4').
    generation: 'v4', 'v5p', 'v5e' or 'v6e'.
    chip: the `qjax.costmodel` chip preset ('tpu_v4').
    torus: chips along each torus axis ((4, 4, 4)).
  """

  name: str
  generation: str
  chip: str
  torus: tuple

  @property
  def n_chips(self) -> int:
    return math.prod(self.torus)


def parse_slice(name: str) -> Slice:
  """A Slice from 'v4:4x4x4' / 'v5e:2x4' or a `qjax.aot` TPU target name ('v5e-8').

  Raises:
    ValueError: an unknown generation or a malformed name (the accepted forms named).
  """
  spec = _targets.TARGETS.get(name)
  if spec is not None:
    if spec.platform != 'tpu':
      raise ValueError(f'slice {name!r} is a {spec.platform.upper()} target; a slice is a TPU '
                       f'topology such as v5e:2x4 or v4:4x4x4.')
    name = spec.topology
  m = _NAME.match(str(name))
  if not m:
    raise ValueError(f'slice {name!r} is not a TPU topology: use <generation>:<chips per axis>'
                     f' with generation in {sorted(GENERATIONS)} (v4 / v5p 3-D: v4:4x4x4; '
                     f'v5e / v6e 2-D: v5e:2x4, v5e:16x16), or a qjax.aot target name such as '
                     f'v5e-8.')
  gen, dims = m.group(1), tuple(int(d) for d in m.group(2).split('x'))
  chip, ndim = GENERATIONS[gen]
  if len(dims) != ndim:
    raise ValueError(f'slice {name!r}: {gen} is a {ndim}-D torus, so name {ndim} axes (e.g. '
                     f'{gen}:{"x".join(["2"] * ndim)}).')
  return Slice(name=str(name), generation=gen, chip=chip, torus=dims)


@functools.lru_cache(maxsize=None)
def slice_devices(name: str) -> tuple:
  """The compile-only devices of a slice, one per chip (built once per process).

  Raises:
    RuntimeError: the compile-only TPU toolchain is not installed (the command named).
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  s = parse_slice(name)
  toolchain.activate('tpu')
  kw = {}
  if s.generation == 'v4':
    kw['chip_config_name'] = 'megacore'
  if s.n_chips == 1:
    kw['chips_per_host_bounds'] = (1, 1, 1)
  with toolchain.tpu_env():
    topo = topologies.get_topology_desc(s.name, 'tpu', **kw)
  found = tuple(topo.devices)
  if len(found) != s.n_chips:
    raise RuntimeError(f'slice {s.name}: libtpu gave {len(found)} devices for '
                       f'{s.n_chips} chips.')
  return found


def slice_mesh(name: str, mesh='') -> jax.sharding.Mesh:
  """An ('x', 'y', 'z') mesh with Auto axes over a slice's chips.

  Args:
    name: the slice.
    mesh: the logical mesh ('4x4x4', a costmodel Mesh); '' takes the torus as it is (a 2-D
      slice gets z = 1). Devices are laid out by `mesh_utils.create_device_mesh`, which maps
      mesh axes onto torus axes (a logical axis may take a whole torus axis or split one).

  Raises:
    ValueError: the mesh's chip count differs from the slice's.
  """
  s = parse_slice(name)
  m = costmodel.as_mesh(mesh or 'x'.join(map(str, s.torus)))
  if m.n != s.n_chips:
    raise ValueError(f'mesh {m} has {m.n} chips, slice {s.name} has {s.n_chips}; pick a mesh '
                     f'whose axes multiply to {s.n_chips}.')
  devices = list(slice_devices(s.name))
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  try:
    grid = mesh_utils.create_device_mesh((m.x, m.y, m.z), devices,
                                         allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.array(devices).reshape(m.x, m.y, m.z)  # device order: z fastest
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
