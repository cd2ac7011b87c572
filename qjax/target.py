"""The target: which device a program is traced for, the one input of every path decision.

qjax chooses paths while a program is traced (the matmul path, the code layout, the attention
form, the paged kernel, whether the CPU kernel may run). Those choices follow the devices the
program is compiled for, not the host it is traced on, so a CPU host compiling for a
compile-only TPU (`qjax.aot`) traces exactly what that TPU would run. `current()` answers,
first match wins:

| where it looks | set by |
|---|---|
| the innermost `use(...)` | `qjax.aot.compile`, or a caller |
| the mesh in context | `jax.set_mesh(mesh)` / `with mesh:` (its devices) |
| the abstract mesh's device | `jax.sharding.use_abstract_mesh(...)` with an `abstract_device` |
| jax's default device | `jax.default_device(device_or_platform)` |
| the default backend | otherwise: the host's own devices |

Nothing else in qjax reads `jax.default_backend()` to decide a path; records and reports
state `current()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Iterator, Optional, Sequence, Union

import jax

# Platforms a Target names: jax's backends, with 'gpu' split by vendor.
PLATFORMS = ('cpu', 'nvidia', 'rocm', 'tpu')


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a program is for.

  Attributes:
    platform: 'cpu', 'nvidia', 'rocm' or 'tpu' (another backend's name as jax gives it).
    device_kind: the device's kind, as jax reports it ('TPU v5 lite', 'NVIDIA H200', 'cpu').
    device_count: devices the program spans (a mesh's size; 1 for one device).
    compute_capability: (major, minor) of an NVIDIA GPU (9.0 is Hopper), else None.
    compile_only: the devices exist only to compile for (`qjax.aot`), nothing runs on them.
    source: where `current()` found it (module docstring's table).
  """

  platform: str
  device_kind: str
  device_count: int = 1
  compute_capability: Optional[tuple[int, int]] = None
  compile_only: bool = False
  source: str = 'default backend'

  @property
  def backend(self) -> str:
    """jax's backend name: 'cpu', 'gpu' or 'tpu'."""
    return 'gpu' if self.platform in ('nvidia', 'rocm') else self.platform

  @property
  def accelerator(self) -> bool:
    """Whether the target is a GPU or TPU."""
    return self.platform in ('nvidia', 'rocm', 'tpu')

  def facts(self) -> dict:
    """The target as a record field."""
    return dataclasses.asdict(self)


_USED: contextvars.ContextVar[tuple] = contextvars.ContextVar('qjax_target', default=())


def _platform_of(device_platform: str, client=None) -> str:
  """'nvidia' / 'rocm' for jax's 'gpu' (by the client's platform version), else as given."""
  p = device_platform.lower()
  if p == 'cuda':
    return 'nvidia'
  if p != 'gpu':
    return p
  version = str(getattr(client, 'platform_version', '')).lower()
  return 'rocm' if 'rocm' in version or 'hip' in version else 'nvidia'


def _capability(device) -> Optional[tuple[int, int]]:
  try:
    major, minor = str(device.compute_capability).split('.')[:2]
    return int(major), int(minor)
  except (AttributeError, ValueError):
    return None


def _client(device):
  try:
    return device.client
  except Exception:  # pylint: disable=broad-except  (compile-only devices have no client)
    return None


def _is_compile_only(device) -> bool:
  return type(_client(device)).__name__ == 'CompileOnlyPyClient'


def of_devices(devices: Sequence[Any], source: str) -> Target:
  """The Target of concrete devices (all of one platform)."""
  devices = list(devices)
  if not devices:
    raise ValueError(f'qjax.target.of_devices: no devices given ({source}).')
  d = devices[0]
  platform = _platform_of(d.platform, _client(d))
  kinds = {x.device_kind for x in devices}
  if len({x.platform for x in devices}) > 1 or len(kinds) > 1:
    raise ValueError(f'qjax.target: devices of several platforms or kinds '
                     f'{sorted(kinds)} ({source}); compile for one kind of device at a time.')
  cap = _capability(d) if platform == 'nvidia' else None
  return Target(platform, d.device_kind, len(devices), cap, _is_compile_only(d), source)


def _of_abstract(device, size: int) -> Target:
  platform = _platform_of(device.platform)
  cap = None
  if platform == 'nvidia':
    cap = _capability(device) or _capability_of_kind(device.device_kind)
  return Target(platform, device.device_kind, size, cap, False, 'abstract mesh')


def _capability_of_kind(kind: str) -> Optional[tuple[int, int]]:
  """The compute capability an NVIDIA device kind names (abstract devices carry none)."""
  kind = kind.upper()
  for names, cap in ((('B200', 'B300'), (10, 0)), (('H100', 'H200', 'H20'), (9, 0)),
                     (('L4', 'L40', 'RTX 40'), (8, 9)), (('A100', 'A30', 'A800'), (8, 0)),
                     (('A10', 'A40', 'RTX 30', 'A6000'), (8, 6)), (('V100',), (7, 0)),
                     (('T4',), (7, 5))):
    if any(n in kind for n in names):
      return cap
  return None


def _resolve(spec: Union[str, Target, Any]) -> Target:
  """A Target from what `use` takes."""
  if isinstance(spec, Target):
    return spec
  if isinstance(spec, jax.sharding.Mesh):
    return of_devices(spec.devices.flat, 'qjax.target.use(mesh)')
  if isinstance(spec, str):
    if spec not in PLATFORMS:
      raise ValueError(f'qjax.target.use({spec!r}): a platform name is one of {PLATFORMS}; '
                       "for a named chip ('v5e-1', 'h200') use qjax.aot.target(name).")
    return Target(spec, f'{spec} (no device kind)', source='qjax.target.use(platform)')
  if isinstance(spec, (list, tuple)):
    return of_devices(spec, 'qjax.target.use(devices)')
  if hasattr(spec, 'platform') and hasattr(spec, 'device_kind'):
    return of_devices([spec], 'qjax.target.use(device)')
  raise TypeError(f'qjax.target.use: {spec!r} is not a Target, platform name, device, list of '
                  'devices or Mesh.')


@contextlib.contextmanager
def use(spec: Union[str, Target, Any]) -> Iterator[Target]:
  """Within the block, programs are traced for `spec`'s devices.

  Args:
    spec: a Target, a platform name ('cpu', 'nvidia', 'rocm', 'tpu'), a device (a compile-only
      one included), a list of devices, or a Mesh.

  Yields:
    The Target in force.
  """
  t = _resolve(spec)
  token = _USED.set(_USED.get() + (t,))
  try:
    yield t
  finally:
    _USED.reset(token)


def _mesh_target() -> Optional[Target]:
  try:
    mesh = jax.sharding.get_mesh()
  except Exception:  # pylint: disable=broad-except  (no mesh API, or none set)
    mesh = None
  if mesh is not None and not getattr(mesh, 'empty', True):
    devices = getattr(mesh, 'devices', None)
    if devices is not None and getattr(devices, 'size', 0):
      return of_devices(list(devices.flat), 'mesh in context')
  try:
    abstract = jax.sharding.get_abstract_mesh()
  except Exception:  # pylint: disable=broad-except
    return None
  device = getattr(abstract, 'abstract_device', None)
  if device is not None and getattr(device, 'platform', None):
    return _of_abstract(device, max(int(getattr(abstract, 'size', 1) or 1), 1))
  return None


@functools.lru_cache(maxsize=None)
def _backend_target(backend: str) -> Target:
  return of_devices(jax.devices(backend), 'default backend')


def current() -> Target:
  """The Target programs traced now are for (the module docstring's table)."""
  used = _USED.get()
  if used:
    return used[-1]
  t = _mesh_target()
  if t is not None:
    return t
  default = jax.config.jax_default_device
  if default is not None:
    if isinstance(default, str):
      return dataclasses.replace(_backend_target(default), source='jax.default_device')
    return of_devices([default], 'jax.default_device')
  return _backend_target(jax.default_backend())


def platform() -> str:
  """`current().platform`: 'cpu', 'nvidia', 'rocm' or 'tpu'."""
  return current().platform


def on_cpu() -> bool:
  """Whether programs traced now are for the CPU."""
  return current().platform == 'cpu'
