"""A benchmark's compilations: a persistent cache that keeps every executable, and a count of
what XLA compiled while a piece of the run was timed or prepared.

    with compile_cache.persistent('results/compile_cache'):   # a second run loads, not compiles
      with compile_cache.Counter() as compiled:
        run_row()
      compiled.compiles, compiled.cache_hits

The cache stays off where jax's own switch is off (`JAX_ENABLE_COMPILATION_CACHE=false`: the
test suite sets it under jaxlib 0.12, whose executable serialization crashed a test worker).
jax keeps its persistent cache settings process-wide and decides once per process whether the
cache is used (on the first compile), so `persistent` resets that decision on entry and puts
the previous settings back on exit: a test that runs a benchmark leaves the process as it was.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

import jax
from jax.experimental.compilation_cache import compilation_cache

# Every executable is written, however small or fast to compile (jax's defaults skip those
# compiled in under a second, which are most of a small check's).
_SETTINGS = {'jax_persistent_cache_min_compile_time_secs': 0.0,
             'jax_persistent_cache_min_entry_size_bytes': -1}
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # a compile, or a cache load
_HIT_EVENT = '/jax/compilation_cache/cache_hits'


@contextlib.contextmanager
def persistent(path: Optional[str]):
  """Compile with jax's persistent compilation cache in `path` (None or '': no cache; nor
  where `jax_enable_compilation_cache` is off, e.g. JAX_ENABLE_COMPILATION_CACHE=false).

  Yields:
    The cache folder's absolute path, or None.
  """
  if not path or not jax.config.jax_enable_compilation_cache:
    yield None
    return
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  names = ('jax_compilation_cache_dir', *_SETTINGS)
  before = {n: getattr(jax.config, n) for n in names}
  jax.config.update('jax_compilation_cache_dir', path)
  for name, value in _SETTINGS.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()  # jax decided at its first compile whether to use a cache
  try:
    yield path
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


class Counter:
  """Counts, while entered, the executables XLA compiled (`compiles`) and those loaded from
  the persistent cache (`cache_hits`); one served from jax's in-memory caches is neither.
  Compiles in other threads count too (the row's parallel warm-up)."""

  def __init__(self):
    self.requests = 0
    self.cache_hits = 0
    self._lock = threading.Lock()

  @property
  def compiles(self) -> int:
    return self.requests - self.cache_hits

  def _duration(self, event: str, _secs: float, **_kw) -> None:
    if event == _COMPILE_EVENT:
      with self._lock:
        self.requests += 1

  def _event(self, event: str, **_kw) -> None:
    if event == _HIT_EVENT:
      with self._lock:
        self.cache_hits += 1

  def __enter__(self) -> 'Counter':
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)
