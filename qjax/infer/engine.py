"""The serving engine: continuous batching over a paged, optionally quantized, KV cache.

    engine = Engine(model, EngineConfig(max_batch=8, page_size=16, num_pages=256))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for request_id, token in engine.stream(prompts, params): ...
    engine.cancel(request_id)   # ends it now ('cancelled'), its pages freed
    engine.stats   # steps, prefill tokens computed, compilations, waste, prefix hits

`generate` raises `GenerationError` when a request failed (non-finite logits), carrying
every prompt's output; the others ran unharmed.

The engine is composed of parts, each in its own module and testable alone: the request
side (`engine_requests.Requests`: add, stream, cancel, outputs), the scheduler (host policy:
`scheduler.Scheduler`), the input builder (`engine_inputs.build`), the booking of results
(`engine_booking.Booking`) and the runner (`engine_runner.Runner`: device state and the
packed step) with a decode policy (`engine_block.BlockDecoding`, or the speculative rounds of
`spec_engine.SpeculativeDecoding`). `Engine` builds them and is their public face.

One step is one jitted function of (model state, tokens, cache, last_B, sampling)
(`engine_programs.step`): it runs every block against the paged cache (`qjax.infer.paged`),
takes each sequence's last fed token and draws (`engine_programs.draw`: the sampler with
per-row seeds; an all-greedy step without a repetition penalty takes the argmax). A row
whose logits are not finite yields the token -1 (`qjax.nn.validate.NON_FINITE`), and its
request ends with finish reason 'error', alone:
attention masks select (`qjax.nn.attention_core.weighted_values`), so its NaN keys and
values, and those it leaves in the pages it frees, reach no other request.

A step's tokens are packed: tokens (M, 1), each sequence's fed tokens one after another, so
the weights see the tokens the step feeds and nothing else (no decode padded to a chunk's
length, no idle row). Attention regroups them by sequence (`PagedKVCache.attend`): the
sequences feeding one token (decodes) attend as a (max_batch, 1) layout, those feeding more
(prompt chunks) as a (C, T) one, so a page is fetched once per sequence, not once per token,
and no decode pays for a chunk-wide attention row. Every token writes its K/V before any
attends, so a chunk's tokens see each other through the pages, under the causal mask. The
buckets (M, T, C) (`engine_inputs.buckets`): decodes alone (max_batch, 1, 0); beside half a
chunk, one, two, four, ... chunks; and every row a chunk (max_batch * chunk_size tokens: a static
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

from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from qjax.core.decode_paths import DecodeWeights
from qjax.infer import engine_inputs, page_host, paged
from qjax.infer.engine_block import BlockDecoding
from qjax.infer.engine_booking import Booking
from qjax.infer.engine_config import EngineConfig, EngineStats
from qjax.infer.engine_requests import Requests
from qjax.infer.engine_runner import Runner
from qjax.infer.prefix_cache import PrefixCache
from qjax.infer.scheduler import Scheduler
from qjax.nn.attention import kv_format
from qjax.nn.kvcache import check_format
from qjax.nn.model_split import StaticGraphdef


class Engine:
  """Continuous batching with a paged KV cache; see the module docstring."""

  def __init__(self, model: nnx.Module, config: Optional[EngineConfig] = None,
               tokenizer=None, *, mesh=None, layout=None, shard_weights: bool = True,
               decoding: Optional[Callable] = None):
    """Args:
      model: a (float or quantized) `Transformer`.
      config: batching and cache settings (default `EngineConfig()`).
      tokenizer: encodes text prompts and decodes for stop strings (optional).
      mesh: a device mesh (`qjax.sharding.make_mesh`) to run on, or None (one device).
      layout: with a mesh, the layout whose rules split the page pools
        (`paged.POOL_AXES`) and, with `shard_weights`, the weights (`state_shardings`).
      shard_weights: split the weights too (else they are replicated).
      decoding: `decoding(runner) -> policy`, how decoding steps run (default: blocks of
        `config.decode_block` steps, `engine_block.BlockDecoding`).
    """
    cfg = model.config
    config = EngineConfig() if config is None else config
    self.model, self.config, self.tokenizer, self.mesh = model, config, tokenizer, mesh
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
    self.buckets = engine_inputs.buckets(config.max_batch, config.chunk_size)
    self.scheduler = Scheduler(max_batch=config.max_batch, chunk_size=config.chunk_size,
                               page_size=p, max_pages=self.max_pages, max_len=self.max_len,
                               allocator=self.allocator, ring_allocator=self.ring_allocator,
                               ring_pages=ring_pages, prefix_cache=self.prefix_cache,
                               preemption=config.preemption,
                               # The runner (built below) holds the pages' device copies.
                               swap_out=lambda seq: self.runner.swap_out(seq),
                               swap_in=lambda seq, host: self.runner.swap_in(seq, host),
                               prefill_budget=config.prefill_budget)
    cache = paged.init_paged_cache(
        cfg, num_pages=config.num_pages, page_size=p, batch=config.max_batch,
        max_pages=self.max_pages, ring_pages=ring_pages, num_ring_pages=num_ring,
        fmt=self.qformat)
    # Split once; the graphdef hashed once (a static jit argument hashed every call would
    # cost ms per step), and bf16 weights widened once on XLA:CPU without the kernel.
    graphdef, state = nnx.split(model)
    if mesh is not None:
      cache = paged.shard_pools(cache, rules, mesh)
      if shard_weights:
        state = jax.device_put(state, sharding.state_shardings(state, rules, mesh))
    self.stats = EngineStats()
    self.booking = Booking(self.scheduler, self.stats, tokenizer, page_size=p,
                           max_len=self.max_len, ring_layers=cache.ring,
                           ring_span=cache.ring_table.shape[1] * p)
    self.runner = Runner(StaticGraphdef(graphdef), DecodeWeights(state)(state), cache,
                         self.scheduler, self.booking, self.stats, buckets=self.buckets,
                         chunk_size=config.chunk_size, page_size=p, max_len=self.max_len,
                         max_pages=self.max_pages, vocab=cfg.vocab_size)
    self.runner.dispatch = self._dispatch
    if decoding is None:
      decoding = lambda runner: BlockDecoding(
          runner, decode_block=config.decode_block, admit_within_s=config.admit_within_s,
          max_batch=config.max_batch)
    self.policy = decoding(self.runner)
    self.runner.use(self.policy)
    self.requests = Requests(self.scheduler, cfg.vocab_size, tokenizer, step=self.step,
                             busy=lambda: self.runner.busy, settle=self.runner.settle,
                             check=self.policy.check)

  @property
  def cache(self) -> paged.PagedKVCache:
    """The paged KV cache as the device holds it now."""
    return self.runner.cache

  # ---- stepping ----------------------------------------------------------------------------
  def step(self) -> list[tuple[str, int]]:
    """Run one batched step, or a block of decode steps while every running request decodes
    (`EngineConfig.decode_block`); returns (request id, token) of the tokens generated, in
    step order."""
    return self.runner.step()

  def _dispatch(self, fn, *args):
    """`fn(*args)`, a jitted program, timed into `stats` (`Runner.call`)."""
    return self.runner.call(fn, *args)

  def compile_buckets(self) -> int:
    """Run the step once at every bucket shape on padding only (every write goes to the sink
    page), and the decode block, so later steps never compile; returns this engine's
    compilations so far."""
    return self.runner.compile_buckets(self.config.max_batch)

  # ---- requests (`engine_requests.Requests`) -----------------------------------------------
  def add_request(self, prompt, params=None, request_id=None) -> str:
    return self.requests.add_request(prompt, params, request_id)

  def stream(self, prompts, params=None):
    return self.requests.stream(prompts, params)

  def stream_text(self, prompt, params=None):
    return self.requests.stream_text(prompt, params)

  def run(self):
    return self.requests.run()

  def generate(self, prompts, params=None) -> list[list[int]]:
    return self.requests.generate(prompts, params)

  def cancel(self, request_id: str) -> bool:
    return self.requests.cancel(request_id)

  def output(self, request_id: str) -> list[int]:
    return self.requests.output(request_id)

  def finish_reason(self, request_id: str) -> Optional[str]:
    return self.requests.finish_reason(request_id)

  def error(self, request_id: str) -> Optional[str]:
    return self.requests.error(request_id)

  def prefix_hit_tokens(self, request_id: str) -> int:
    return self.requests.prefix_hit_tokens(request_id)

  def logprobs(self, request_id: str) -> list[float]:
    return self.requests.logprobs(request_id)

  # Each delegate carries the request side's docstring (Args, Returns, Raises).
  for _name in ('add_request', 'stream', 'stream_text', 'run', 'generate', 'cancel', 'output',
                'finish_reason', 'error', 'prefix_hit_tokens', 'logprobs'):
    locals()[_name].__doc__ = getattr(Requests, _name).__doc__
  del _name
