"""The machine a benchmark runs on: its environment record and its `qjax.costmodel` chip.

Shared by the device check and the attention timing (each writes the environment beside its
numbers and reads the chip's bandwidth for its bounds).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from typing import Optional

import jax

from qjax import costmodel
from qjax.eval.process import device_memory

# Device kinds (`jax.Device.device_kind`, lower case) -> `qjax.costmodel` chip presets.
CHIP_OF_KIND = (('h200', 'h200'), ('h100', 'h100'), ('v5p', 'tpu_v5p'), ('v5 lite', 'tpu_v5e'),
                ('v5e', 'tpu_v5e'), ('v6 lite', 'tpu_v6e'), ('v6e', 'tpu_v6e'), ('v4', 'tpu_v4'))


def chip_name(device) -> Optional[str]:
  """The costmodel preset name of `device` (None on CPU or an unknown kind)."""
  kind = device.device_kind.lower()
  for key, chip in CHIP_OF_KIND:
    if key in kind and device.platform != 'cpu':
      return chip
  return None


def chip_for(device) -> Optional[costmodel.Chip]:
  """The costmodel preset for `device` (None on CPU or an unknown kind)."""
  name = chip_name(device)
  return None if name is None else costmodel.get_chip(name)


def _version(pkg: str) -> Optional[str]:
  try:
    return importlib.metadata.version(pkg)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment() -> dict:
  """Device, driver, versions, XLA flags and the chip preset of the default device."""
  d = jax.devices()[0]
  env = {'date_utc': time.strftime('%Y-%m-%d %H:%M', time.gmtime()),
         'backend': jax.default_backend(), 'device_kind': d.device_kind,
         'device_count': jax.device_count(), 'python': sys.version.split()[0],
         'platform': platform.platform(), 'cpu_count': os.cpu_count(),
         'versions': {p: _version(p) for p in ('jax', 'jaxlib', 'flax', 'numpy', 'torch',
                                               'transformers', 'jax-cuda12-plugin',
                                               'jax-cuda13-plugin', 'libtpu')},
         'xla_flags': os.environ.get('XLA_FLAGS', '')}
  stats = device_memory(d)
  if stats:
    env['device_memory_limit'] = stats['limit']
  if d.platform == 'gpu':
    try:
      env['nvidia_smi'] = subprocess.run(
          ['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm',
           '--format=csv,noheader'], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
      env['nvidia_smi'] = f'unavailable: {e}'
  chip = chip_for(d)
  env['chip'] = None if chip is None else {'name': chip.name, 'hbm_bw': chip.hbm_bw}
  return env
