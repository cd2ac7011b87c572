"""The serving engine's programs as (function, abstract arguments): its step and its decode
block, over a paged KV cache built for the target (`qjax.infer`).

* engine_step (`infer.engine_programs.step`): one step at the decode bucket, every row
  feeding one token (packed (B, 1)), greedy and sampled rows both compiled; or (`mixed`) at
  the bucket of decodes beside a prompt chunk.
* engine_block (`infer.engine_programs.decode_block`): `block` decode steps of every row in one
  dispatch, the rows' state on the device.

The pools are sized as `Engine` sizes them (`EngineConfig`: a page table covering `max_len`,
a ring of pages for sliding-window layers where it is shorter than the table) and stored in
`kv` (int8 by default: a quantized paged KV). Where the target is one TPU or NVIDIA GPU, the
decode rows attend through the Pallas paged kernel (`qjax.infer.paged_kernel.attention_form`:
Mosaic on TPU, Triton on GPU where this jax has it), as the engine would run there; a mixed
step on one TPU attends every row through the ragged kernel, once per layer (on a GPU, its
decode rows through Triton and its chunk through the scan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qjax.aot import _compile
from qjax.aot._programs import AbstractModel, Program, cache_bytes, compute_bits
from qjax.infer import engine_programs as programs_of_engine
from qjax.infer import paged
from qjax.infer.engine_config import EngineConfig
from qjax.infer.sampling import SamplingBatch, SamplingParams
from qjax.nn.decode_core import LoopState
from qjax.nn.kvcache import check_format


@dataclasses.dataclass(frozen=True)
class PagedShape:
  """The engine's cache geometry for one model: what `Engine.__init__` derives from its
  `EngineConfig` (max_pages, ring pages, pool sizes)."""

  max_batch: int
  page_size: int
  max_pages: int
  num_pages: int
  ring_pages: int
  num_ring_pages: int


def paged_shape(m: AbstractModel, config: EngineConfig) -> PagedShape:
  """The cache geometry `Engine` builds for `m` under `config` (every row may hold max_len)."""
  cfg, p = m.config, config.page_size
  max_len = config.max_len or cfg.max_len
  max_pages = -(-max_len // p)
  ring_pages = 0
  if config.ring and not config.prefix_caching and any(
      cfg.is_local(i) for i in range(cfg.num_layers)):
    ring_pages = paged.ring_pages_needed(cfg.sliding_window, p, config.chunk_size)
    ring_pages = ring_pages if ring_pages < max_pages else 0
  num_ring = 1 + config.max_batch * ring_pages if ring_pages else 0
  return PagedShape(config.max_batch, p, max_pages, config.num_pages, ring_pages, num_ring)


def default_config(m: AbstractModel, *, max_batch: int = 8, max_len: int = 256,
                   kv: str = 'int8', block: int = 8) -> EngineConfig:
  """An `EngineConfig` whose pools hold every row at `max_len` (plus the sink page)."""
  p = 16
  pages = max_batch * -(-max_len // p) + 1
  return EngineConfig(max_batch=max_batch, page_size=p, num_pages=pages, max_len=max_len,
                      kv_format=kv, decode_block=block)


def abstract_cache(m: AbstractModel, config: EngineConfig, *, packed_tokens: int = 0,
                   width: int = 1, wide: int = 0):
  """The engine's abstract `PagedKVCache` for `m`, built while `m.target` is in force (the
  pools' code layout is the target's). `packed_tokens` > 0: laid out as one of the step's
  buckets (`paged.with_step` with seq_of / slot_of of that many tokens, att_width `width`,
  att_wide `wide`; the decode bucket: width 1, wide 0)."""
  cfg, shape = m.config, paged_shape(m, config)
  fmt = check_format(config.kv_format, cfg.head_dim, 'qjax.aot engine programs: kv')
  b = shape.max_batch

  def make():
    cache = paged.init_paged_cache(
        cfg, num_pages=shape.num_pages, page_size=shape.page_size, batch=b,
        max_pages=shape.max_pages, ring_pages=shape.ring_pages,
        num_ring_pages=shape.num_ring_pages, fmt=fmt)
    if not packed_tokens:
      return cache
    m_tokens = packed_tokens  # M, the step's packed tokens
    return dataclasses.replace(cache, seq_of=jnp.zeros((m_tokens,), jnp.int32),
                               slot_of=jnp.zeros((m_tokens,), jnp.int32), att_width=width,
                               att_wide=wide)

  with _compile.tracing_for(m.target):
    return jax.eval_shape(make)


def _sampling(batch: int):
  return jax.eval_shape(lambda: SamplingBatch.stack([SamplingParams(temperature=0.0)] * batch))


def engine_step(m: AbstractModel, config: EngineConfig, *, mixed: bool = False) -> Program:
  """The engine's step at its decode bucket (`Engine.buckets[0]`: max_batch rows of one
  token each), or with `mixed` at the bucket of decodes beside one prompt chunk (max_batch +
  chunk_size tokens, one row feeding up to chunk_size), greedy and sampled rows both compiled
  (`lax.cond`), no repetition penalty."""
  b = config.max_batch
  # The bucket (M, T, C): M packed tokens, T tokens a chunk row feeds, C chunk rows.
  packed, t, c = (b + config.chunk_size, config.chunk_size, 1) if mixed else (b, 1, 0)
  step = programs_of_engine.step.__wrapped__
  graphdef = m.graphdef

  def run(state, tokens_M1, cache, last_B, params, position_B):
    return step(graphdef, state, tokens_M1, cache, last_B, params, position_B, None)

  ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  cache = abstract_cache(m, config, packed_tokens=packed, width=t, wide=c)
  bucket = f' M={packed} T={t} C={c}' if mixed else ''
  return Program(f'engine_step B={b}{bucket} kv={config.kv_format}', run,
                 (m.state, ints(packed, 1), cache, ints(b), _sampling(b), ints(b)),
                 donate_argnums=(2,), compute_bits=compute_bits(m.fmt))


def engine_decode_block(m: AbstractModel, config: EngineConfig) -> Program:
  """The engine's decode block: `config.decode_block` steps of every row in one dispatch
  (`engine_programs.decode_block`), its rows' state as the engine keeps it on the device."""
  b, u = config.max_batch, config.decode_block
  block_fn = programs_of_engine.decode_block.__wrapped__
  graphdef = m.graphdef

  def run(state, cache, rows, params, stop_early):
    return block_fn(graphdef, state, cache, rows, params, u, stop_early)

  ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  rows = LoopState(tok_B=ints(b), count_B=ints(b), max_B=ints(b), stop_BZ=ints(b, 1),
                   live_B=jax.ShapeDtypeStruct((b,), jnp.bool_))
  cache = abstract_cache(m, config)
  return Program(f'engine_block B={b} x{u} kv={config.kv_format}', run,
                 (m.state, cache, rows, _sampling(b), jax.ShapeDtypeStruct((), jnp.bool_)),
                 donate_argnums=(1,), compute_bits=compute_bits(m.fmt), tokens=u)


def engine_programs(m: AbstractModel, config: EngineConfig = None) -> list[Program]:
  """The engine's step and decode block for `m` (default: `default_config(m)`)."""
  config = config or default_config(m)
  return [engine_step(m, config), engine_decode_block(m, config)]


def engine_cache_bytes(m: AbstractModel, config: EngineConfig = None) -> int:
  """Bytes of the engine's page pools and tables for `m` on its target."""
  return cache_bytes(abstract_cache(m, config or default_config(m)))
