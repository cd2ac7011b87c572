"""Speculative decoding inside the serving engine: draft-verify rounds over paged caches.

    engine = SpeculativeEngine(target, draft, EngineConfig(...), gamma=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    engine.spec_stats.alpha, engine.spec_stats.tokens_per_pass

The draft (a quantized target, `layer_skip_draft`, any model of the same vocabulary) keeps
its own page pools, indexed by the target's page tables: the scheduler's pages hold both
models' keys and values for the same positions. Every step that prefills (a chunk of a
prompt, or a recompute after preemption) or admits a request runs as in `Engine`, and the
draft is fed the same tokens. A step where every running sequence decodes runs rounds
instead: up to `rounds_per_dispatch` of them in one dispatch, the program of
`qjax.infer.spec_round` (the round `speculative_generate` runs, here over the paged caches
through `paged.forward`). In a round the draft proposes gamma tokens per row, the target
scores [last token, d_1..d_gamma] in one forward, and `speculative_core.verify` accepts a
prefix per row, so rows advance by different lengths (1 to gamma + 1 tokens); after it the
draft's pages hold the same positions as the target's. Each row's cached length is set by
the host at every dispatch and advanced on the device by the tokens a round accepted; slots
past it are hidden by the causal mask and rewritten before any query reads them. The loop
ends a row at a stop token or once it has gamma tokens or fewer left (the plain steps finish
it), and the dispatch as soon as one row ends, so the rounds are those of one round per
dispatch.

Exactness: tokens follow the target's processed distribution (greedy: token for token the
target's greedy decoding). Sampled requests draw from separate random streams in rounds
and in plain steps, and whether a step is a round depends on the other requests, so unlike
`Engine` a sampled request's tokens (not their distribution) depend on its batch. Limits:
recompute preemption only (a swap would have to copy the draft's pages too), no ring pages
(the draft shares the page table), no repetition penalty (as `speculative_generate`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.infer import engine_inputs, paged, spec_round
from qjax.infer.engine import Engine, EngineConfig
from qjax.infer.speculative import SpecStats, check_compatible
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.decode_core import LoopState
from qjax.nn.model_split import StaticGraphdef, merge
from qjax.nn.attention import kv_format

FEED = 'spec_engine.feed'  # trace name (`qjax.nn.traces`); the rounds: `spec_round.ROUNDS`


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3,))
def _feed(dgraph, dstate, tokens_BT, dcache):
  traces.traced(FEED)
  draft = merge(dgraph, dstate)
  return paged.forward(draft, tokens_BT, dcache)[1]


class SpeculativeDecoding:
  """The decode policy of draft-verify rounds for a `Runner` (module docstring).

  Args:
    runner: the engine's `engine_runner.Runner` (its cache, dispatch, scheduler, booking).
    draft: the draft `Transformer`; its pools are built here, indexed by the target's
      page tables.
    gamma: draft tokens per round.
    rounds_per_dispatch: the most rounds one dispatch runs.
    num_pages, page_size, max_batch: the engine's pool geometry.
  """

  programs = (FEED, spec_round.ROUNDS)
  queued = None  # rounds are read at once: nothing is ever queued

  def __init__(self, runner, draft: nnx.Module, *, gamma: int, rounds_per_dispatch: int,
               num_pages: int, page_size: int, max_batch: int):
    self.runner, self.gamma, self.rounds_per_dispatch = runner, gamma, rounds_per_dispatch
    # A row stays in the rounds while it has more than gamma tokens left (the plain steps
    # finish it), and a dispatch ends once one row stops: the rounds of one per dispatch.
    self.how = spec_round.RoundConfig(gamma=gamma, block=rounds_per_dispatch,
                                      forward=paged.forward, room=gamma, stop_early=True)
    self.dcache = paged.init_paged_cache(
        draft.config, num_pages=num_pages, page_size=page_size, batch=max_batch,
        max_pages=runner.max_pages, fmt=kv_format(draft))
    dgraph, self.dstate = nnx.split(draft)
    self.dgraph = StaticGraphdef(dgraph)  # hashed once, not on every call
    # Acceptance statistics of the rounds so far (row-rounds; plain steps not counted).
    self.stats = SpecStats.from_sums(gamma)

  def check(self, seq) -> None:
    """Refuse a request the rounds cannot serve."""
    if seq.params.repetition_penalty != 1:
      raise ValueError(f'SpeculativeEngine: repetition_penalty={seq.params.repetition_penalty}'
                       " is not supported (the penalised distribution would depend on the "
                       "round's draft tokens); use 1.0.")

  def feed(self, x) -> None:
    """Feed the draft a plain step's tokens, into the same pages."""
    layout = x.layout()
    layout['ring_table'] = np.zeros((len(x.length_B), 0))  # the draft has no ring layers
    self.dcache = paged.with_step(self.dcache, **layout)
    self.dcache = _feed(self.dgraph, self.dstate, jnp.asarray(x.tokens_M1), self.dcache)

  def timed(self, started: float, steps: int) -> None:
    """Step times: not used here."""

  def compile(self, params) -> None:
    """The rounds compile when first run."""

  def run(self, plan) -> list[tuple[str, int]]:
    """Rounds when every running request decodes with more than gamma tokens left and its
    pages can be reserved without preempting; else one plain step."""
    t0, r = time.perf_counter(), self.runner
    sched = r.scheduler
    live = [s for s in plan.rows if s is not None]
    decoding = bool(live) and all(s.output and s.num_pending == 1 and
                                  s.max_tokens - len(s.output) > self.gamma for s in live)
    if decoding:
      before = sched.preemptions
      grown = all(sched.reserve(s, self._positions(s)) for s in live)
      if grown and sched.preemptions == before:
        r.stats.host_s += time.perf_counter() - t0
        return self._speculate(plan)
      plan = sched.schedule()  # someone was preempted: plan again, plainly
    r.stats.host_s += time.perf_counter() - t0
    return r.plain(plan)

  def _positions(self, seq) -> int:
    """Positions `seq` may write in one dispatch: gamma + 1 per round while it has more than
    gamma tokens left (the loop's `room`), so at most its max_tokens."""
    return min(self.rounds_per_dispatch * (self.gamma + 1), seq.max_tokens - len(seq.output))

  def _speculate(self, plan) -> list[tuple[str, int]]:
    t0, r = time.perf_counter(), self.runner
    rows, g = plan.rows, self.gamma
    x = engine_inputs.build(rows, [int(s is not None) for s in rows],
                            max_pages=r.max_pages, ring_width=r.ring_width)
    engine_inputs.check(rows, [0 if s is None else self._positions(s) for s in rows],
                        r.page_size, r.max_len)
    r.cache = paged.with_step(r.cache, x.table_BE, x.ring_BE, x.length_B,
                              (g + 1) * x.num_new_B)
    self.dcache = paged.with_step(self.dcache, x.table_BE, np.zeros((len(rows), 0)),
                                  x.length_B, x.num_new_B)
    loop = LoopState(**{f: jnp.asarray(v) for f, v in x.loop().items()})
    params = r.sampling(x.params)
    r.stats.host_s += time.perf_counter() - t0
    out, r.cache, self.dcache, sums = r.dispatch(
        spec_round.rounds, r.graphdef, r.state, self.dgraph, self.dstate, self.how, r.cache,
        self.dcache, loop, params)
    tok_BW, num_B, steps, sums = r.fetch((out.tok_BW, out.num_B, out.steps, sums))
    t0 = time.perf_counter()
    self.stats += SpecStats.from_sums(g, sums)
    events = r.booking.book(rows, [1] * len(rows), tok_BW, num_B, steps=int(steps))
    r.stats.host_s += time.perf_counter() - t0
    return events


class SpeculativeEngine(Engine):
  """`Engine` whose decode steps are speculative rounds with `draft` (module docstring): the
  same engine, built with the `SpeculativeDecoding` policy."""

  def __init__(self, model: nnx.Module, draft: nnx.Module,
               config: Optional[EngineConfig] = None, tokenizer=None, *, gamma: int = 4,
               rounds_per_dispatch: int = 1):
    """Args:
      model: the target `Transformer` (its distribution is the output's).
      draft: a `Transformer` of the same vocabulary; its own KV format is used.
      config: as `Engine` (ring pages are turned off; preemption must be 'recompute').
      tokenizer: as `Engine`.
      gamma: draft tokens per round (>= 1).
      rounds_per_dispatch: the most rounds one dispatch runs while every row goes on
        (pages are reserved for all of them); the host reads the tokens once per dispatch.
        The rounds, and so the tokens, are those of one round per dispatch unless pages run
        short.
    """
    check_compatible(model, draft, gamma)
    rounds = validate.count(rounds_per_dispatch, 'rounds_per_dispatch', 'SpeculativeEngine')
    config = EngineConfig() if config is None else config
    if config.preemption != 'recompute':
      raise ValueError(f"SpeculativeEngine: preemption={config.preemption!r}; only "
                       "'recompute' is supported (a swap would have to copy the draft's "
                       'pages too).')
    config = dataclasses.replace(config, ring=False)
    super().__init__(model, config, tokenizer, decoding=lambda runner: SpeculativeDecoding(
        runner, draft, gamma=gamma, rounds_per_dispatch=rounds, num_pages=config.num_pages,
        page_size=config.page_size, max_batch=config.max_batch))
    if draft.config.max_len < self.max_len:
      raise ValueError(f'SpeculativeEngine: the draft config.max_len={draft.config.max_len} '
                       f'is below the engine max_len={self.max_len}.')
    self.draft, self.gamma, self.rounds_per_dispatch = draft, gamma, rounds

  @property
  def spec_stats(self) -> SpecStats:
    """Acceptance statistics of the rounds so far (row-rounds; plain steps not counted)."""
    return self.policy.stats
