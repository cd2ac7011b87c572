"""The engine's runner: the device state and the dispatches that advance it.

The runner holds the weights (split once), the paged cache and what is kept on the device
between dispatches. `Runner.step` plans a step with the scheduler and hands the plan to its
decode policy: `engine_block.BlockDecoding` (U decode steps per dispatch while every request
decodes) or `spec_engine.SpeculativeDecoding` (draft-verify rounds); whatever the policy does
not take runs as one packed step (`plain`). Every dispatch builds its inputs with
`engine_inputs.build` and books its results with `engine_booking.Booking`.

Time is split four ways in `EngineStats`: host planning and booking, dispatch (enqueueing a
jitted call), device wait (reading its outputs) and compilation (a dispatch that traced).
"""

from __future__ import annotations

import time
from typing import Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer import engine_inputs, engine_programs, page_host, paged
from qjax.infer.engine_booking import Booking
from qjax.infer.sampling import SamplingBatch, SamplingParams
from qjax.nn import traces


class DecodePolicy(Protocol):
  """How a `Runner` runs the steps a plan allows: `BlockDecoding` or `SpeculativeDecoding`."""

  programs: tuple[str, ...]  # the trace names of its jitted programs (compilations)
  queued: Optional[tuple]  # a dispatch queued on the device, read by `drain`

  def run(self, plan) -> list[tuple[str, int]]:
    """Run `plan` (its own dispatch, or `Runner.plain`); the events."""

  def drain(self, queue: bool = True) -> list[tuple[str, int]]:
    """Read and book the queued dispatch (with `queue`, maybe queue the next)."""

  def feed(self, x: engine_inputs.StepInputs) -> None:
    """See a plain step's inputs before it runs (a draft model's cache)."""

  def timed(self, started: float, steps: int) -> None:
    """Learn from a decode dispatch's wall time since `started`."""

  def compile(self, params) -> None:
    """Compile its programs on padding rows (`Runner.compile_buckets`)."""

  def check(self, seq) -> None:
    """Raise for a request it cannot serve."""


class Runner:
  """Device state, the packed step and the dispatch of a decode policy (module docstring).

  Args:
    graphdef, state: the model's (hashed-once) graph and device weights.
    cache: the paged cache (`paged.init_paged_cache`).
    scheduler: plans every step (host policy).
    booking: books every dispatch's results.
    stats: the counters to add to.
    buckets: the packed step's shapes (`engine_inputs.buckets`).
    chunk_size, page_size, max_len, max_pages, vocab: the engine's geometry.
  """

  def __init__(self, graphdef, state, cache, scheduler, booking: Booking, stats, *, buckets,
               chunk_size: int, page_size: int, max_len: int, max_pages: int, vocab: int):
    self.graphdef, self.state, self.cache = graphdef, state, cache
    self.scheduler, self.booking, self.stats = scheduler, booking, stats
    self.buckets, self.chunk_size, self.page_size = buckets, chunk_size, page_size
    self.max_len, self.max_pages, self.vocab = max_len, max_pages, vocab
    self.sampling = engine_inputs.SamplingCache()
    self.resident = engine_inputs.Resident()
    self.policy: Optional[DecodePolicy] = None  # set by `use`
    self.held: list[tuple[str, int]] = []  # events booked outside a step, for the next one
    self.dispatch = self.call  # how jitted programs are called (a hook for measurement)
    self.programs: tuple[str, ...] = (engine_programs.STEP,)
    self._traces_before = traces.count(*self.programs)

  def use(self, policy: DecodePolicy) -> None:
    """Run decoding steps with `policy` (its `programs` count as this engine's)."""
    self.policy = policy
    self.programs = (engine_programs.STEP,) + tuple(policy.programs)
    self._traces_before = traces.count(*self.programs)

  @property
  def ring_width(self) -> int:
    return self.cache.ring_table.shape[1]

  # ---- stepping ----------------------------------------------------------------------------
  def step(self) -> list[tuple[str, int]]:
    """One step (or what the policy runs instead); returns (request id, token) of the
    tokens generated, in step order."""
    if self.held:  # booked while a queued dispatch was settled
      events, self.held = self.held, []
      return events
    if self.policy.queued is not None:  # a dispatch queued behind the last one
      return self.policy.drain()
    t0 = time.perf_counter()
    plan = self.scheduler.schedule()
    self.stats.host_s += time.perf_counter() - t0
    return self.policy.run(plan)

  def settle(self) -> None:
    """Book a dispatch queued on the device now, queueing none behind it (its events come
    with the next step), so every request's state is final."""
    if self.policy.queued is not None:
      self.held += self.policy.drain(queue=False)

  @property
  def busy(self) -> bool:
    """Whether steps remain: requests to run, or events not yet returned."""
    return self.scheduler.has_work or bool(self.held)

  def plain(self, plan) -> list[tuple[str, int]]:
    """One packed step of `plan` (the scheduler's)."""
    t0 = time.perf_counter()
    if not any(plan.num_new):
      if self.scheduler.waiting:
        raise RuntimeError(f'Engine: {len(self.scheduler.waiting)} requests wait but none can '
                           'be admitted into an idle engine; this is a scheduler bug.')
      return []
    x = engine_inputs.build(plan.rows, plan.num_new, max_pages=self.max_pages,
                            ring_width=self.ring_width, buckets_nwc=self.buckets,
                            chunk_size=self.chunk_size, vocab=self.vocab)
    engine_inputs.check(plan.rows, plan.num_new, self.page_size, self.max_len)
    # Every fed row decodes: the step's time estimates a decode step.
    decode_only = all(s is None or not n or (s.num_pending == 1 and s.output)
                      for s, n in zip(plan.rows, plan.num_new))
    self.cache = paged.with_step(self.cache, **x.layout())
    self.policy.feed(x)
    args = (jnp.asarray(x.tokens_M1), self.cache, jnp.asarray(x.last_B),
            self.sampling(x.params), jnp.asarray(x.position_B), x.seen_BV)
    self.stats.host_s += time.perf_counter() - t0
    compile_s, started = self.stats.compile_s, time.perf_counter()
    tok_B, logprob_B, self.cache = self.dispatch(engine_programs.step, self.graphdef,
                                                 self.state, *args)
    tok_B, logprob_B = self.fetch((tok_B, logprob_B))
    t0 = time.perf_counter()
    if decode_only and self.stats.compile_s == compile_s:  # not compiled in this call
      self.policy.timed(started, 1)
    live = [1 if s is not None else 0 for s in plan.rows]
    events = self.booking.book(plan.rows, plan.num_new, tok_B[:, None], live,
                               lp_BW=logprob_B[:, None])
    self.stats.host_s += time.perf_counter() - t0
    return events

  # ---- dispatch ------------------------------------------------------------------------------
  def call(self, fn, *args):
    """`fn(*args)` (a jitted program), its time booked as dispatch or, when it compiled, as
    compile time."""
    count = lambda: traces.count(*self.programs)
    before, t0 = count(), time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t0
    if count() != before:
      self.stats.compile_s += dt
    else:
      self.stats.dispatch_s += dt
    self.stats.dispatches += 1
    # Programs another engine of the same model and shapes compiled are reused, not counted.
    self.stats.compilations = count() - self._traces_before
    return out

  def fetch(self, tree):
    """A dispatch's outputs on the host; the time blocked is the device wait."""
    t0 = time.perf_counter()
    out = jax.device_get(tree)
    self.stats.wait_s += time.perf_counter() - t0
    return out

  def compile_buckets(self, batch: int) -> int:
    """Run the step once at every bucket shape on padding only (every write goes to the sink
    page), then the policy's programs, so later steps never compile; returns this engine's
    compilations so far."""
    params = SamplingBatch.stack([SamplingParams(temperature=0.0)] * batch)
    zeros = lambda *shape: np.zeros(shape, np.int32)
    for n, w, c in self.buckets:
      self.cache = paged.with_step(
          self.cache, zeros(batch, self.max_pages), zeros(batch, self.ring_width),
          zeros(batch), zeros(batch), seq_of=zeros(n), slot_of=np.full(n, w), att_width=w,
          att_wide=c)
      out = engine_programs.step(self.graphdef, self.state, jnp.asarray(zeros(n, 1)),
                                 self.cache, jnp.asarray(zeros(batch)), params,
                                 jnp.asarray(zeros(batch)), None)
      self.cache = jax.block_until_ready(out)[2]
    self.policy.compile(params)
    self.stats.compilations = traces.count(*self.programs) - self._traces_before
    return self.stats.compilations

  # ---- swap preemption (the scheduler calls these while it plans a step) ----------------
  def swap_out(self, seq):
    """Host copy of the pages holding `seq`'s cached positions (and its ring)."""
    pages = seq.pages[:self.scheduler.pages_for(seq.num_cached)]
    host, nbytes = page_host.read_pages(self.cache, pages, seq.ring_pages)
    self.stats.swapped_bytes += nbytes
    return len(pages), host

  def swap_in(self, seq, handle) -> None:
    n, host = handle
    self.cache = page_host.write_pages(self.cache, seq.pages[:n], seq.ring_pages, host)
