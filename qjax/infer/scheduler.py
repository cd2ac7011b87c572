"""Continuous batching: which sequences run in a step, with how many tokens (host side).

Every step each running sequence feeds its next tokens: a decoding one its last sampled
token, a prefilling one the next chunk of at most `chunk_size` prompt tokens (chunked
prefill: a long prompt takes several steps, and decodes run in each of them). Waiting
requests join when a row is free and the pool has the pages of their first chunk
(admission by free pages, first come first served); finished ones leave at once.

Priority is arrival order (vLLM's FCFS policy), and it is what makes progress certain. When a
running sequence needs a page and none is free, the latest-arrived sequence younger than it
is preempted; with none younger, it preempts itself. A waiting request older than some
running ones (it was preempted earlier) takes their row or pages back the same way; other
waiting requests are not admitted in a step that preempted (as in vLLM: they would take the
pages just freed, or readmit what was just preempted). So the oldest unfinished request is
never preempted, is running after every `schedule()` and feeds at least one token each step
(it is grown first and gets the prefill budget first): every request that fits the pool
alone finishes, and a workload finishes within sum(len(prompt) + max_tokens) steps (by
admission order instead, two requests could evict each other forever under recompute).

A preempted sequence waits again, in arrival order, with its prompt and output so far. With
`preemption='recompute'` (vLLM's default) it recomputes them when readmitted; with 'swap'
the pages holding its cached positions are copied to host memory (`swap_out`) and written
back into fresh pages when it is readmitted (`swap_in`). Either way its output is unchanged.

A request that could never run (prompt + max tokens past the context, or more pages than
the whole pool) is refused when it is added, with the numbers and the fix.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import numpy as np

from qjax.infer.engine_booking import book
from qjax.infer.engine_config import PREEMPTION_MODES
from qjax.infer.engine_state import SequenceState, StepPlan
from qjax.infer.page_host import PageAllocator
from qjax.infer.prefix_cache import PrefixCache


class Scheduler:
  """FCFS continuous batching over `max_batch` rows with paged memory.

  With `preemption='swap'`, `swap_out(seq) -> handle` copies the pages holding `seq`'s first
  `num_cached` positions (`seq.pages[:pages_for(num_cached)]`, and its ring) to the host
  before they are freed, and `swap_in(seq, handle)` writes them into `seq.pages` /
  `seq.ring_pages` (fresh pages) when it is readmitted.
  """

  def __init__(self, *, max_batch: int, chunk_size: int, page_size: int, max_pages: int,
               max_len: int, allocator: PageAllocator,
               ring_allocator: Optional[PageAllocator] = None, ring_pages: int = 0,
               prefix_cache: Optional[PrefixCache] = None, preemption: str = 'recompute',
               swap_out: Optional[Callable[[SequenceState], Any]] = None,
               swap_in: Optional[Callable[[SequenceState, Any], None]] = None,
               prefill_budget: Optional[int] = None):
    if preemption not in PREEMPTION_MODES:
      raise ValueError(f'Scheduler: preemption={preemption!r} is unknown; use one of '
                       f'{PREEMPTION_MODES}.')
    if preemption == 'swap' and (swap_out is None or swap_in is None):
      raise ValueError("Scheduler: preemption='swap' needs swap_out= and swap_in= (the "
                       'copies between device pages and host memory).')
    self.preemption, self.swap_out, self.swap_in = preemption, swap_out, swap_in
    self.swaps_out = self.swaps_in = 0
    self.max_batch, self.chunk_size, self.page_size = max_batch, chunk_size, page_size
    self.prefill_budget = prefill_budget
    self.max_pages, self.max_len = max_pages, max_len
    self.allocator, self.ring_allocator, self.ring_pages = allocator, ring_allocator, ring_pages
    self.prefix_cache = prefix_cache
    self.waiting: collections.deque[SequenceState] = collections.deque()
    self.running: list[SequenceState] = []  # in arrival order
    self.preemptions = 0
    self._arrivals = 0

  # ---- requests ----------------------------------------------------------------------------
  def add(self, seq: SequenceState) -> None:
    """Queue `seq`; raises if it could never fit the context or the pool."""
    self.check(seq)
    seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
    self.waiting.append(seq)

  def check(self, seq: SequenceState) -> None:
    """Raise if `seq` could never fit the context or the pool (queues nothing)."""
    total = len(seq.prompt) + seq.max_tokens
    if total > self.max_len:
      raise ValueError(f'request {seq.id}: prompt of {len(seq.prompt)} tokens + max_tokens='
                       f'{seq.max_tokens} = {total} exceeds the context of {self.max_len} '
                       'tokens; shorten the prompt or lower max_tokens.')
    # The last sampled token is never fed, so total - 1 positions are ever cached.
    pages = self.pages_for(total - 1)
    limit = min(self.max_pages, self.allocator.num_pages - 1)
    if pages > limit:
      raise ValueError(f'request {seq.id}: {total} tokens need {pages} pages of '
                       f'{self.page_size}, but a sequence can hold at most {limit} (pool of '
                       f'{self.allocator.num_pages - 1} pages, {self.max_pages} per block '
                       'table); build a larger pool or lower max_tokens.')
    if self.ring_pages and self.ring_allocator.num_pages - 1 < self.ring_pages:
      raise ValueError(f'request {seq.id}: a ring of {self.ring_pages} pages does not fit the '
                       f'ring pool of {self.ring_allocator.num_pages - 1}; build a larger one.')

  def pages_for(self, positions: int) -> int:
    return -(-positions // self.page_size)

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  # ---- memory ------------------------------------------------------------------------------
  def _take(self, n: int) -> Optional[list[int]]:
    """`n` pages, evicting cached prefixes if needed; None if the pool cannot give them."""
    if self.allocator.num_free < n and self.prefix_cache is not None:
      self.prefix_cache.evict(n - self.allocator.num_free)
    if self.allocator.num_free < n:
      return None
    return self.allocator.alloc(n)

  def release(self, seq: SequenceState) -> None:
    """Free `seq`'s pages and row (finished or preempted)."""
    if seq.pages:
      self.allocator.free(seq.pages)
    if seq.ring_pages:
      self.ring_allocator.free(seq.ring_pages)
    seq.pages, seq.ring_pages, seq.row = [], [], None
    if seq in self.running:
      self.running.remove(seq)

  def _preempt(self, seq: SequenceState) -> None:
    if self.preemption == 'swap':
      seq.swapped = self.swap_out(seq)  # before release: the pages still hold its positions
      self.swaps_out += 1
      self.release(seq)
    else:
      self.release(seq)
      seq.num_cached = 0  # recompute prompt + output on readmission
      seq.prefix_hit_tokens = 0
    _insert_by_arrival(self.waiting, seq)
    self.preemptions += 1

  def _younger(self, seq: SequenceState) -> list[SequenceState]:
    """Running sequences that arrived after `seq` (the ones it may preempt), oldest first."""
    return [s for s in self.running if s.arrival > seq.arrival]

  def _grow(self, seq: SequenceState, n: int, preempt_self: bool) -> bool:
    """Give running `seq` the pages for `n` more positions, preempting younger sequences
    (latest-arrived first) if needed. Without them: False, after preempting `seq` itself
    when `preempt_self`."""
    need = self.pages_for(seq.num_cached + n) - len(seq.pages)
    while need > 0:
      pages = self._take(need)
      if pages is not None:
        seq.pages += pages
        return True
      younger = self._younger(seq)
      if younger:
        self._preempt(younger[-1])
        continue
      if preempt_self:
        self._preempt(seq)
      return False
    return True

  def reserve(self, seq: SequenceState, n: int) -> bool:
    """Pages for `n` more positions of running `seq` (speculative rounds write gamma + 1),
    preempting younger sequences if needed; False (and `seq` kept, unchanged) if it is not
    running or the pool cannot give them."""
    return seq in self.running and self._grow(seq, n, preempt_self=False)

  def reserve_all(self, steps: int) -> bool:
    """Pages for up to `steps` more decode positions of every running sequence (at most what
    its max_tokens leave), all or none: False, taking nothing, when the pool (after evicting
    cached prefixes) cannot give them all; nothing is preempted for them."""
    need = {id(seq): self.pages_for(seq.num_cached + min(steps, seq.max_tokens -
                                                         len(seq.output))) - len(seq.pages)
            for seq in self.running}
    total = sum(max(n, 0) for n in need.values())
    if total == 0:
      return True
    pages = self._take(total)
    if pages is None:
      return False
    for seq in self.running:
      n = max(need[id(seq)], 0)
      seq.pages += pages[:n]
      pages = pages[n:]
    return True

  def _room(self, n: int) -> Optional[tuple[list[int], list[int]]]:
    """`n` pages and a ring (ring layers), or None (nothing taken) if the pools lack them."""
    ring = []
    if self.ring_pages:
      if self.ring_allocator.num_free < self.ring_pages:
        return None
      ring = self.ring_allocator.alloc(self.ring_pages)
    pages = self._take(n)
    if pages is None and ring:
      self.ring_allocator.free(ring)
    return None if pages is None else (pages, ring)

  def _admit(self, seq: SequenceState, row: int) -> bool:
    """Give waiting `seq` row `row` and the pages of its next chunk (after its cached prefix
    or, swapped out, its cached positions); False, `seq` unchanged, if they are not free."""
    hit = []
    if seq.swapped is None and self.prefix_cache is not None and not seq.output:
      # Leave the prompt's last token to compute: its logits give the first output token.
      hit = self.prefix_cache.match(seq.prompt, (len(seq.prompt) - 1) // self.page_size)
    cached = seq.num_cached if seq.swapped is not None else len(hit) * self.page_size
    n = min(self.chunk_size, len(seq.tokens) - cached)
    room = self._room(self.pages_for(cached + n) - len(hit))
    if room is None:
      if hit:
        self.allocator.free(hit)
      return False
    seq.pages, seq.ring_pages, seq.row = hit + room[0], room[1], row
    if seq.swapped is not None:  # resume where it stopped
      self.swap_in(seq, seq.swapped)
      seq.swapped = None
      self.swaps_in += 1
    else:
      seq.num_cached = seq.prefix_hit_tokens = cached
    _insert_by_arrival(self.running, seq)
    return True

  # ---- steps -------------------------------------------------------------------------------
  def _feeds(self) -> dict[int, int]:
    """Tokens each running sequence feeds this step (by id(seq)): a decode its 1, a
    prefilling one a chunk, within `prefill_budget` prompt tokens over all of them in
    arrival order (those past it feed nothing this step and keep their row)."""
    budget = self.prefill_budget
    feeds = {}
    for seq in self.running:
      n = min(self.chunk_size, seq.num_pending)
      if seq.num_pending > 1 and budget is not None:  # prefilling (or recomputing)
        n = min(n, budget)
        budget -= n
      feeds[id(seq)] = n
    return feeds

  def schedule(self) -> StepPlan:
    """The next step: running sequences first (in arrival order), then admissions."""
    feeds, before = self._feeds(), self.preemptions
    for seq in list(self.running):
      if seq in self.running and feeds[id(seq)] and not self._grow(seq, feeds[id(seq)], True):
        if not any(s.arrival < seq.arrival for s in self.running):  # it ran alone
          raise RuntimeError(f'request {seq.id}: the pool cannot hold it even alone (checked '
                             'at add); this is a scheduler bug.')
    while self.waiting:
      head = self.waiting[0]
      younger = self._younger(head)
      if self.preemptions > before and not younger:
        break  # as vLLM: no plain admission in a step that preempted (it would readmit them)
      used = {s.row for s in self.running}
      free_rows = [r for r in range(self.max_batch) if r not in used]
      if free_rows and self._admit(head, free_rows[0]):
        self.waiting.popleft()
        continue
      if not younger:
        break  # FCFS: later requests wait behind the head
      self._preempt(younger[-1])  # an older request takes its row or pages back
    rows: list[Optional[SequenceState]] = [None] * self.max_batch
    num_new = [0] * self.max_batch
    feeds = self._feeds()  # admissions and preemptions above changed who runs
    for seq in self.running:
      rows[seq.row] = seq
      # A preemption above can free budget for a sequence that was not grown: it feeds what
      # its pages hold (decodes and the first prefilling sequence were grown, so progress).
      num_new[seq.row] = min(feeds[id(seq)], len(seq.pages) * self.page_size - seq.num_cached)
    return StepPlan(rows, num_new)

  def fail(self, seq: SequenceState) -> None:
    """End running `seq` with finish reason 'error': its logits were not finite."""
    seq.finished, seq.finish_reason = True, 'error'
    seq.error = (f'request {seq.id}: the logits for output token {len(seq.output)} are not '
                 'finite (NaN or inf), so no token was chosen; check the weights for NaN/inf '
                 'or compute in float32.')
    self.release(seq)

  def cancel(self, seq: SequenceState) -> None:
    """End `seq` (waiting, swapped out or running) with finish reason 'cancelled', freeing
    its row and pages."""
    if seq in self.waiting:
      self.waiting.remove(seq)
    self.release(seq)
    seq.swapped = None
    seq.finished, seq.finish_reason = True, 'cancelled'

  def complete(self, plan: StepPlan, tokens: list[int], finished) -> list[tuple[str, int]]:
    """`engine_booking.book` of a step's token per row (`finished(seq) -> bool` after a token
    is appended); returns (request id, token) of every token generated this step."""
    return book(self, plan.rows, plan.num_new, np.asarray(tokens).reshape(-1, 1),
                [int(s is not None) for s in plan.rows], finished)[0]


def _insert_by_arrival(queue, seq: SequenceState) -> None:
  """Insert `seq` into `queue` (a list or deque kept in arrival order) at its place."""
  at = next((i for i, s in enumerate(queue) if s.arrival > seq.arrival), len(queue))
  queue.insert(at, seq)
