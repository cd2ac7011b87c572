"""Speculative decoding inside the serving engine: draft-verify rounds over paged caches.

    engine = SpeculativeEngine(target, draft, EngineConfig(...), gamma=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    engine.spec_stats.alpha, engine.spec_stats.tokens_per_pass

The draft (a quantized target, `layer_skip_draft`, any model of the same vocabulary) keeps
its own page pools, indexed by the target's block tables: the scheduler's pages hold both
models' keys and values for the same positions. Every step that prefills (a chunk of a
prompt, or a recompute after preemption) or admits a request runs as in `Engine`, and the
draft is fed the same tokens. A step where every running sequence decodes is a round
instead (one jitted function): the draft proposes gamma tokens per row (gamma + 1 draft
steps: the last feeds its final proposal, so the draft cache never lags), the target scores
[last token, d_1..d_gamma] in one forward, and `speculative_core.verify` accepts a prefix per
row, so rows advance by different lengths (1 to gamma + 1 tokens). Nothing is rolled back on
device: each row's cached length is host state, set at every step; slots past it are
hidden by the causal mask and rewritten before any query reads them.

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

from qjax.infer import page_host, paged, speculative_core
from qjax.infer.engine import Engine, EngineConfig
from qjax.infer.sampling import SamplingParams, processed_logits, row_keys
from qjax.infer.speculative import _ACCEPT, _DRAFT, _FINAL, SpecStats, check_compatible
from qjax.nn import validate
from qjax.nn.model_split import StaticGraphdef, merge
from qjax.nn.attention import kv_format


_TRACES = [0]  # how often `_feed` and `_round` were traced (= compiled), over every engine


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3,))
def _feed(dgraph, dstate, tokens_BT, dcache):
  _TRACES[0] += 1  # runs only while tracing
  draft = merge(dgraph, dstate)
  return paged.forward(draft, tokens_BT, dcache)[1]


@functools.partial(jax.jit, static_argnums=(0, 2, 4), donate_argnums=(5, 6))
def _round(tgraph, tstate, dgraph, dstate, gamma, tcache, dcache, cur_B, gen_B, params):
  """Draft gamma tokens per row, verify them with one target forward; see the docstring."""
  _TRACES[0] += 1  # runs only while tracing
  target, draft = merge(tgraph, tstate), merge(dgraph, dstate)

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
  b, x = x_BXD.shape[:2]
  logits_BXV = target.logits(x_BXD)
  # Non-finite target or draft logits: the row's first token is NON_FINITE (the request ends
  # with 'error'), never a draw from NaN.
  finite_B = validate.finite_rows(logits_BXV.reshape(b, -1)) & jnp.all(finite_XB, axis=0)
  p_BXV = processed_logits(logits_BXV.reshape(b * x, -1),
                           jax.tree.map(lambda a: jnp.repeat(a, x), params)).reshape(b, x, -1)
  uniform_BG = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(
      row_keys(params.seed_B, gen_B, _ACCEPT))
  num_acc_B, tokens_BX, beta_BG = speculative_core.verify(
      p_BXV, q_BGV, draft_BG, uniform_BG, row_keys(params.seed_B, gen_B, _FINAL))
  num_acc_B = jnp.where(finite_B, num_acc_B, 0)
  tokens_BX = tokens_BX.at[:, 0].set(jnp.where(finite_B, tokens_BX[:, 0], validate.NON_FINITE))
  return num_acc_B, tokens_BX, beta_BG, tcache, dcache


class SpeculativeEngine(Engine):
  """`Engine` whose decode steps are speculative rounds with `draft` (module docstring)."""

  def __init__(self, model: nnx.Module, draft: nnx.Module,
               config: Optional[EngineConfig] = None, tokenizer=None, *, gamma: int = 4):
    """Args:
      model: the target `Transformer` (its distribution is the output's).
      draft: a `Transformer` of the same vocabulary; its own KV format is used.
      config: as `Engine` (ring pages are turned off; preemption must be 'recompute').
      tokenizer: as `Engine`.
      gamma: draft tokens per round (>= 1).
    """
    check_compatible(model, draft, gamma)
    config = EngineConfig() if config is None else config
    if config.preemption != 'recompute':
      raise ValueError(f"SpeculativeEngine: preemption={config.preemption!r}; only "
                       "'recompute' is supported (a swap would have to copy the draft's "
                       'pages too).')
    super().__init__(model, dataclasses.replace(config, ring=False), tokenizer)
    if draft.config.max_len < self.max_len:
      raise ValueError(f'SpeculativeEngine: the draft config.max_len={draft.config.max_len} '
                       f'is below the engine max_len={self.max_len}.')
    self.draft, self.gamma = draft, gamma
    self.dcache = paged.init_paged_cache(
        draft.config, num_pages=self.config.num_pages, page_size=self.config.page_size,
        batch=self.config.max_batch, max_pages=self.max_pages, fmt=kv_format(draft))
    dgraph, self.dstate = nnx.split(draft)
    self.dgraph = StaticGraphdef(dgraph)  # hashed once, not on every call
    self._counts = dict(rounds=0, tokens=0, reached_G=np.zeros(gamma, np.int64),
                        accepted_G=np.zeros(gamma, np.int64), beta_sum_G=np.zeros(gamma))

  @property
  def spec_stats(self) -> SpecStats:
    """Acceptance statistics of the rounds so far (row-rounds; plain steps not counted)."""
    return SpecStats(gamma=self.gamma, **self._counts)

  def _prepare(self, prompt, params, request_id, taken=()):
    seq = super()._prepare(prompt, params, request_id, taken)
    if seq.params.repetition_penalty != 1:
      raise ValueError(f'SpeculativeEngine: repetition_penalty={seq.params.repetition_penalty}'
                       " is not supported (the penalised distribution would depend on the "
                       "round's draft tokens); use 1.0.")
    return seq

  def _feed_draft(self, tokens_N1, layout: dict) -> None:
    no_ring = np.zeros((len(layout['length']), 0))  # the draft's pools have no ring layers
    self.dcache = paged.with_step(self.dcache, **dict(layout, ring_table=no_ring))
    self.dcache = _feed(self.dgraph, self.dstate, jnp.asarray(tokens_N1), self.dcache)

  @staticmethod
  def _traces() -> int:
    return Engine._traces() + _TRACES[0]  # pylint: disable=protected-access

  def step(self) -> list[tuple[str, int]]:
    t0 = time.perf_counter()
    plan = self.scheduler.schedule()
    live = [s for s in plan.rows if s is not None]
    decoding = bool(live) and all(s.output and s.num_pending == 1 and
                                  s.max_tokens - len(s.output) > self.gamma for s in live)
    if decoding:
      before = self.scheduler.preemptions
      grown = all(self.scheduler.reserve(s, self.gamma + 1) for s in live)
      if grown and self.scheduler.preemptions == before:
        self.stats.host_s += time.perf_counter() - t0
        return self._speculate(plan)
      plan = self.scheduler.schedule()  # someone was preempted: plan again, plainly
    self.stats.host_s += time.perf_counter() - t0
    return self._run_plan(plan)

  def _speculate(self, plan) -> list[tuple[str, int]]:
    t0 = time.perf_counter()
    b, g = self.config.max_batch, self.gamma
    table = np.zeros((b, self.max_pages), np.int32)
    length, cur, gen = (np.zeros(b, np.int32) for _ in range(3))
    num_new = np.zeros(b, np.int32)
    params = [SamplingParams(temperature=0.0)] * b
    for row, seq in enumerate(plan.rows):
      if seq is not None:
        table[row, :len(seq.pages)] = seq.pages
        length[row], cur[row], gen[row] = seq.num_cached, seq.tokens[-1], len(seq.output)
        num_new[row], params[row] = 1, seq.params
    page_host.check_step([s.id for s in plan.rows if s is not None], length[num_new > 0],
                     (g + 1) * num_new[num_new > 0],
                     [len(s.pages) for s in plan.rows if s is not None],
                     self.config.page_size, self.max_len)
    ring = np.zeros(self.cache.ring_table.shape, np.int32)
    self.cache = paged.with_step(self.cache, table, ring, length, (g + 1) * num_new)
    self.dcache = paged.with_step(self.dcache, table, np.zeros((b, 0)), length, num_new)
    args = (jnp.asarray(cur), jnp.asarray(gen), self._sampling(params))
    self.stats.host_s += time.perf_counter() - t0
    num_acc, tokens, beta, self.cache, self.dcache = self._dispatch(
        _round, self.graphdef, self.state, self.dgraph, self.dstate, g, self.cache,
        self.dcache, *args)
    num_acc, tokens, beta = self._fetch((num_acc, tokens, beta))
    t0 = time.perf_counter()
    self.stats.steps += 1
    events = []
    for row, seq in enumerate(plan.rows):
      if seq is None:
        continue
      n = int(num_acc[row])
      if tokens[row, 0] < 0:  # non-finite logits: end it as the plain step does
        self.scheduler.fail(seq)
        continue
      c = self._counts
      c['rounds'] += 1
      c['tokens'] += n + 1
      c['reached_G'][:n + 1 if n < g else g] += 1
      c['accepted_G'][:n] += 1
      c['beta_sum_G'][:n + 1 if n < g else g] += beta[row, :n + 1 if n < g else g]
      self.stats.decode_tokens += 1
      seq.num_cached += n + 1
      for tok in tokens[row, :n + 1].tolist():
        seq.output.append(int(tok))
        events.append((seq.id, int(tok)))
        if self._finished(seq):
          seq.finished = True
          self.scheduler.release(seq)
          break
    self.stats.host_s += time.perf_counter() - t0
    return events
