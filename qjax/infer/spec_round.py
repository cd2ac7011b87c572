"""One draft-verify round of speculative decoding, written once for every cache that has a
`forward`.

    how = RoundConfig(gamma=4, block=8, forward=kvcache.forward)   # or paged.forward
    decoded, tcache, dcache, sums = rounds(tgraph, tstate, dgraph, dstate, how,
                                           tcache, dcache, loop, params)

`speculative_generate` (contiguous `KVCache`s) and the engine's `SpeculativeDecoding` (paged
caches) both dispatch this program. A cache takes part through two things:

* `forward(model, tokens_BT, cache, num_new_B) -> (x_BTD, cache)`: the model's blocks over
  the cache, row b's T tokens at positions `cache.length[b] + 0..T-1`, and the returned
  cache's `length` advanced by num_new_B (0 for a finished row, which still runs: the shapes
  are fixed). Slots past a row's length are hidden by the causal mask and rewritten before a
  query reads them. `qjax.nn.kvcache.forward` and `qjax.infer.paged.forward` implement it.
* `length`, int32 (B,), replaced (`dataclasses.replace`) to roll a row back.

One round, per row: the draft feeds the last emitted token `cur` and then its own proposals,
drawing d_1..d_gamma from `processed_logits` of its logits; the target feeds [cur, d_1..
d_gamma] (gamma + 1 positions) in one forward; `verify_round` accepts a prefix of a tokens and
draws the next one; both caches' lengths become the round's start length + a + 1. So between
rounds the draft's cache holds exactly the target's positions: where a row accepted all gamma
tokens the draft still has to feed d_gamma, which it does in one more forward without the head,
run (`lax.cond`) only when some row needs it. Up to `block` rounds run in one dispatch as
steps of the library's one decode loop (`qjax.nn.decode_core.run_block`).

Random streams per row: `row_keys(seed, output position, stream)`, separate streams for the
draft's draws, the acceptance uniforms and the residual / bonus draw, so a row's tokens do not
depend on its batch or on the rounds per dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from qjax.infer import speculative_core
from qjax.infer.sampling import processed_logits, row_keys
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, run_block
from qjax.nn.model_split import merge

ROUNDS = 'spec_round.rounds'  # trace name (`qjax.nn.traces`)
_DRAFT, _ACCEPT, _FINAL = 2, 1, 3  # random streams (row_keys' `stream`)

# forward(model, tokens_BT, cache, num_new_B) -> (x_BTD, cache advanced by num_new_B).
Forward = Callable[[Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class RoundConfig:
  """What a `rounds` program runs (static: one compilation per value).

  Attributes:
    gamma: draft tokens per round.
    block: the most rounds one dispatch runs.
    forward: the caches' forward (module docstring).
    room: a row stays live while it has more than `room` tokens left (`run_block`); 0 lets
      a round emit past a row's limit (the caller cuts).
    stop_early: end the dispatch once some row stopped.
    measure_kl: also sum KL(emitted law || target law) per draft position (`kl_BA`).
  """

  gamma: int
  block: int
  forward: Forward
  room: int = 0
  stop_early: bool = False
  measure_kl: bool = False


def _set_length(cache, length_B):
  return dataclasses.replace(cache, length=length_B)


def draft_tokens(draft, forward: Forward, gamma: int, dcache, cur_B, live_B, gen_B, params):
  """The draft's gamma proposals per row: (draft_BA, q_BAV, finite_B, dcache); finite_B says
  whether the first step's logits (of the row's own context) were finite."""

  def step(carry, i):
    dcache, tok_B = carry
    x_B1D, dcache = forward(draft, tok_B[:, None], dcache, live_B)
    logits_BV = draft.logits(x_B1D)[:, 0]
    q_logp_BV = processed_logits(logits_BV, params)
    keys_B = row_keys(params.seed_B, gen_B + i, _DRAFT)
    new_B = jax.vmap(jax.random.categorical)(keys_B, q_logp_BV).astype(jnp.int32)
    return (dcache, new_B), (new_B, q_logp_BV, validate.finite_rows(logits_BV))

  (dcache, _), (d_AB, q_ABV, finite_AB) = lax.scan(step, (dcache, cur_B), jnp.arange(gamma))
  return d_AB.swapaxes(0, 1), q_ABV.swapaxes(0, 1), finite_AB[0], dcache


def verify_round(logits_BXV, q_BAV, draft_BA, params, gen_B, draft_finite_B):
  """Verify a round's gamma draft tokens against the target's logits over [cur, drafts]
  (`speculative_core.verify` on the processed distributions, with the acceptance and final
  streams of each row's keys at its round start gen_B). Returns (num_acc_B, tokens_BX,
  beta_BA, p_BXV); a row whose target logits at a position it used (the accepted prefix and
  the final draw), or whose first draft logits (`draft_finite_B`, of the row's own context),
  were not finite gets NON_FINITE as its first token, which ends it (never a draw from NaN).
  Non-finite logits after a draft token the target rejects belong to that proposal, not to
  the request: a draft position with non-finite logits is rejected, and the final token
  is drawn from the target's distribution there, so the row goes on."""
  b, x = logits_BXV.shape[:2]
  p_BXV = processed_logits(logits_BXV.reshape(b * x, -1),
                           jax.tree.map(lambda a: jnp.repeat(a, x), params)).reshape(b, x, -1)
  uniform_BA = jax.vmap(lambda k: jax.random.uniform(k, (x - 1,)))(
      row_keys(params.seed_B, gen_B, _ACCEPT))
  # (The uniforms and final key are per round start gen_B: a key is reused only by a later
  # round at the same output position, whose history never depended on it.)
  num_acc_B, tokens_BX, beta_BA = speculative_core.verify(
      p_BXV, q_BAV, draft_BA, uniform_BA, row_keys(params.seed_B, gen_B, _FINAL))
  finite_BX = validate.finite_rows(logits_BXV.reshape(b * x, -1)).reshape(b, x)
  used_BX = jnp.arange(x)[None] <= num_acc_B[:, None]
  finite_B = jnp.all(finite_BX | ~used_BX, axis=1) & draft_finite_B
  tokens_BX = tokens_BX.at[:, 0].set(jnp.where(finite_B, tokens_BX[:, 0], validate.NON_FINITE))
  return num_acc_B, tokens_BX, beta_BA, p_BXV


def one_round(target, draft, how: RoundConfig, params, loop: LoopState, tcache, dcache):
  """One draft-verify round of every row (module docstring): (tokens_BX, num_B, tcache,
  dcache, stats), the first num_B of the X = gamma + 1 tokens emitted (the first is
  NON_FINITE where a logit was not); stats per row (`zero_stats`), rows that are live and
  finite counted."""
  gamma, forward = how.gamma, how.forward
  live_B, cur_B, gen_B = loop.live_B, loop.tok_B, loop.count_B
  feed_B = live_B.astype(jnp.int32)
  length_B = tcache.length
  dcache = _set_length(dcache, length_B)  # the draft holds the target's positions
  draft_BA, q_BAV, draft_finite_B, dcache = draft_tokens(
      draft, forward, gamma, dcache, cur_B, feed_B, gen_B, params)
  x_BXD, tcache = forward(target, jnp.concatenate([cur_B[:, None], draft_BA], axis=1),
                          tcache, (gamma + 1) * feed_B)
  num_acc_B, tokens_BX, beta_BA, p_BXV = verify_round(
      target.logits(x_BXD), q_BAV, draft_BA, params, gen_B, draft_finite_B)
  ok_B = live_B & (tokens_BX[:, 0] >= 0)
  num_acc_B = jnp.where(ok_B, num_acc_B, 0)  # a non-finite row keeps one position at most
  # Rows that accepted every proposal need d_gamma in the draft's cache too.
  full_B = ok_B & (num_acc_B == gamma)
  feed_last = lambda c: forward(draft, draft_BA[:, -1:], c, full_B.astype(jnp.int32))[1]
  dcache = lax.cond(jnp.any(full_B), feed_last, lambda c: c, dcache)
  new_length_B = length_B + feed_B * (num_acc_B + 1)
  tcache, dcache = _set_length(tcache, new_length_B), _set_length(dcache, new_length_B)

  pos_A = jnp.arange(gamma)
  reached_BA = (pos_A <= num_acc_B[:, None]) & ok_B[:, None]
  stats = dict(rounds_B=ok_B.astype(jnp.int32), tokens_B=jnp.where(ok_B, num_acc_B + 1, 0),
               reached_BA=reached_BA.astype(jnp.int32),
               accepted_BA=((pos_A < num_acc_B[:, None]) & ok_B[:, None]).astype(jnp.int32),
               beta_BA=jnp.where(reached_BA, beta_BA, 0.0))
  if how.measure_kl:
    p_BAV = p_BXV[:, :gamma]
    kl_BA = speculative_core.kl_divergence(
        speculative_core.emitted_distribution(p_BAV, q_BAV), p_BAV)
    stats['kl_BA'] = jnp.where(reached_BA, kl_BA, 0.0)
  return tokens_BX, num_acc_B + 1, tcache, dcache, stats


def zero_stats(b: int, how: RoundConfig) -> dict:
  """Per-row sums of `one_round`'s statistics, all zero: rounds_B, tokens_B (emitted),
  reached_BA and accepted_BA (per draft position), beta_BA (1 - TV(p, q) summed over the
  reached positions) and, with `measure_kl`, kl_BA."""
  zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
  g = how.gamma
  out = dict(rounds_B=zeros(b), tokens_B=zeros(b), reached_BA=zeros(b, g),
             accepted_BA=zeros(b, g), beta_BA=zeros(b, g, dtype=jnp.float32))
  if how.measure_kl:
    out['kl_BA'] = zeros(b, g, dtype=jnp.float32)
  return out


@functools.partial(jax.jit, static_argnums=(0, 2, 4), donate_argnums=(5, 6))
def rounds(tgraph, tstate, dgraph, dstate, how: RoundConfig, tcache, dcache, loop: LoopState,
           params):
  """Up to `how.block` rounds on `decode_core.run_block` (fewer once no row is live, or with
  `stop_early` once a row stopped); each row's cached length advances on the device by the
  tokens it accepted.

  Args:
    tgraph, tstate: the target's split (`split_for_decode` / `StaticGraphdef` graphdef).
    dgraph, dstate: the draft's.
    how: the `RoundConfig`.
    tcache, dcache: the target's and draft's caches (donated), at one length per row.
    loop: the rows' `LoopState` (cur = tok_B, output position = count_B).
    params: the rows' `SamplingBatch`.

  Returns:
    (decoded, tcache, dcache, sums): the `Decoded` tokens, the caches, and per-row sums of
    the rounds' statistics (`zero_stats`).
  """
  traces.traced(ROUNDS)
  target, draft = merge(tgraph, tstate), merge(dgraph, dstate)

  def step(loop, ctx):
    tcache, dcache, sums = ctx
    tokens_BX, num_B, tcache, dcache, stats = one_round(target, draft, how, params, loop,
                                                        tcache, dcache)
    zero_BX = jnp.zeros(tokens_BX.shape, jnp.float32)
    return tokens_BX, zero_BX, num_B, loop.carry, (tcache, dcache,
                                                   jax.tree.map(jnp.add, sums, stats))

  ctx = (tcache, dcache, zero_stats(loop.tok_B.shape[0], how))
  out, (tcache, dcache, sums) = run_block(step, loop, ctx, how.block, width=how.gamma + 1,
                                          room=how.room, stop_early=how.stop_early)
  return out, tcache, dcache, sums
