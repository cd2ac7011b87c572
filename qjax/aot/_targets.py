"""Named compile-only targets: a TPU slice or a GPU, as jax devices that compile but never run.

| name | devices | chip (`qjax.costmodel`) | how |
|---|---|---|---|
| v5e-1, v5e-4, v5e-8 | 1, 4, 8 TPU v5 lite | tpu_v5e | libtpu topology 'v5e:1x1' / '2x2' / '2x4' |
| v6e-1, v6e-4, v6e-8 | 1, 4, 8 TPU v6 lite | tpu_v6e | libtpu topology 'v6e:...' |
| v5p-8 | 4 TPU v5 (megacore: one device a chip) | tpu_v5p | 'v5p:2x2x1' |
| v4-8 | 8 TPU v4 cores on 4 chips | tpu_v4 | 'v4:2x2x1' |
| h100, h200 | 1 NVIDIA GPU | h100 / h200 | the CUDA plugin with a GPU target description |

A GPU target description (XLA's `GpuTargetConfigProto`) is written here from the device's
published facts (SM count, clocks, caches, compute capability) and the chip table's memory
size and bandwidth, so nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import numpy as np

from qjax import costmodel
from qjax import target as qjax_target
from qjax.aot import toolchain


@dataclasses.dataclass(frozen=True)
class TargetSpec:
  """A named compile-only target.

  Attributes:
    name: the name ('v5e-1', 'h200', ...).
    platform: 'tpu' or 'gpu' (the toolchain it needs).
    topology: the libtpu topology ('v5e:2x4'), or the GPU's description key.
    chip: the `qjax.costmodel` chip preset (HBM, bandwidth, peak FLOP/s).
    devices_per_chip: jax devices per chip (2 on TPU v4: one per TensorCore).
    mesh_shape: the device mesh the slice is laid out as (ICI torus axes).
  """

  name: str
  platform: str
  topology: str
  chip: str
  devices_per_chip: int = 1
  mesh_shape: tuple = (1,)

  @property
  def n_devices(self) -> int:
    return int(np.prod(self.mesh_shape))

  @property
  def hbm_per_device(self) -> float:
    """Bytes of HBM one jax device holds."""
    return costmodel.get_chip(self.chip).hbm_bytes / self.devices_per_chip


TARGETS = {s.name: s for s in (
    TargetSpec('v5e-1', 'tpu', 'v5e:1x1', 'tpu_v5e'),
    TargetSpec('v5e-4', 'tpu', 'v5e:2x2', 'tpu_v5e', mesh_shape=(2, 2)),
    TargetSpec('v5e-8', 'tpu', 'v5e:2x4', 'tpu_v5e', mesh_shape=(2, 4)),
    TargetSpec('v6e-1', 'tpu', 'v6e:1x1', 'tpu_v6e'),
    TargetSpec('v6e-4', 'tpu', 'v6e:2x2', 'tpu_v6e', mesh_shape=(2, 2)),
    TargetSpec('v6e-8', 'tpu', 'v6e:2x4', 'tpu_v6e', mesh_shape=(2, 4)),
    TargetSpec('v5p-8', 'tpu', 'v5p:2x2x1', 'tpu_v5p', mesh_shape=(2, 2)),
    TargetSpec('v4-8', 'tpu', 'v4:2x2x1', 'tpu_v4', devices_per_chip=2, mesh_shape=(2, 4)),
    TargetSpec('h100', 'gpu', 'h100', 'h100'),
    TargetSpec('h200', 'gpu', 'h200', 'h200'),
)}


@dataclasses.dataclass(frozen=True)
class _Gpu:
  """What XLA's GPU compiler reads of a device besides memory (NVIDIA's published specs)."""

  name: str
  major: int
  minor: int
  sms: int
  clock_ghz: float
  l2_bytes: int


# H100 SXM5 and H200 SXM: Hopper GH100, 132 SMs, 1.98 GHz boost, 50 MiB L2, sm_90a
# (NVIDIA Hopper tuning guide and datasheets, read 2026-12-06).
_GPUS = {
    'h100': _Gpu('NVIDIA H100 80GB HBM3', 9, 0, 132, 1.98, 50 * 2**20),
    'h200': _Gpu('NVIDIA H200', 9, 0, 132, 1.98, 50 * 2**20),
}


def gpu_target_config(key: str) -> str:
  """XLA's GPU target description (text proto) for the GPU `key` ('h100', 'h200')."""
  g, chip = _GPUS[key], costmodel.get_chip(key)
  return f'''gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {g.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bw)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {int(chip.hbm_bytes)}
  cuda_compute_capability {{
    major: {g.major} minor: {g.minor} feature_extension: ACCELERATED_FEATURES
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{g.name}"
'''


def spec_of(name: str) -> TargetSpec:
  """The TargetSpec of a name; an unknown name raises with the list."""
  if isinstance(name, TargetSpec):
    return name
  if name not in TARGETS:
    raise ValueError(f'qjax.aot: target {name!r} is unknown; use one of {sorted(TARGETS)}.')
  return TARGETS[name]


@functools.lru_cache(maxsize=None)
def devices(name: str) -> tuple:
  """The compile-only jax devices of a named target (built once per process).

  Raises:
    RuntimeError: the target's toolchain is not installed (how to install it named).
  """
  spec = spec_of(name)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  toolchain.activate(spec.platform)
  if spec.platform == 'tpu':
    kw = {'chips_per_host_bounds': (1, 1, 1)} if spec.n_devices == 1 else {}
    with toolchain.tpu_env():
      topo = topologies.get_topology_desc(spec.topology, 'tpu', **kw)
  else:
    topo = topologies.get_topology_desc('1x1x1', 'cuda', topology='1x1x1',
                                        target_config=gpu_target_config(spec.topology))
  found = tuple(topo.devices)
  if len(found) != spec.n_devices:
    raise RuntimeError(f'qjax.aot: topology {spec.topology!r} gave {len(found)} devices, '
                       f'expected {spec.n_devices}.')
  return found


def mesh(name: str, axis_names: Optional[tuple] = None) -> jax.sharding.Mesh:
  """A Mesh over a named target's devices, shaped as its slice (`TargetSpec.mesh_shape`)."""
  spec = spec_of(name)
  axis_names = axis_names or ('x', 'y', 'z')[:len(spec.mesh_shape)]
  if len(axis_names) != len(spec.mesh_shape):
    raise ValueError(f'qjax.aot.mesh({name!r}): {len(axis_names)} axis names for a mesh of '
                     f'shape {spec.mesh_shape}.')
  return jax.sharding.Mesh(np.array(devices(name)).reshape(spec.mesh_shape), axis_names)


def target(name: str) -> qjax_target.Target:
  """The `qjax.target.Target` programs compiled for `name` are traced for."""
  t = qjax_target.of_devices(devices(name), f'qjax.aot target {name!r}')
  return dataclasses.replace(t, compile_only=True)
