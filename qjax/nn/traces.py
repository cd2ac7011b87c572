"""How many times each jitted step was traced (= compiled) in this process, by step name.

The Python body of a jitted function runs once per trace, so a `traced(name)` call there
counts the compilations of that step wherever it lives (the generate steps, the engine's step
and decode block, the speculative engine's draft feed and rounds). The counts are
process-wide mutable state on purpose: a compilation is process-wide too (jax's caches are).
"""

from __future__ import annotations

import collections

_COUNTS: collections.Counter = collections.Counter()


def traced(name: str) -> None:
  """Count one trace of the step `name` (call it inside the jitted function's body)."""
  _COUNTS[name] += 1


def count(*names: str) -> int:
  """Traces so far of the steps `names`, summed."""
  return sum(_COUNTS[n] for n in names)
