"""Speculative decoding inside the serving engine: draft-verify rounds over paged caches.

    engine = SpeculativeEngine(target, draft, EngineConfig(...), gamma=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    engine.spec_stats.alpha, engine.spec_stats.tokens_per_pass

The draft (a quantized target, `layer_skip_draft`, any model of the same vocabulary) keeps
its own page pools, indexed by the target's block tables: the scheduler's pages hold both
models' keys and values for the same positions. Every step that prefills (a chunk of a
prompt, or a recompute after preemption) or admits a request runs as in `Engine`, and the
draft is fed the same tokens. A step where every running sequence decodes runs rounds
instead: up to `rounds_per_dispatch` of them in one dispatch, as steps of the library's one
decode loop (`qjax.nn.decode_core.run_block`). In a round the draft proposes gamma tokens
per row (gamma + 1 draft steps: the last feeds its final proposal, so the draft cache never
lags), the target scores [last token, d_1..d_gamma] in one forward, and
`speculative_core.verify` accepts a prefix per row, so rows advance by different lengths
(1 to gamma + 1 tokens). Nothing is rolled back: each row's cached length is set by the host
at every dispatch and advanced on the device by the tokens a round accepted; slots past it
are hidden by the causal mask and rewritten before any query reads them. The loop ends a row
at a stop token or once it has gamma tokens or fewer left (the plain steps finish it), and
the dispatch as soon as one row ends, so the rounds are those of one round per dispatch.

Exactness: tokens follow the target's processed distribution (greedy: token for token the
target's greedy decoding). Sampled requests draw from separate random streams in rounds
and in plain steps, and whether a step is a round depends on the other requests, so unlike
`Engine` a sampled request's tokens (not their distribution) depend on its batch. Limits:
recompute preemption only (a swap would have to copy the draft's pages too), no ring pages
(the draft shares the block table), no repetition penalty (as `speculative_generate`).
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

from qjax.infer import engine_inputs, paged
from qjax.infer.engine import Engine, EngineConfig
from qjax.infer.sampling import processed_logits, row_keys
from qjax.infer.speculative import _DRAFT, SpecStats, check_compatible, verify_round
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, run_block
from qjax.nn.model_split import StaticGraphdef, merge
from qjax.nn.attention import kv_format

FEED, ROUNDS = 'spec_engine.feed', 'spec_engine.rounds'  # trace names (`qjax.nn.traces`)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3,))
def _feed(dgraph, dstate, tokens_BT, dcache):
  traces.traced(FEED)
  draft = merge(dgraph, dstate)
  return paged.forward(draft, tokens_BT, dcache)[1]


def _round(target, draft, gamma, tcache, dcache, cur_B, gen_B, params):
  """Draft gamma tokens per row, verify them with one target forward; see the docstring."""

  def draft_step(carry, i):
    dcache, tok_B = carry
    x_B1D, dcache = paged.forward(draft, tok_B[:, None], dcache)
    logits_BV = draft.logits(x_B1D)[:, 0]
    q_logp_BV = processed_logits(logits_BV, params)
    keys_B = row_keys(params.seed_B, gen_B + i, _DRAFT)
    new_B = jax.vmap(jax.random.categorical)(keys_B, q_logp_BV).astype(jnp.int32)
    return (dcache, new_B), (new_B, q_logp_BV, validate.finite_rows(logits_BV))

  (dcache, _), (d_XB, q_XBV, finite_XB) = jax.lax.scan(draft_step, (dcache, cur_B),
                                                       jnp.arange(gamma + 1))
  draft_BG = d_XB[:gamma].swapaxes(0, 1)
  q_BGV = q_XBV[:gamma].swapaxes(0, 1)
  x_BXD, tcache = paged.forward(target, jnp.concatenate([cur_B[:, None], draft_BG], 1), tcache)
  # Non-finite target logits where the row used them, or draft logits of the row's own
  # context (the first draft step), end the request with 'error' (NON_FINITE first).
  num_acc_B, tokens_BX, beta_BG, _ = verify_round(
      target.logits(x_BXD), q_BGV, draft_BG, params, gen_B, finite_XB[0])
  num_acc_B = jnp.where(tokens_BX[:, 0] == validate.NON_FINITE, 0, num_acc_B)
  return num_acc_B, tokens_BX, beta_BG, tcache, dcache


@functools.partial(jax.jit, static_argnums=(0, 2, 4, 5), donate_argnums=(6, 7))
def _rounds(tgraph, tstate, dgraph, dstate, gamma, rounds, tcache, dcache, loop, params):
  """Up to `rounds` rounds on `decode_core.run_block`: each row's cached length advances on
  the device by the tokens it accepted. Returns (decoded, tcache, dcache, sums): per-row
  sums of the rounds' statistics (`_round_sums`)."""
  traces.traced(ROUNDS)
  target, draft = merge(tgraph, tstate), merge(dgraph, dstate)
  b = loop.tok_B.shape[0]

  def step(loop, ctx):
    tcache, dcache, sums = ctx
    live_B = loop.live_B.astype(jnp.int32)
    length_B = tcache.length
    tcache = dataclasses.replace(tcache, num_new=(gamma + 1) * live_B)
    dcache = dataclasses.replace(dcache, length=length_B, num_new=live_B)
    num_acc_B, tokens_BX, beta_BG, tcache, dcache = _round(
        target, draft, gamma, tcache, dcache, loop.tok_B, loop.count_B, params)
    length_B = length_B + live_B * (num_acc_B + 1)
    tcache = dataclasses.replace(tcache, length=length_B)
    dcache = dataclasses.replace(dcache, length=length_B)
    ok_B = loop.live_B & (tokens_BX[:, 0] >= 0)
    sums = jax.tree.map(jnp.add, sums, _round_sums(num_acc_B, beta_BG, ok_B))
    zero_BX = jnp.zeros(tokens_BX.shape, jnp.float32)
    return tokens_BX, zero_BX, num_acc_B + 1, loop.carry, (tcache, dcache, sums)

  none_B = jnp.zeros((b,), jnp.int32)
  zeros = _round_sums(none_B, jnp.zeros((b, gamma)), none_B > 0)
  # Ending the block once a row stops (finished, or too near its max_tokens for a round)
  # hands the host the decisions one round per dispatch would make: the same rounds.
  out, (tcache, dcache, sums) = run_block(step, loop, (tcache, dcache, zeros), rounds,
                                          width=gamma + 1, room=gamma, stop_early=True)
  nothing_B = jnp.zeros_like(tcache.num_new)
  return (out, dataclasses.replace(tcache, num_new=nothing_B),
          dataclasses.replace(dcache, num_new=nothing_B), sums)


def _round_sums(num_acc_B, beta_BG, ok_B):
  """A round's statistics per row (rows `ok_B` count): rounds, tokens, reached, accepted
  and 1 - TV summed over the draft positions a row reached."""
  g_G = jnp.arange(beta_BG.shape[1])
  reached_BG = (g_G <= num_acc_B[:, None]) & ok_B[:, None]
  return dict(rounds_B=ok_B.astype(jnp.int32), tokens_B=jnp.where(ok_B, num_acc_B + 1, 0),
              reached_BG=reached_BG.astype(jnp.int32),
              accepted_BG=((g_G < num_acc_B[:, None]) & ok_B[:, None]).astype(jnp.int32),
              beta_BG=jnp.where(reached_BG, beta_BG, 0.0))


class SpeculativeDecoding:
  """The decode policy of draft-verify rounds for a `Runner` (module docstring).

  Args:
    runner: the engine's `engine_runner.Runner` (its cache, dispatch, scheduler, booking).
    draft: the draft `Transformer`; its pools are built here, indexed by the target's
      block tables.
    gamma: draft tokens per round.
    rounds_per_dispatch: the most rounds one dispatch runs.
    num_pages, page_size, max_batch: the engine's pool geometry.
  """

  programs = (FEED, ROUNDS)
  queued = None  # rounds are read at once: nothing is ever queued

  def __init__(self, runner, draft: nnx.Module, *, gamma: int, rounds_per_dispatch: int,
               num_pages: int, page_size: int, max_batch: int):
    self.runner, self.gamma, self.rounds_per_dispatch = runner, gamma, rounds_per_dispatch
    self.dcache = paged.init_paged_cache(
        draft.config, num_pages=num_pages, page_size=page_size, batch=max_batch,
        max_pages=runner.max_pages, fmt=kv_format(draft))
    dgraph, self.dstate = nnx.split(draft)
    self.dgraph = StaticGraphdef(dgraph)  # hashed once, not on every call
    self.counts = dict(rounds=0, tokens=0, reached_G=np.zeros(gamma, np.int64),
                       accepted_G=np.zeros(gamma, np.int64), beta_sum_G=np.zeros(gamma))

  @property
  def stats(self) -> SpecStats:
    """Acceptance statistics of the rounds so far (row-rounds; plain steps not counted)."""
    return SpecStats(gamma=self.gamma, **self.counts)

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
    self.dcache = _feed(self.dgraph, self.dstate, jnp.asarray(x.tokens_N1), self.dcache)

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
    r.cache = paged.with_step(r.cache, x.table_BP, x.ring_BR, x.length_B,
                              (g + 1) * x.num_new_B)
    self.dcache = paged.with_step(self.dcache, x.table_BP, np.zeros((len(rows), 0)),
                                  x.length_B, x.num_new_B)
    loop = LoopState(**{f: jnp.asarray(v) for f, v in x.loop().items()})
    params = r.sampling(x.params)
    r.stats.host_s += time.perf_counter() - t0
    out, r.cache, self.dcache, sums = r.dispatch(
        _rounds, r.graphdef, r.state, self.dgraph, self.dstate, g, self.rounds_per_dispatch,
        r.cache, self.dcache, loop, params)
    tok_BW, num_B, steps, sums = r.fetch((out.tok_BW, out.num_B, out.steps, sums))
    t0 = time.perf_counter()
    c = self.counts
    for row in range(len(rows)):  # row by row, as one round per step books them
      c['beta_sum_G'] += sums['beta_BG'][row]
    c['rounds'] += int(sums['rounds_B'].sum())
    c['tokens'] += int(sums['tokens_B'].sum())
    c['reached_G'] += sums['reached_BG'].sum(0)
    c['accepted_G'] += sums['accepted_BG'].sum(0)
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
      rounds_per_dispatch: R, the most rounds one dispatch runs while every row goes on
        (pages are reserved for all of them); the host reads the tokens once per dispatch.
        The rounds, and so the tokens, are those of R = 1 unless pages run short.
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
