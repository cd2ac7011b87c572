"""The engine's default decode policy: U steps per dispatch with the rows' state on the device.

When every running sequence decodes (no prompt chunk to feed, no stop string to check on
the host, no repetition penalty), `Engine` runs up to U = `EngineConfig.decode_block` decode
steps in one dispatch (`engine_programs.decode_block`, a step on the library's one decode loop,
`qjax.nn.decode_core.run_block`): each step feeds every live row's last token through the
paged cache (the unpacked (B, 1) layout: row b's token is row b), samples
(`qjax.infer.sampling.sample`, or the argmax when every row is greedy), and the loop ends a
row at a stop token, at its max_tokens or at a non-finite logit, all on the device. The host
reads the U tokens of every row once per block. With requests waiting for a row or pages,
the block also ends as soon as a row finishes, so admission is no later than step by step.

What the rows need on the device (block and ring tables, lengths, last tokens, output
positions, limits, stop tokens, sampling parameters) is kept there between dispatches by
`Resident`: the host rebuilds each array from its bookkeeping (cheap numpy) and sends it
only when its value differs from the one the device holds; in steady decode only a block
table that gained a page changes. A block needs pages for its U positions ahead
(`Scheduler.reserve_all`); where the pool cannot give them without preempting, the engine
runs one step instead.

Readback overlaps the device: when no request waits and the pool gives the pages for two
blocks ahead, the next block is dispatched on the device's outputs of the current one before
the host reads the current one's tokens (the next `Engine.step` reads it). The device then
runs block after block while the host books tokens; a request added meanwhile is admitted
after the queued block.

A request that arrives while a row is free would join at the next step without blocks, so
with a free row a dispatch holds the engine at most `EngineConfig.admit_within_s` (U steps,
or 2U with one queued, times the step time estimated from the decode dispatches timed so
far); past it the engine runs single steps. U is one of two compiled sizes (U or 1), so the
bound compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer import engine_inputs
from qjax.infer.engine_programs import BLOCK as STEP
from qjax.infer.engine_programs import decode_block
from qjax.nn.decode_core import LoopState

__all__ = ['BlockDecoding', 'STEP', 'decode_block']


def _inputs(rows, max_pages: int, ring_width: int) -> engine_inputs.StepInputs:
  """A block's inputs: one token fed per row that holds a sequence."""
  return engine_inputs.build(rows, [int(s is not None) for s in rows], max_pages=max_pages,
                             ring_width=ring_width)


class BlockDecoding:
  """Decode blocks for a `Runner` (module docstring).

  Args:
    runner: the engine's `engine_runner.Runner` (its cache, dispatch, scheduler, booking).
    decode_block: U, the most decode steps one dispatch runs.
    admit_within_s: `EngineConfig.admit_within_s`.
    max_batch: the engine's rows.
  """

  def __init__(self, runner, *, decode_block: int, admit_within_s, max_batch: int):
    self.runner, self.k, self.admit_within_s = runner, decode_block, admit_within_s
    self.max_batch = max_batch
    self.programs = (STEP,)
    self.queued = None  # a block dispatched behind the last one, not yet read
    self.step_s = None  # estimated seconds per decode step (`may_hold`)
    self.fetched_at = 0.0  # when the last block's tokens were read

  def check(self, seq) -> None:
    """Requests this policy cannot run: none."""

  def feed(self, x) -> None:
    """A plain step's inputs (nothing to mirror here)."""

  def run(self, plan) -> list[tuple[str, int]]:
    """A block of `plan`'s rows when `steps` allows one, else one plain step."""
    t0 = time.perf_counter()
    k = self.steps(plan)
    self.runner.stats.host_s += time.perf_counter() - t0
    return self._block(plan, k) if k > 1 else self.runner.plain(plan)

  def steps(self, plan) -> int:
    """Decode steps the next dispatch may run as a block (1: a single step): every running
    sequence decodes, none needs the host per token, and the pages for U steps are there."""
    k = self.k
    if k == 1 or not any(s is not None for s in plan.rows):
      return 1
    for seq, n in zip(plan.rows, plan.num_new):
      if seq is None:
        continue
      prm = seq.params
      if (n != 1 or seq.num_pending != 1 or not seq.output or prm.stop_strings
          or prm.repetition_penalty != 1):
        return 1
    if not self.may_hold(k) or not self.runner.scheduler.reserve_all(k):
      return 1
    return k

  def may_hold(self, steps: int) -> bool:
    """Whether one dispatch may hold the engine for `steps` decode steps: always while every
    row is busy or a request waits (a finish then ends the block); with a free row, only
    within `EngineConfig.admit_within_s` of the estimated step time."""
    sched, bound = self.runner.scheduler, self.admit_within_s
    if bound is None or sched.waiting or len(sched.running) >= self.max_batch:
      return True
    return self.step_s is not None and steps * self.step_s <= bound

  def timed(self, started: float, steps: int) -> None:
    """Fold a decode dispatch's wall time (dispatch to tokens read) into the step estimate."""
    if steps:
      s = (time.perf_counter() - started) / steps
      self.step_s = s if self.step_s is None else 0.5 * (self.step_s + s)

  def _check(self, rows, steps: int) -> None:
    r = self.runner
    engine_inputs.check(rows, [0 if s is None else min(steps, s.max_tokens - len(s.output))
                               for s in rows], r.page_size, r.max_len)

  def _block(self, plan, k: int) -> list[tuple[str, int]]:
    """Up to `k` decode steps of every running row in one dispatch (`decode_block`)."""
    t0, r = time.perf_counter(), self.runner
    rows, res, st = plan.rows, r.resident, r.stats
    x = _inputs(rows, r.max_pages, r.ring_width)
    self._check(rows, k)
    sent0, kept0 = res.sent, res.kept
    cache = dataclasses.replace(
        r.cache, page_table=res.put('table', x.table_BE),
        ring_table=res.put('ring', x.ring_BE), length=res.put('length', x.length_B),
        num_new=res.put('num_new', np.zeros(len(rows), np.int32)), seq_of=None,
        slot_of=None, att_width=0, att_wide=0)
    loop = x.loop()
    names = dict(tok_B='tok', count_B='position', max_B='max', stop_BZ='stop', live_B='live')
    dev_rows = LoopState(**{f: res.put(name, loop[f]) for f, name in names.items()})
    params = r.sampling(x.params)
    stop_early = np.bool_(bool(r.scheduler.waiting))
    st.arrays_sent += res.sent - sent0
    st.arrays_kept += res.kept - kept0
    st.host_s += time.perf_counter() - t0
    compile_s, started = st.compile_s, time.perf_counter()
    out = r.dispatch(decode_block, r.graphdef, r.state, cache, dev_rows, params, k,
                     stop_early)
    r.cache = out[0]
    return self._finish(rows, x.table_BE, out, params, k, queue=not stop_early,
                        started=started if st.compile_s == compile_s else None)

  def _finish(self, rows, table, out, params, k: int, queue: bool, started=None):
    """Read the dispatched block `out` of `rows` (run with page table `table`) and book its
    tokens. First, with `queue` and no request waiting, when the pool gives the pages for
    two blocks ahead (and `may_hold` allows two blocks), the next block of the same rows is
    dispatched from the device's own outputs, so it runs while the host reads and books this
    one (the next step books it). `started`: when `out` began to run (its dispatch, or the
    read of the block it was queued behind), for the step estimate; None: not timed."""
    t0, r = time.perf_counter(), self.runner
    res, st, sched = r.resident, r.stats, r.scheduler
    _, new_rows, tok_BW, lp_BW, num_B = out
    res.hold('table', table, out[0].page_table)  # the table `out` ran with, now its output
    sent0, kept0 = res.sent, res.kept
    nxt = None
    live = [s if s is not None and s.row == i and not s.finished else None
            for i, s in enumerate(rows)]
    running = [s for s in live if s is not None]
    if (queue and running and not sched.waiting and len(running) == len(sched.running)
        and any(s.max_tokens - len(s.output) > k for s in running)  # not all done in `out`
        and self.may_hold(2 * k) and sched.reserve_all(2 * k)):
      self._check(live, 2 * k)
      next_table = _inputs(live, r.max_pages, r.ring_width).table_BE
      cache = dataclasses.replace(r.cache, page_table=res.put('table', next_table))
      st.host_s += time.perf_counter() - t0
      st.arrays_sent += res.sent - sent0
      st.arrays_kept += res.kept - kept0
      nxt = r.dispatch(decode_block, r.graphdef, r.state, cache, new_rows, params, k,
                       np.bool_(False))
      r.cache = nxt[0]
      t0 = time.perf_counter()
    st.host_s += time.perf_counter() - t0
    tok_BW, lp_BW, num_B = r.fetch((tok_BW, lp_BW, num_B))
    t0 = time.perf_counter()
    if started is not None:
      self.timed(started, int(np.max(num_B, initial=0)))
    self.fetched_at = t0  # a block queued behind this one starts on the device about now
    events = r.booking.book(rows, [1] * len(rows), tok_BW, num_B, lp_BW=lp_BW)
    if nxt is not None:
      self.queued = (rows, next_table, nxt, params, k)
    else:
      # What the device now holds, as the host would build it for the same rows: the next
      # block sends none of these unless the rows changed (tables and limits did not).
      after = _inputs([s if s is not None and s.row == i and not s.finished else None
                       for i, s in enumerate(rows)], r.max_pages, r.ring_width)
      new_rows = out[1]
      for name, host, dev in (
          ('table', table, r.cache.page_table), ('ring', after.ring_BE, r.cache.ring_table),
          ('length', after.length_B, r.cache.length),
          ('num_new', np.zeros(len(rows), np.int32), r.cache.num_new),
          ('tok', after.tok_B, new_rows.tok_B), ('position', after.position_B,
                                                 new_rows.count_B),
          ('live', after.live_B, new_rows.live_B)):
        res.hold(name, host, dev)
    st.host_s += time.perf_counter() - t0
    return events

  def drain(self, queue: bool = True) -> list[tuple[str, int]]:
    """Book the block `_finish` queued (and, with `queue`, maybe queue the one after it)."""
    rows, table, out, params, k = self.queued
    self.queued = None
    return self._finish(rows, table, out, params, k, queue=queue, started=self.fetched_at)

  def compile(self, params) -> None:
    """Compile the decode block on rows none of which is live (`Runner.compile_buckets`)."""
    if self.k == 1:
      return
    r = self.runner
    x = _inputs([None] * len(params.seed_B), r.max_pages, r.ring_width)
    rows = LoopState(**{f: jnp.asarray(v) for f, v in x.loop().items()})
    cache = dataclasses.replace(r.cache, page_table=jnp.asarray(x.table_BE),
                                ring_table=jnp.asarray(x.ring_BE),
                                length=jnp.asarray(x.length_B), seq_of=None, slot_of=None,
                                att_width=0, att_wide=0)
    out = decode_block(r.graphdef, r.state, cache, rows, params, self.k, np.bool_(False))
    r.cache = jax.block_until_ready(out)[0]
