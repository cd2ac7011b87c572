"""This process's memory: the map-table guard that long processes call."""

import jax
import jax.numpy as jnp

from qjax.eval import process


def test_release_executables_drops_jax_caches_only_past_the_threshold():
  compiles = []
  def listener(event, duration, **_):
    del duration
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  # With the suite's persistent compilation cache a dropped executable is read back, not
  # compiled: that counts as a miss of the in-memory cache too.
  jax.monitoring.register_event_listener(
      lambda event, **_: compiles.append(event)
      if event == '/jax/compilation_cache/cache_hits' else None)
  f = jax.jit(lambda x: x * 3 + 1)
  x = jnp.ones(7)
  f(x)
  n = len(compiles)
  assert process.map_count() > 0
  assert not process.release_executables(1.0)   # never past the whole limit: nothing dropped
  f(x)
  assert len(compiles) == n                     # still cached
  assert process.release_executables(0.0)       # always past 0: the executable is gone
  f(x)
  assert len(compiles) > n                      # compiled (or read from disk) again
