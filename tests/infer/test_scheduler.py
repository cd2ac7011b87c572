"""The scheduler alone (host side, no model): chunked prefill, admission, preemption."""

import pytest

from qjax.infer import PageAllocator, Scheduler, SequenceState


def _scheduler(num_pages=32, max_batch=2, chunk=8, **kw):
  return Scheduler(max_batch=max_batch, chunk_size=chunk, page_size=4, max_pages=16,
                   max_len=64, allocator=PageAllocator(num_pages), **kw)


def _run_step(s, token=7):
  plan = s.schedule()
  s.complete(plan, [token] * len(plan.rows), lambda seq: len(seq.output) >= seq.max_tokens)
  return plan


def test_a_long_prompt_is_chunked_and_does_not_stall_a_decode():
  s = _scheduler()
  short, long = SequenceState('a', [1, 2], 5), SequenceState('b', list(range(40)), 2)
  s.add(short)
  _run_step(s)  # a: prefilled, first token sampled
  s.add(long)
  fed = []
  while long.num_pending > 1 or not long.output:
    plan = _run_step(s)
    fed.append(tuple(sum(n for q, n in zip(plan.rows, plan.num_new) if q is seq)
                     for seq in (short, long)))
  # b's 40 prompt tokens take 5 steps of 8; a decodes one token in each until it finishes.
  assert [b for _, b in fed] == [8, 8, 8, 8, 8]
  assert [a for a, _ in fed] == [1, 1, 1, 1, 0]
  assert len(short.output) == 5 and len(long.output) == 1


def test_admission_waits_for_free_pages_then_preempts_the_latest():
  s = _scheduler(num_pages=7)  # 6 usable pages of 4
  first, second = SequenceState('a', list(range(8)), 12), SequenceState('b', list(range(8)), 12)
  s.add(first)
  s.add(second)
  plan = _run_step(s)
  assert plan.rows[0] is first and plan.rows[1] is second  # 2 + 2 pages
  while s.preemptions == 0:
    plan = _run_step(s)
  # Growing past 6 pages evicted the later request; as in vLLM, a step that preempts admits
  # nothing, so it is readmitted the step after, into the 2 pages left, and recomputes its
  # prompt and its output so far from position 0, a chunk at a time.
  assert second not in plan.rows and second.num_cached == 0
  plan = _run_step(s)
  assert second.num_cached == 8 and len(second.output) > 0
  assert plan.num_new[plan.rows.index(second)] == 8
  while s.has_work:
    _run_step(s)
  assert len(first.output) == len(second.output) == 12
  assert s.allocator.num_free == 6


def test_requests_that_can_never_fit_are_refused():
  s = _scheduler(num_pages=5)
  with pytest.raises(ValueError, match='request x: prompt of 60 tokens \\+ max_tokens=10 = 70 '
                                       'exceeds the context of 64'):
    s.add(SequenceState('x', [0] * 60, 10))
  with pytest.raises(ValueError, match='request y: 30 tokens need 8 pages of 4, but a sequence '
                                       'can hold at most 4'):
    s.add(SequenceState('y', [0] * 20, 10))
  assert not s.has_work


def test_swap_preemption_saves_the_cached_pages_and_resumes_without_recompute():
  saved, restored = [], []

  def swap_out(seq):
    saved.append((seq.id, list(seq.pages[:-(-seq.num_cached // 4)]), seq.num_cached))
    return 'host copy of ' + seq.id

  def swap_in(seq, handle):
    restored.append((seq.id, handle, list(seq.pages)))

  s = _scheduler(num_pages=7, preemption='swap', swap_out=swap_out, swap_in=swap_in)
  first, second = SequenceState('a', list(range(8)), 12), SequenceState('b', list(range(8)), 12)
  s.add(first)
  s.add(second)
  while s.preemptions == 0:
    _run_step(s)
  (sid, pages, cached), = saved
  assert sid == 'b' and cached == second.num_cached > 8 and len(pages) == -(-cached // 4)
  assert second.swapped == 'host copy of b' and second.row is None
  while s.has_work:
    plan = _run_step(s)
    if restored and second in plan.rows:
      # Resumed where it stopped: one token fed, not its prompt + output again.
      assert plan.num_new[plan.rows.index(second)] == 1
  assert [(r[0], r[1]) for r in restored] == [('b', 'host copy of b')]
  assert len(restored[0][2]) >= len(pages) and second.swapped is None
  assert len(first.output) == len(second.output) == 12 and s.allocator.num_free == 6
  with pytest.raises(ValueError, match="preemption='swap' needs swap_out= and swap_in="):
    _scheduler(preemption='swap')


def test_reserve_all_takes_pages_ahead_without_preempting():
  """Pages for K decode positions ahead (at most what max_tokens leaves); a pool that cannot
  give them all refuses, taking none and preempting nobody."""
  s = _scheduler(num_pages=6)  # 5 usable pages of 4
  a, b = SequenceState('a', [1, 2, 3], 6), SequenceState('b', [4, 5, 6], 15)
  s.add(a)
  s.add(b)
  _run_step(s)  # both prefilled (3 positions: one page each), one token each
  assert s.reserve_all(4)  # a: 3 + min(4, 5) = 7 positions, 2 pages; b: 7, 2 pages
  assert (len(a.pages), len(b.pages)) == (2, 2)
  assert s.reserve_all(5)  # a: 3 + min(5, 5) = 8, still 2 pages; b: 8, 2 pages
  assert s.allocator.num_free == 1
  assert not s.reserve_all(13)  # b would need 3 + 13 = 16 positions: 2 more pages, 1 free
  assert s.preemptions == 0 and s.running == [a, b]
  assert len(b.pages) == 2 and s.allocator.num_free == 1
