"""The serving engine's settings (`EngineConfig`, checked on construction) and counters
(`EngineStats`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

PREEMPTION_MODES = ('recompute', 'swap')  # how a preempted request's cache is restored


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the engine batches and stores the cache.

  Attributes:
    max_batch: rows of every step (B).
    page_size: positions per page (Y).
    num_pages: pages per full-attention layer pool, the sink page included.
    chunk_size: most prompt tokens a sequence feeds per step (chunked prefill).
    max_len: longest prompt + output (default: the model's `config.max_len`). Every row's
      page table covers it and attention visits every table entry, so keep it near the
      longest request (Gemma's 32k context would scan 2048 pages of 16 per layer).
    kv_format: None (the model's `kv_format`, float when it has none) or a KV format name.
    prefix_caching: share full pages of identical prompt prefixes.
    ring: sliding-window layers keep a ring of pages (off with prefix caching).
    preemption: 'recompute' (a preempted request recomputes its prompt and output when
      readmitted) or 'swap' (its cached pages are copied to host memory and restored).
    prefill_budget: most prompt tokens fed per step over all sequences (vLLM's token budget
      of chunked prefill), or None: every prefilling sequence feeds a chunk each step. With
      `chunk_size`, every step fits the bucket of decodes beside one chunk.
    decode_block: U, the most decode steps one dispatch runs while every running request
      decodes (`qjax.infer.engine_block`); the host reads tokens once per block. 1: one step
      per dispatch.
    admit_within_s: while a row is free and no request waits, the most decode time (seconds,
      estimated from the decode steps timed so far) one dispatch, or a block and the one
      queued behind it, may hold the engine, so that a request arriving meanwhile is admitted
      no later; past it the engine runs single steps. Blocks of steps well under it (an
      accelerator's) stay on; a step longer than it (a CPU's, often) runs alone while a row is
      free. None: blocks whatever they cost (with every row busy they always run: a finish
      ends a block when requests wait).
  """

  max_batch: int = 4
  page_size: int = 16
  num_pages: int = 64
  chunk_size: int = 32
  max_len: Optional[int] = None
  kv_format: Optional[str] = None
  prefix_caching: bool = False
  ring: bool = True
  preemption: str = 'recompute'
  prefill_budget: Optional[int] = None
  decode_block: int = 8
  admit_within_s: Optional[float] = 0.05

  def __post_init__(self):
    if self.preemption not in PREEMPTION_MODES:
      raise ValueError(f'EngineConfig: preemption={self.preemption!r} is unknown; use one of '
                       f'{PREEMPTION_MODES}.')
    for name in ('max_batch', 'page_size', 'num_pages', 'chunk_size', 'decode_block'):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f'EngineConfig: {name}={v!r} must be a positive integer.')
    if self.num_pages < 2:
      raise ValueError(f'EngineConfig: num_pages={self.num_pages} leaves no page for a '
                       'sequence (page 0 is the sink); use at least 2.')
    if self.max_len is not None and (not isinstance(self.max_len, int) or
                                     isinstance(self.max_len, bool) or self.max_len < 1):
      raise ValueError(f'EngineConfig: max_len={self.max_len!r} must be a positive integer '
                       "(the longest prompt + output) or None (the model's config.max_len).")
    if self.prefill_budget is not None and (not isinstance(self.prefill_budget, int)
                                            or self.prefill_budget < 1):
      raise ValueError(f'EngineConfig: prefill_budget={self.prefill_budget!r} must be a '
                       'positive integer (prompt tokens per step) or None (no budget).')
    a = self.admit_within_s
    if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float))
                          or not math.isfinite(a) or a < 0):
      raise ValueError(f'EngineConfig: admit_within_s={a!r} must be a finite number of '
                       'seconds >= 0, or None (decode blocks whatever they cost).')


@dataclasses.dataclass
class EngineStats:
  """Counters of one engine (host side); `waste` entries are per step.

  Time is split four ways, in seconds summed over steps (wall clock of the calling thread):
  `host_s` plans and books (scheduler, tables, events), `dispatch_s` enqueues the jitted
  step (argument handling; asynchronous, so it returns before the device finishes),
  `wait_s` blocks on the tokens (the device's compute not hidden behind the host's), and
  `compile_s` is the dispatch time of calls that traced (compiled) a new step.
  """
  steps: int = 0  # decode steps run (a block of U counts the steps it ran)
  dispatches: int = 0  # jitted calls (a block of U steps is one)
  prefill_tokens: int = 0  # prompt (and recomputed) positions computed
  decode_tokens: int = 0
  compilations: int = 0
  prefix_hit_tokens: int = 0
  preemptions: int = 0
  swaps_out: int = 0  # preemptions that copied pages to the host (preemption='swap')
  swaps_in: int = 0
  swapped_bytes: int = 0  # bytes copied to the host, summed over swaps
  allocated_slots: int = 0  # summed over steps and layers: pages held * Y
  used_slots: int = 0  # summed over steps and layers: positions held
  contiguous_slots: int = 0  # summed over steps and layers: max_len per running request
  host_s: float = 0.0
  dispatch_s: float = 0.0
  wait_s: float = 0.0
  compile_s: float = 0.0
  arrays_sent: int = 0  # host -> device arrays of the decode blocks' row state
  arrays_kept: int = 0  # the same, reused from the device (unchanged)

  @property
  def paged_waste(self) -> float:
    """Share of allocated cache slots not holding a position (over all steps)."""
    return 1 - self.used_slots / max(self.allocated_slots, 1)

  @property
  def contiguous_waste(self) -> float:
    """The same for a contiguous cache of max_len slots per running request."""
    return 1 - self.used_slots / max(self.contiguous_slots, 1)

  @property
  def host_share(self) -> float:
    """Host planning + dispatch as a share of the engine's time (compiles excluded)."""
    busy = self.host_s + self.dispatch_s + self.wait_s
    return (self.host_s + self.dispatch_s) / busy if busy else 0.0

  def timing(self) -> dict:
    """Milliseconds per decode step of each share, and the host share (a report row)."""
    per = 1e3 / max(self.steps, 1)
    return dict(steps=self.steps, dispatches=self.dispatches,
                host_ms_per_step=self.host_s * per, dispatch_ms_per_step=self.dispatch_s * per,
                wait_ms_per_step=self.wait_s * per, compile_s=self.compile_s,
                host_share=self.host_share)
