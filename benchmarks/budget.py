"""A time budget for a benchmark's rows: the next row starts only if one as long as the
longest so far still ends within it, so a run ends near its budget, not one row past it."""

from __future__ import annotations

import time


class Budget:
  """`fits()` before a row, `ran(since)` after it; `seconds` from construction.

      budget = Budget(340)
      for i, row in enumerate(todo):
        if not budget.fits():
          not_run = todo[i:]
          break
        t0 = time.perf_counter(); run(row); budget.ran(t0)
  """

  def __init__(self, seconds: float):
    self.seconds, self.start, self.longest = seconds, time.perf_counter(), 0.0

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def fits(self, until: float | None = None) -> bool:
    """Whether a row as long as the longest so far ends by `until` (default the budget)."""
    return self.elapsed() + self.longest < (self.seconds if until is None else until)

  def ran(self, since: float) -> None:
    """Record a row that started at `since` (a `time.perf_counter()` reading)."""
    self.longest = max(self.longest, time.perf_counter() - since)
