"""The engine's many-step decode: K steps per dispatch with the rows' state on the device.

When every running sequence decodes (no prompt chunk to feed, no stop string to check on
the host, no repetition penalty), `Engine` runs up to K = `EngineConfig.decode_block` decode
steps in one dispatch (`decode_block`, a step on the library's one decode loop,
`qjax.nn.decode_core.run_block`): each step feeds every live row's last token through the
paged cache (the unpacked (B, 1) layout: row b's token is row b), samples
(`qjax.infer.sampling.sample`, or the argmax when every row is greedy), and the loop ends a
row at a stop token, at its max_tokens or at a non-finite logit, all on the device. The host
reads the K tokens of every row once per block. With requests waiting for a row or pages,
the block also ends as soon as a row finishes, so admission is no later than step by step.

What the rows need on the device (block and ring tables, lengths, last tokens, output
positions, limits, stop tokens, sampling parameters) is kept there between dispatches by
`Resident`: the host rebuilds each array from its bookkeeping (cheap numpy) and sends it
only when its value differs from the one the device holds; in steady decode only a block
table that gained a page changes. A block needs pages for its K positions ahead
(`Scheduler.reserve_all`); where the pool cannot give them without preempting, the engine
runs one step instead.

Readback overlaps the device: when no request waits and the pool gives the pages for two
blocks ahead, the next block is dispatched on the device's outputs of the current one before
the host reads the current one's tokens (the next `Engine.step` reads it). The device then
runs block after block while the host books tokens; a request added meanwhile is admitted
after the queued block.

A request that arrives while a row is free would join at the next step without blocks, so
with a free row a dispatch holds the engine at most `EngineConfig.admit_within_s` (K steps,
or 2K with one queued, times the step time estimated from the decode dispatches timed so
far); past it the engine runs single steps. K is one of two compiled sizes (K or 1), so the
bound compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer import paged
from qjax.infer import page_host
from qjax.infer.sampling import SamplingParams, row_keys, sample
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, run_block
from qjax.nn.generate import argmax_or_non_finite
from qjax.nn.model_split import merge

STEP = 'engine.decode_block'  # the name `decode_block` counts its traces under (`qjax.nn.traces`)


def _draw(logits_BV, params, position_B):
  """Tokens and model log-probabilities as the single step draws them (`engine._step`)."""
  def greedy(x_BV):
    tok_B = argmax_or_non_finite(x_BV)
    lse_B = jax.nn.logsumexp(x_BV, axis=-1)
    return tok_B, jnp.take_along_axis(x_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B

  def draw(x_BV):
    tok_B, logprob_B = sample(x_BV, params, row_keys(params.seed_B, position_B))
    return validate.mark_non_finite(tok_B, x_BV), logprob_B
  return jax.lax.cond(jnp.all(params.temperature_B == 0), greedy, draw, logits_BV)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def decode_block(graphdef, state, cache, rows: LoopState, params, block: int, stop_early):
  """Up to `block` decode steps of the live rows on `decode_core.run_block` (module
  docstring); ends early when no row is live, or, with `stop_early`, once a row finished.
  Returns (cache, rows, tok_BK, logprob_BK, num_B): row b generated tok_BK[b, :num_B[b]].
  The values of rows that are not live are never read (they may differ from what the host
  would build for an idle row)."""
  traces.traced(STEP)
  model = merge(graphdef, state)

  def step(rows, cache):
    cache = dataclasses.replace(cache, num_new=rows.live_B.astype(jnp.int32))
    x_BTD, cache = paged.forward(model, rows.tok_B[:, None], cache)
    tok_B, lp_B = _draw(model.logits(x_BTD)[:, 0], params, rows.count_B)
    return tok_B[:, None], lp_B[:, None], jnp.ones_like(rows.count_B), rows.carry, cache

  out, cache = run_block(step, rows, cache, block, stop_early=stop_early)
  cache = dataclasses.replace(cache, num_new=jnp.zeros_like(cache.num_new))
  return cache, out.state, out.tok_BW, out.extra_BW, out.num_B


class Resident:
  """Arrays kept on the device between steps with their host values: `put` sends an array
  only when its host value differs from what the device holds (or that array was donated)."""

  def __init__(self):
    self._held: dict[str, tuple[np.ndarray, jax.Array]] = {}
    self.sent = 0  # arrays copied host -> device
    self.kept = 0  # arrays reused from the device

  def put(self, name: str, host: np.ndarray) -> jax.Array:
    hit = self._held.get(name)
    if (hit is not None and hit[0].shape == host.shape and not hit[1].is_deleted()
        and np.array_equal(hit[0], host)):
      self.kept += 1
      return hit[1]
    dev = jnp.asarray(host)
    self._held[name] = (host, dev)
    self.sent += 1
    return dev

  def hold(self, name: str, host: np.ndarray, dev: jax.Array) -> None:
    """Record that the device holds `dev` whose value is `host` (a step's output)."""
    self._held[name] = (host, dev)


def stop_width(n: int) -> int:
  """Stop-token columns for n stop tokens: a power of two (few compilations), at least 1."""
  return 1 << max(n - 1, 0).bit_length()


def row_arrays(rows, max_pages: int, ring_width: int) -> dict[str, np.ndarray]:
  """The host values of a block's inputs for `rows` (a sequence or None per engine row)."""
  b = len(rows)
  width = stop_width(max([len(s.params.stop_tokens) for s in rows if s is not None] + [1]))
  out = dict(table=np.zeros((b, max_pages), np.int32), ring=np.zeros((b, ring_width), np.int32),
             length=np.zeros(b, np.int32), tok=np.zeros(b, np.int32),
             position=np.zeros(b, np.int32), max=np.zeros(b, np.int32),
             stop=np.full((b, width), -1, np.int32), live=np.zeros(b, bool))
  for row, seq in enumerate(rows):
    if seq is None:
      continue
    out['table'][row, :len(seq.pages)] = seq.pages
    out['ring'][row, :len(seq.ring_pages)] = seq.ring_pages
    out['length'][row], out['tok'][row] = seq.num_cached, seq.tokens[-1]
    out['position'][row], out['max'][row] = len(seq.output), seq.max_tokens
    out['stop'][row, :len(seq.params.stop_tokens)] = seq.params.stop_tokens
    out['live'][row] = True
  return out


_GREEDY = SamplingParams(temperature=0.0)  # the parameters of an idle row


class BlockDecoding:
  """The `Engine`'s decode blocks (a mixin: it uses the engine's scheduler, cache, stats and
  `_dispatch` / `_fetch` / `_sampling`)."""

  def _block_steps(self, plan) -> int:
    """Decode steps the next dispatch may run as a block (1: a single step): every running
    sequence decodes, none needs the host per token, and the pages for K steps are there."""
    k = self.config.decode_block
    live = [s for s in plan.rows if s is not None]
    if k == 1 or not live:
      return 1
    for seq, n in zip(plan.rows, plan.num_new):
      if seq is None:
        continue
      prm = seq.params
      if (n != 1 or seq.num_pending != 1 or not seq.output or prm.stop_strings
          or prm.repetition_penalty != 1):
        return 1
    if not self._may_hold(k) or not self.scheduler.reserve_all(k):
      return 1
    return k

  def _may_hold(self, steps: int) -> bool:
    """Whether one dispatch may hold the engine for `steps` decode steps: always while every
    row is busy or a request waits (a finish then ends the block); with a free row, only
    within `EngineConfig.admit_within_s` of the estimated step time."""
    bound = self.config.admit_within_s
    if (bound is None or self.scheduler.waiting
        or len(self.scheduler.running) >= self.config.max_batch):
      return True
    return self._step_s is not None and steps * self._step_s <= bound

  def _time_steps(self, started: float, steps: int) -> None:
    """Fold a decode dispatch's wall time (dispatch to tokens read) into the step estimate."""
    if steps:
      s = (time.perf_counter() - started) / steps
      self._step_s = s if self._step_s is None else 0.5 * (self._step_s + s)

  def _run_block(self, plan, k: int) -> list[tuple[str, int]]:
    """Up to `k` decode steps of every running row in one dispatch (`decode_block`)."""
    t0 = time.perf_counter()
    b, p = self.config.max_batch, self.config.page_size
    rows = plan.rows
    host = row_arrays(rows, self.max_pages, self.cache.ring_table.shape[1])
    live = [s for s in rows if s is not None]
    page_host.check_step([s.id for s in live], [s.num_cached for s in live],
                         [min(k, s.max_tokens - len(s.output)) for s in live],
                         [len(s.pages) for s in live], p, self.max_len)
    res = self._resident
    sent0, kept0 = res.sent, res.kept
    cache = dataclasses.replace(
        self.cache, block_table=res.put('table', host['table']),
        ring_table=res.put('ring', host['ring']), length=res.put('length', host['length']),
        num_new=res.put('num_new', np.zeros(b, np.int32)), seq_of=None, slot_of=None,
        att_width=0, att_wide=0)
    dev_rows = LoopState(
        tok_B=res.put('tok', host['tok']), count_B=res.put('position', host['position']),
        max_B=res.put('max', host['max']), stop_BS=res.put('stop', host['stop']),
        live_B=res.put('live', host['live']))
    params = self._sampling([s.params if s is not None else _GREEDY for s in rows])
    stop_early = np.bool_(bool(self.scheduler.waiting))
    self.stats.arrays_sent += res.sent - sent0
    self.stats.arrays_kept += res.kept - kept0
    self.stats.host_s += time.perf_counter() - t0
    compile_s, started = self.stats.compile_s, time.perf_counter()
    out = self._dispatch(decode_block, self.graphdef, self.state, cache, dev_rows, params, k,
                         stop_early)
    self.cache = out[0]
    return self._finish_block(rows, host['table'], out, params, k, queue=not stop_early,
                              started=started if self.stats.compile_s == compile_s else None)

  def _finish_block(self, rows, table, out, params, k: int, queue: bool, started=None):
    """Read the dispatched block `out` of `rows` (run with block table `table`) and book its
    tokens. First, with `queue` and no request waiting, when the pool gives the pages for
    two blocks ahead (and `_may_hold` allows two blocks), the next block of the same rows is
    dispatched from the device's own outputs, so it runs while the host reads and books this
    one (`step` books it next). `started`: when `out` began to run (its dispatch, or the
    read of the block it was queued behind), for the step estimate; None: not timed."""
    t0 = time.perf_counter()
    res, b = self._resident, self.config.max_batch
    _, new_rows, tok_BK, lp_BK, num_B = out
    res.hold('table', table, out[0].block_table)  # the table `out` ran with, now its output
    sent0, kept0 = res.sent, res.kept
    nxt = None
    live = [s if s is not None and s.row == r and not s.finished else None
            for r, s in enumerate(rows)]
    running = [s for s in live if s is not None]
    if (queue and running and not self.scheduler.waiting
        and len(running) == len(self.scheduler.running)
        and any(s.max_tokens - len(s.output) > k for s in running)  # not all done in `out`
        and self._may_hold(2 * k) and self.scheduler.reserve_all(2 * k)):
      page_host.check_step([s.id for s in running], [s.num_cached for s in running],
                           [min(2 * k, s.max_tokens - len(s.output)) for s in running],
                           [len(s.pages) for s in running], self.config.page_size,
                           self.max_len)
      next_table = row_arrays(live, self.max_pages, self.cache.ring_table.shape[1])['table']
      cache = dataclasses.replace(self.cache, block_table=res.put('table', next_table))
      self.stats.host_s += time.perf_counter() - t0
      self.stats.arrays_sent += res.sent - sent0
      self.stats.arrays_kept += res.kept - kept0
      nxt = self._dispatch(decode_block, self.graphdef, self.state, cache, new_rows, params,
                           k, np.bool_(False))
      self.cache = nxt[0]
      t0 = time.perf_counter()
    self.stats.host_s += time.perf_counter() - t0
    tok_BK, lp_BK, num_B = self._fetch((tok_BK, lp_BK, num_B))
    t0 = time.perf_counter()
    if started is not None:
      self._time_steps(started, int(np.max(num_B, initial=0)))
    self._fetched_at = t0  # a block queued behind this one starts on the device about now
    events = self._complete_block(rows, tok_BK, lp_BK, num_B)
    if nxt is not None:
      self._inflight = (rows, next_table, nxt, params, k)
    else:
      # What the device now holds, as the host would build it for the same rows: the next
      # block sends none of these unless the rows changed (tables and limits did not).
      after = row_arrays([s if s is not None and s.row == r and not s.finished else None
                          for r, s in enumerate(rows)],
                         self.max_pages, self.cache.ring_table.shape[1])
      after['num_new'] = np.zeros(b, np.int32)
      new_rows = out[1]
      for name, dev in (('table', self.cache.block_table), ('ring', self.cache.ring_table),
                        ('length', self.cache.length), ('num_new', self.cache.num_new),
                        ('tok', new_rows.tok_B), ('position', new_rows.count_B),
                        ('live', new_rows.live_B)):
        res.hold(name, table if name == 'table' else after[name], dev)
    self.stats.host_s += time.perf_counter() - t0
    return events

  def _run_inflight(self, queue: bool = True) -> list[tuple[str, int]]:
    """Book the block `_finish_block` queued (and, with `queue`, maybe queue the one after
    it)."""
    rows, table, out, params, k = self._inflight
    self._inflight = None
    return self._finish_block(rows, table, out, params, k, queue=queue,
                              started=self._fetched_at)

  def _complete_block(self, rows, tok_BK, lp_BK, num_B) -> list[tuple[str, int]]:
    """Book a block's tokens as its steps would have, in step order."""
    st, p, events = self.stats, self.config.page_size, []
    ring = self.cache.ring
    n_ring, n_full = sum(ring), len(ring) - sum(ring)
    span = self.cache.ring_table.shape[1] * p
    for i in range(int(np.max(num_B, initial=0))):
      st.steps += 1
      for row, seq in enumerate(rows):
        if seq is None or i >= num_B[row]:
          continue
        seq.num_cached += 1
        held = seq.num_cached
        st.decode_tokens += 1
        st.used_slots += n_full * held + n_ring * min(held, span)
        st.allocated_slots += (n_full * len(seq.pages) + n_ring * len(seq.ring_pages)) * p
        st.contiguous_slots += len(ring) * self.max_len
        tok = int(tok_BK[row, i])
        if tok < 0:  # NON_FINITE: no token to give
          self.scheduler.fail(seq)
          continue
        seq.output.append(tok)
        events.append((seq.id, tok))
        if seq.params.logprobs:
          seq.logprobs.append(float(lp_BK[row, i]))
        if self._finished(seq):
          seq.finished = True
          self.scheduler.release(seq)
    return events

  def _compile_block(self, params) -> None:
    """Compile the decode block on rows none of which is live (`Engine.compile_buckets`)."""
    b = self.config.max_batch
    host = row_arrays([None] * b, self.max_pages, self.cache.ring_table.shape[1])
    rows = LoopState(*(jnp.asarray(host[k]) for k in ('tok', 'position', 'max', 'stop',
                                                      'live')))
    cache = dataclasses.replace(self.cache, block_table=jnp.asarray(host['table']),
                                ring_table=jnp.asarray(host['ring']),
                                length=jnp.asarray(host['length']), seq_of=None,
                                slot_of=None, att_width=0, att_wide=0)
    out = decode_block(self.graphdef, self.state, cache, rows, params,
                       self.config.decode_block, np.bool_(False))
    self.cache = jax.block_until_ready(out)[0]
