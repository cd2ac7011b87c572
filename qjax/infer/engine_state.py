"""A request's state as the engine keeps it (`SequenceState`), and a step's plan (`StepPlan`).

The scheduler moves a sequence between waiting and running and gives it pages; the booking
(`engine_booking`) appends its tokens and ends it; the request side reads its outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class SequenceState:
  """One request's state.

  Attributes:
    id: the request id.
    prompt: prompt token ids.
    max_tokens: tokens to generate.
    params: the request's sampling parameters (opaque here).
    output: tokens generated so far.
    num_cached: positions whose K/V are in the cache.
    pages: page-table pages (logical order); ring_pages: its ring (ring layers).
    row: the batch row it runs in, or None while waiting.
    prefix_hit_tokens: prompt positions taken from the prefix cache at admission.
    swapped: the host copy of its cached pages while it waits swapped out, else None.
    arrival: its place in arrival order (set by `Scheduler.add`): the priority.
    finish_reason: 'stop', 'length', 'error' or 'cancelled' once finished, else None.
    error: why it ended with 'error' (non-finite logits), else None.
    page_hashes: the prefix cache's chain hashes of its prompt's full pages computed so far
      (each page is hashed once, not once per chunk).
  """

  id: str
  prompt: list[int]
  max_tokens: int
  params: Any = None
  output: list[int] = dataclasses.field(default_factory=list)
  num_cached: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  ring_pages: list[int] = dataclasses.field(default_factory=list)
  row: Optional[int] = None
  prefix_hit_tokens: int = 0
  finished: bool = False
  logprobs: list[float] = dataclasses.field(default_factory=list)
  swapped: Any = None
  arrival: int = -1
  finish_reason: Optional[str] = None
  error: Optional[str] = None
  page_hashes: list = dataclasses.field(default_factory=list)  # prefix cache, full pages

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def num_pending(self) -> int:
    """Tokens known but not yet in the cache (the prompt rest, or the last sampled token)."""
    return len(self.tokens) - self.num_cached


@dataclasses.dataclass
class StepPlan:
  """What one step computes: per row, the sequence and its number of new tokens."""
  rows: list[Optional[SequenceState]]
  num_new: list[int]
