"""The serving engine: continuous batching over a paged, optionally quantized, KV cache.

    engine = Engine(model, EngineConfig(max_batch=8, page_size=16, num_pages=256))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for request_id, token in engine.stream(prompts, params): ...
    engine.cancel(request_id)   # ends it now ('cancelled'), its pages freed
    engine.stats   # steps, prefill tokens computed, compilations, waste, prefix hits

`generate` raises `GenerationError` when a request failed (non-finite logits), carrying
every prompt's output; the others ran unharmed.

One step is one jitted function of (model state, tokens, cache, last_B, sampling): it runs
every block against the paged cache (`qjax.infer.paged`), takes each sequence's last fed
token, and samples (`qjax.infer.sampling.sample`, per-row seeds; an all-greedy step without
a repetition penalty takes `argmax_or_non_finite` and skips the sampler's passes over the
vocabulary). A row whose logits are not finite yields the token -1
(`qjax.nn.validate.NON_FINITE`), and its request ends with finish reason 'error', alone:
attention masks select (`qjax.nn.attention_core.weighted_values`), so its NaN keys and
values, and those it leaves in the pages it frees, reach no other request.

A step's tokens are packed: tokens (N, 1), each sequence's fed tokens one after another, so
the weights see the tokens the step feeds and nothing else (no decode padded to a chunk's
length, no idle row). Attention regroups them by sequence (`PagedKVCache.attend`): the
sequences feeding one token (decodes) attend as a (max_batch, 1) layout, those feeding more
(prompt chunks) as a (C, W) one, so a page is fetched once per sequence, not once per token,
and no decode pays for a chunk-wide attention row. Every token writes its K/V before any
attends, so a chunk's tokens see each other through the pages, under the causal mask. The
buckets (N, W, C) (`_buckets`): decodes alone (max_batch, 1, 0); beside half a chunk, one,
two, four, ... chunks; and every row a chunk (max_batch * chunk_size tokens: a static
batch's prefill, a burst of arrivals). Packing is cheaper than the per-token and padded
layouts it replaced because their cost was attention over tiny one-page blocks and over
chunk-wide rows for decodes (the step costs are in docs/engine.md).

So the step compiles once per bucket (`Engine.buckets`; `compile_buckets` does it up front).
Before each step the host checks every sequence's write against its pages and the context
(`page_host.check_step`), so an overflow is an error naming the request.

While every running request decodes, a dispatch runs up to `EngineConfig.decode_block` steps
on the device with the rows' state kept there (`qjax.infer.engine_block`); the tokens are
those of one step per dispatch. `EngineStats` splits the time into host planning, dispatch,
device wait and compilation.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.core.decode_paths import DecodeWeights
from qjax.infer import engine_block, engine_requests, page_host, paged
from qjax.infer.engine_config import EngineConfig, EngineStats
from qjax.infer.prefix_cache import PrefixCache
from qjax.infer.sampling import SamplingBatch, SamplingParams, row_keys, sample
from qjax.infer.scheduler import Scheduler
from qjax.infer.scheduler import SequenceState
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.attention import kv_format
from qjax.nn.generate import argmax_or_non_finite
from qjax.nn.kvcache import check_format
from qjax.nn.model_split import StaticGraphdef, merge


def _buckets(max_batch: int, chunk: int) -> tuple[tuple[int, int, int], ...]:
  """(N, W, C) of every step shape (module docstring): N packed tokens, at most C rows
  feeding more than one token, at most W tokens each. Decodes alone: (max_batch, 1, 0).
  Beside prompt tokens: max_batch + chunk // 2 tokens with one such row (chunks of 16 and
  more: a short prompt or a prefix hit's rest need not pay for a whole chunk), max_batch +
  k chunks with k rows (k = 1, 2, 4, ...), and max_batch * chunk tokens with every row (the
  most a step can feed); W = min(chunk, N)."""
  shapes, k = {(max_batch * chunk, max_batch)}, 1
  if chunk >= 16:
    shapes.add((max_batch + chunk // 2, 1))
  while max_batch + k * chunk < max_batch * chunk:
    shapes.add((max_batch + k * chunk, min(k, max_batch)))
    k *= 2
  return ((max_batch, 1, 0),) + tuple((n, min(chunk, n), c) for n, c in sorted(shapes)
                                      if n > max_batch)


def _greedy(logits_BV):
  """Greedy tokens and their model log-probabilities, as `sample` gives for greedy rows
  (`NON_FINITE` for a row whose logits are not finite)."""
  tok_B = argmax_or_non_finite(logits_BV)
  lse_B = jax.nn.logsumexp(logits_BV, axis=-1)
  return tok_B, jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3,))
def _step(graphdef, state, tokens_BT, cache, last_B, params, position_B, seen_BV):
  traces.traced('engine.step')
  model = merge(graphdef, state)
  x_BTD, cache = paged.forward(model, tokens_BT, cache)
  x_B1D = x_BTD.reshape(-1, 1, x_BTD.shape[-1])[last_B]  # last_B: each row's last token
  logits_BV = model.logits(x_B1D)[:, 0]
  def draw(x):
    tok_B, logprob_B = sample(x, params, row_keys(params.seed_B, position_B), seen_BV)
    return validate.mark_non_finite(tok_B, x), logprob_B

  if seen_BV is not None:  # the penalty changes the argmax: the general path
    tok_B, logprob_B = draw(logits_BV)
  else:
    tok_B, logprob_B = jax.lax.cond(jnp.all(params.temperature_B == 0), _greedy, draw,
                                    logits_BV)
  return tok_B, logprob_B, cache


class Engine(engine_requests.Requests, engine_block.BlockDecoding):
  """Continuous batching with a paged KV cache; see the module docstring."""

  def __init__(self, model: nnx.Module, config: Optional[EngineConfig] = None,
               tokenizer=None, *, mesh=None, layout=None, shard_weights: bool = True):
    """Args:
      model: a (float or quantized) `Transformer`.
      config: batching and cache settings (default `EngineConfig()`).
      tokenizer: encodes text prompts and decodes for stop strings (optional).
      mesh: a device mesh (`qjax.sharding.make_mesh`) to run on, or None (one device).
      layout: with a mesh, the layout whose rules split the page pools
        (`paged.POOL_AXES`) and, with `shard_weights`, the weights (`state_shardings`).
      shard_weights: split the weights too (else they are replicated).
    """
    cfg = model.config
    config = EngineConfig() if config is None else config
    self.model, self.config, self.tokenizer = model, config, tokenizer
    self.max_len = cfg.max_len if config.max_len is None else config.max_len
    if self.max_len > cfg.max_len:
      raise ValueError(f'EngineConfig: max_len={self.max_len} exceeds the model\'s '
                       f'config.max_len={cfg.max_len}.')
    fmt = config.kv_format if config.kv_format is not None else kv_format(model)
    self.qformat = check_format(fmt, cfg.head_dim, 'EngineConfig: kv_format')
    p = config.page_size
    self.max_pages = -(-self.max_len // p)
    ring = config.ring and not config.prefix_caching and any(
        cfg.is_local(i) for i in range(cfg.num_layers))
    ring_pages = 0
    if ring:
      ring_pages = paged.ring_pages_needed(cfg.sliding_window, p, config.chunk_size)
      ring = ring_pages < self.max_pages  # a ring as long as the table saves nothing
      ring_pages = ring_pages if ring else 0
    num_ring = 1 + config.max_batch * ring_pages if ring else 0
    rules = None
    if mesh is not None:
      from qjax import sharding  # pylint: disable=g-import-not-at-top
      if layout is None:
        raise ValueError("Engine: mesh= needs layout= (e.g. 'wg_xyz+mq_batch'), the rules "
                         'that split the page pools.')
      rules = sharding.layout_rules(layout)
      ways = int(np.prod([mesh.shape[a] for a in rules.axes(paged.POOL_AXES[0])]))
      num_ring = -(-num_ring // ways) * ways if ring else 0  # spare ring pages: never used
    self.allocator = page_host.PageAllocator(config.num_pages)
    self.ring_allocator = page_host.PageAllocator(num_ring) if ring else None
    self.prefix_cache = PrefixCache(self.allocator, p) if config.prefix_caching else None
    self.buckets = _buckets(config.max_batch, config.chunk_size)
    self.scheduler = Scheduler(max_batch=config.max_batch, chunk_size=config.chunk_size,
                               page_size=p, max_pages=self.max_pages, max_len=self.max_len,
                               allocator=self.allocator, ring_allocator=self.ring_allocator,
                               ring_pages=ring_pages, prefix_cache=self.prefix_cache,
                               preemption=config.preemption, swap_out=self._swap_out,
                               swap_in=self._swap_in, prefill_budget=config.prefill_budget)
    self.cache = paged.init_paged_cache(
        cfg, num_pages=config.num_pages, page_size=p, batch=config.max_batch,
        max_pages=self.max_pages, ring_pages=ring_pages, num_ring_pages=num_ring,
        fmt=self.qformat)
    # Split once; the graphdef hashed once (a static jit argument hashed every call would
    # cost ms per step), and bf16 weights widened once on XLA:CPU without the kernel.
    graphdef, self.state = nnx.split(model)
    self.graphdef = StaticGraphdef(graphdef)
    if mesh is not None:
      self.cache = paged.shard_pools(self.cache, rules, mesh)
      if shard_weights:
        self.state = jax.device_put(self.state,
                                    sharding.state_shardings(self.state, rules, mesh))
    self.state = DecodeWeights(self.state)(self.state)
    self._resident = engine_block.Resident()
    self._inflight = None  # a decode block dispatched but not yet read (`engine_block`)
    self._held_events = []  # tokens `cancel` booked from a queued block, for the next step
    self._step_s = None  # estimated seconds per decode step (`engine_block._may_hold`)
    self._fetched_at = 0.0  # when the last block's tokens were read (`engine_block`)
    self._batches: dict[tuple, SamplingBatch] = {}
    self.mesh = mesh
    self.stats = EngineStats()
    self._traces_before = self._traces()
    self._ids = itertools.count()
    self._seqs: dict[str, SequenceState] = {}

  # ---- swap preemption (the scheduler calls these while it plans a step) ----------------
  def _swap_out(self, seq: SequenceState):
    """Host copy of the pages holding `seq`'s cached positions (and its ring)."""
    pages = seq.pages[:self.scheduler.pages_for(seq.num_cached)]
    host, nbytes = page_host.read_pages(self.cache, pages, seq.ring_pages)
    self.stats.swapped_bytes += nbytes
    return len(pages), host

  def _swap_in(self, seq: SequenceState, handle) -> None:
    n, host = handle
    self.cache = page_host.write_pages(self.cache, seq.pages[:n], seq.ring_pages, host)

  # ---- stepping ----------------------------------------------------------------------------
  def step(self) -> list[tuple[str, int]]:
    """Run one batched step, or a block of decode steps while every running request decodes
    (`EngineConfig.decode_block`); returns (request id, token) of the tokens generated, in
    step order."""
    if self._held_events:  # booked by `cancel` while it drained a queued block
      events, self._held_events = self._held_events, []
      return events
    if self._inflight is not None:  # a decode block queued behind the last one
      return self._run_inflight()
    t0 = time.perf_counter()
    plan = self.scheduler.schedule()
    steps = self._block_steps(plan)
    self.stats.host_s += time.perf_counter() - t0
    if steps > 1:
      return self._run_block(plan, steps)
    return self._run_plan(plan)

  # The jitted steps whose traces (`qjax.nn.traces`) count as this engine's compilations.
  _STEPS = ('engine.step', engine_block.STEP)

  def _traces(self) -> int:
    return traces.count(*self._STEPS)

  def _dispatch(self, fn, *args):
    """`fn(*args)` (a jitted step), its time booked as dispatch or, when it compiled, as
    compile time."""
    before, t0 = self._traces(), time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t0
    if self._traces() != before:
      self.stats.compile_s += dt
    else:
      self.stats.dispatch_s += dt
    self.stats.dispatches += 1
    # Steps another engine of the same model and shapes compiled are reused, not counted.
    self.stats.compilations = self._traces() - self._traces_before
    return out

  def _fetch(self, tree):
    """The step's outputs on the host; the time blocked is the device wait."""
    t0 = time.perf_counter()
    out = jax.device_get(tree)
    self.stats.wait_s += time.perf_counter() - t0
    return out

  def _sampling(self, params) -> SamplingBatch:
    """`SamplingBatch.stack(params)`, kept on the device for a mix of params seen before."""
    key = tuple(params)
    batch = self._batches.get(key)
    if batch is None:
      if len(self._batches) > 64:
        self._batches.clear()
      batch = self._batches[key] = SamplingBatch.stack(params)
    return batch

  def _feed_draft(self, tokens_N1, layout: dict) -> None:
    """Hook: the same step's tokens and cache layout (`paged.with_step`'s arguments) for a
    draft model's cache (`SpeculativeEngine`)."""

  def _layout(self, plan) -> tuple[np.ndarray, dict, np.ndarray]:
    """Packed tokens (N, 1), their cache layout (`paged.with_step`'s arguments) and each
    row's last token."""
    b = self.config.max_batch
    total, widest = sum(plan.num_new), max(plan.num_new)
    wide = sum(k > 1 for k in plan.num_new)
    if widest > self.config.chunk_size:
      raise RuntimeError(f'Engine: a sequence feeds {widest} tokens in one step, past '
                         f'chunk_size={self.config.chunk_size}; this is a scheduler bug.')
    n, w, c = next(x for x in self.buckets if x[0] >= total and x[1] >= widest and x[2] >= wide)
    tokens = np.zeros((n, 1), np.int32)
    table = np.zeros((b, self.max_pages), np.int32)
    ring = np.zeros((b, self.cache.ring_table.shape[1]), np.int32)
    length, num_new = np.zeros(b, np.int32), np.zeros(b, np.int32)
    seq_of, slot_of = np.zeros(n, np.int32), np.full(n, w, np.int32)  # padding: slot w
    last, at = np.zeros(b, np.int32), 0
    for row, (seq, k) in enumerate(zip(plan.rows, plan.num_new)):
      if seq is None or not k:
        continue
      tokens[at:at + k, 0] = seq.tokens[seq.num_cached:seq.num_cached + k]
      seq_of[at:at + k], slot_of[at:at + k] = row, np.arange(k)
      table[row, :len(seq.pages)] = seq.pages
      ring[row, :len(seq.ring_pages)] = seq.ring_pages
      length[row], num_new[row] = seq.num_cached, k
      at += k
      last[row] = at - 1
    layout = dict(block_table=table, ring_table=ring, length=length, num_new=num_new,
                  seq_of=seq_of, slot_of=slot_of, att_width=w, att_wide=c)
    return tokens, layout, last

  def _run_plan(self, plan) -> list[tuple[str, int]]:
    """One batched step of `plan` (the scheduler's)."""
    t0 = time.perf_counter()
    if not any(plan.num_new):
      if self.scheduler.waiting:
        raise RuntimeError(f'Engine: {len(self.scheduler.waiting)} requests wait but none can '
                           'be admitted into an idle engine; this is a scheduler bug.')
      return []
    b, p = self.config.max_batch, self.config.page_size
    tokens, layout, last = self._layout(plan)
    position, params = np.zeros(b, np.int32), [SamplingParams(temperature=0.0)] * b
    decode_only = True  # every fed row decodes: the step's time estimates a decode step
    for row, (seq, n) in enumerate(zip(plan.rows, plan.num_new)):
      if seq is None or not n:
        continue
      position[row], params[row] = len(seq.output), seq.params
      if len(seq.tokens) - seq.num_cached > 1 or not seq.output:
        self.stats.prefill_tokens += n
        decode_only = False
      else:
        self.stats.decode_tokens += n
    live = [(s, n) for s, n in zip(plan.rows, plan.num_new) if s is not None and n]
    page_host.check_step([s.id for s, _ in live], [s.num_cached for s, _ in live],
                         [n for _, n in live], [len(s.pages) for s, _ in live], p,
                         self.max_len)
    self.cache = paged.with_step(self.cache, **layout)
    self._feed_draft(tokens, layout)
    seen = None  # the repetition penalty's tokens seen (prompt and output), when one asks
    if any(prm.repetition_penalty != 1 for prm in params):
      seen = np.zeros((b, self.model.config.vocab_size), bool)
      for row, seq in enumerate(plan.rows):
        if seq is not None:
          seen[row, seq.tokens] = True
    args = (jnp.asarray(tokens), self.cache, jnp.asarray(last), self._sampling(params),
            jnp.asarray(position), seen)
    self.stats.host_s += time.perf_counter() - t0
    compile_s, started = self.stats.compile_s, time.perf_counter()
    tok_B, logprob_B, self.cache = self._dispatch(_step, self.graphdef, self.state, *args)
    tok_B, logprob_B = self._fetch((tok_B, logprob_B))
    t0 = time.perf_counter()
    if decode_only and self.stats.compile_s == compile_s:  # not compiled in this call
      self._time_steps(started, 1)
    self._account(plan)
    logprobs = logprob_B.tolist()
    events = self.scheduler.complete(plan, tok_B.tolist(), self._finished)
    sampled = {rid for rid, _ in events}
    for row, seq in enumerate(plan.rows):
      if seq is not None and seq.params.logprobs and seq.id in sampled:
        seq.logprobs.append(logprobs[row])
    self.stats.host_s += time.perf_counter() - t0
    return events

  def compile_buckets(self) -> int:
    """Run the step once at every bucket shape on padding only (every write goes to the sink
    page), so later steps never compile; returns this engine's compilations so far."""
    b = self.config.max_batch
    params = SamplingBatch.stack([SamplingParams(temperature=0.0)] * b)
    zeros = lambda *shape: np.zeros(shape, np.int32)
    for n, w, c in self.buckets:
      self.cache = paged.with_step(
          self.cache, zeros(b, self.max_pages), zeros(b, self.cache.ring_table.shape[1]),
          zeros(b), zeros(b), seq_of=zeros(n), slot_of=np.full(n, w), att_width=w,
          att_wide=c)
      out = _step(self.graphdef, self.state, jnp.asarray(zeros(n, 1)), self.cache,
                  jnp.asarray(zeros(b)), params, jnp.asarray(zeros(b)), None)
      self.cache = jax.block_until_ready(out)[2]
    if self.config.decode_block > 1:
      self._compile_block(params)
    self.stats.compilations = self._traces() - self._traces_before
    return self.stats.compilations

  def _account(self, plan) -> None:
    """Slots summed over layers: ring layers hold at most their ring of each sequence."""
    st, p = self.stats, self.config.page_size
    st.steps += 1
    ring = self.cache.ring
    n_ring, n_full = sum(ring), len(ring) - sum(ring)
    span = self.cache.ring_table.shape[1] * p
    for seq, n in zip(plan.rows, plan.num_new):
      if seq is None:
        continue
      held = seq.num_cached + n
      st.used_slots += n_full * held + n_ring * min(held, span)
      st.allocated_slots += (n_full * len(seq.pages) + n_ring * len(seq.ring_pages)) * p
      st.contiguous_slots += len(ring) * self.max_len
    st.preemptions = self.scheduler.preemptions
    st.swaps_out, st.swaps_in = self.scheduler.swaps_out, self.scheduler.swaps_in
    if self.prefix_cache is not None:
      st.prefix_hit_tokens = self.prefix_cache.hits * p
