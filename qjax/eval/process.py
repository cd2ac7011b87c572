"""This process's memory: resident set size (now, peak, peak since a reset), the accelerator's
own memory where the backend keeps statistics (`device_memory`), and the memory-map table
that live XLA:CPU executables fill (`release_executables`).

On a GPU or TPU the host RSS says nothing about what the model costs: weights, caches and
activations live in device memory. Reports read `device_memory()` there (None on CPU).

Kept apart from `qjax.eval.memory` (the planner, which needs the model) so that light modules
(the sweep runner, the test session) can guard a long process without importing the model.
"""

from __future__ import annotations

import gc
import resource
import sys
from typing import Optional

import jax


def _proc_status_kib(key: str) -> Optional[int]:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(key + ':'):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def peak_rss_bytes(since_reset: bool = False) -> int:
  """The process' peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS); with
  `since_reset`, the peak since `reset_peak_rss` (Linux VmHWM)."""
  if since_reset:
    hwm = _proc_status_kib('VmHWM')
    if hwm is not None:
      return hwm * 1024
  r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(r if sys.platform == 'darwin' else r * 1024)


def current_rss_bytes() -> int:
  """The process' resident set size now (Linux VmRSS; the peak elsewhere)."""
  rss = _proc_status_kib('VmRSS')
  return rss * 1024 if rss is not None else peak_rss_bytes()


def reset_peak_rss() -> bool:
  """Reset the peak RSS that `peak_rss_bytes(since_reset=True)` reads (Linux: '5' to
  /proc/self/clear_refs); False where unsupported."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def device_memory(device=None) -> Optional[dict]:
  """The accelerator's memory statistics, bytes: {'in_use', 'peak', 'limit'}.

  Args:
    device: a jax device (default: the first device of the default backend).

  Returns:
    None where the backend keeps none (XLA:CPU). 'peak' is the most in use since the process
    started: jax offers no reset, so a report of several phases gives the running peak.
  """
  device = jax.devices()[0] if device is None else device
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  (backends without the call raise)
    return None
  if not stats or 'bytes_in_use' not in stats:
    return None
  return {'in_use': int(stats['bytes_in_use']),
          'peak': int(stats.get('peak_bytes_in_use', stats['bytes_in_use'])),
          'limit': int(stats['bytes_limit']) if 'bytes_limit' in stats else None}


def _map_limit() -> Optional[int]:
  try:
    with open('/proc/sys/vm/max_map_count', encoding='ascii') as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def map_count() -> Optional[int]:
  """Entries in this process's memory-map table (Linux /proc/self/maps), else None."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      return f.read().count(b'\n')
  except OSError:
    return None


def release_executables(fraction: float = 0.75) -> bool:
  """Drop jax's caches when the memory-map table is past `fraction` of vm.max_map_count.

  Each live compiled XLA:CPU executable holds ~9 map entries (its JIT code and data), and jax
  keeps every executable it compiled alive. A long process that compiles many distinct
  programs (a test session, a sweep compiling one draft round per point) reaches the
  kernel's limit (65530 by default) after ~1,800-7,000 executables; the next mmap fails
  ("LLVM compilation error: Cannot allocate memory") and jaxlib segfaults unwinding that
  error (docs/py312_crash.md; the Gemma speculative sweep died so after 114 points). Past
  the threshold this clears jax's caches (the executables go, their maps with them; later
  calls compile again) and returns True; below it, one read of /proc/self/maps. Linux only
  (elsewhere: False).
  """
  limit, count = _map_limit(), map_count()
  if not limit or count is None or count <= limit * fraction:
    return False
  jax.clear_caches()
  gc.collect()
  return True
