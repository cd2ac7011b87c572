"""Booking a dispatch's results onto its requests, the same way for every kind of dispatch.

A dispatch (a plain step, a block of U decode steps, a few speculative rounds) returns, for each
engine row b, `num_B[b]` results in step order: result i of row b fed `fed_B[b]` tokens and,
once the row's whole sequence is cached, drew the token `tok_BW[b, i]`. `Booking.book` walks
them column by column (the order single steps would have produced them): it advances the
positions cached, inserts a prompt's new full pages into the prefix cache, counts prompt and
decode tokens and the cache slots held, and for each drawn token ends the request with
'error' (`NON_FINITE`), or appends it (and its log-probability, on request) and ends the
request at a stop token, stop string or its max_tokens, releasing its row and pages.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from qjax.infer.engine_config import EngineStats
from qjax.infer.sampling import finish_reason


def book(scheduler, rows: Sequence, fed_B, tok_BW, num_B, finished: Callable, *,
         lp_BW=None, count: Optional[Callable] = None) -> tuple[list[tuple[str, int]], int]:
  """Book one dispatch's results (module docstring) onto its requests.

  Args:
    scheduler: the `Scheduler` (its `fail`, `release` and `prefix_cache`).
    rows: the dispatch's `SequenceState` (or None) per engine row.
    fed_B: tokens each result of a row fed (a plain step: the row's; otherwise 1).
    tok_BW: the token drawn at each result (read where the sequence is whole); `NON_FINITE`
      (-1) where the row's logits were not finite: that request ends with 'error'.
    num_B: results per row.
    finished: `finished(seq) -> bool` after a token is appended (sets its finish reason).
    lp_BW: log-probabilities of the drawn tokens, or None (none recorded).
    count: `count(seq, n)` before `n` more positions of `seq` are cached (the counters).

  Returns:
    (request id, token) of the tokens generated, in step order, and the result columns.
  """
  events, cols = [], int(np.max(num_B, initial=0))
  for i in range(cols):
    for row, seq in enumerate(rows):
      # A request the dispatch ended (or a row it never ran) has left its row.
      if seq is None or i >= num_B[row] or seq.row != row:
        continue
      n = int(fed_B[row])
      if count is not None:
        count(seq, n)
      seq.num_cached += n
      if scheduler.prefix_cache is not None and not seq.output:
        done = min(seq.num_cached, len(seq.prompt))
        seq.page_hashes = scheduler.prefix_cache.insert(seq.prompt[:done], seq.pages,
                                                        seq.page_hashes)
      if seq.num_pending:  # still prefilling: this row drew nothing
        continue
      tok = int(tok_BW[row, i])
      if tok < 0:  # NON_FINITE: no token to give
        scheduler.fail(seq)
        continue
      seq.output.append(tok)
      events.append((seq.id, tok))
      if lp_BW is not None and seq.params.logprobs:
        seq.logprobs.append(float(lp_BW[row, i]))
      if finished(seq):
        seq.finished = True
        scheduler.release(seq)
  return events, cols


class Booking:
  """`book` with the engine's stop check and counters.

  Args:
    scheduler: releases finished requests' rows and pages, and fails broken ones.
    stats: the counters to add to.
    tokenizer: decodes outputs for stop strings (optional).
    page_size, max_len: the cache geometry, for the slot counters.
    ring_layers: per layer, whether it keeps a ring of `ring_span` positions per row.
  """

  def __init__(self, scheduler, stats: EngineStats, tokenizer, *, page_size: int,
               max_len: int, ring_layers: Sequence[bool], ring_span: int):
    self.scheduler, self.stats, self.tokenizer = scheduler, stats, tokenizer
    self.page_size, self.max_len, self.ring_span = page_size, max_len, ring_span
    self.num_ring = sum(ring_layers)
    self.num_full = len(ring_layers) - self.num_ring

  def finished(self, seq) -> bool:
    """Whether `seq` ends after its last token; sets its finish reason."""
    text = None
    if seq.params.stop_strings and self.tokenizer is not None:
      text = self.tokenizer.decode(seq.output)
    seq.finish_reason = finish_reason(seq.params, seq.output, text)
    return seq.finish_reason is not None

  def book(self, rows, fed_B, tok_BW, num_B, lp_BW=None,
           steps: Optional[int] = None) -> list[tuple[str, int]]:
    """`book` with this engine's stop check and counters; `steps`: the steps the dispatch
    ran (default: one per result column)."""
    events, cols = book(self.scheduler, rows, fed_B, tok_BW, num_B, self.finished,
                        lp_BW=lp_BW, count=self._count)
    st, sched = self.stats, self.scheduler
    st.steps += cols if steps is None else steps
    st.preemptions, st.swaps_out, st.swaps_in = (sched.preemptions, sched.swaps_out,
                                                 sched.swaps_in)
    if sched.prefix_cache is not None:
      st.prefix_hit_tokens = sched.prefix_cache.hits * self.page_size
    return events

  def _count(self, seq, n: int) -> None:
    """Prompt or decode tokens fed, and the cache slots held once `n` more positions of
    `seq` are cached (ring layers hold at most their ring)."""
    st, p = self.stats, self.page_size
    if seq.num_pending > 1 or not seq.output:
      st.prefill_tokens += n
    else:
      st.decode_tokens += n
    held = seq.num_cached + n
    st.used_slots += self.num_full * held + self.num_ring * min(held, self.ring_span)
    st.allocated_slots += (self.num_full * len(seq.pages) +
                           self.num_ring * len(seq.ring_pages)) * p
    st.contiguous_slots += (self.num_full + self.num_ring) * self.max_len
