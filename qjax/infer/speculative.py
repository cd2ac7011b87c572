"""Speculative decoding: a cheap draft proposes gamma tokens, the target verifies them in one pass.

    from qjax.infer import SamplingParams, speculative_generate, layer_skip_draft
    draft = quantize_model(target, policy)[0]        # (a) self-draft, any qjax policy
    draft = layer_skip_draft(target, num_layers=2)   # (b) the first k layers + the head
    tokens_BT, stats = speculative_generate(target, draft, prompt_BT, max_tokens=32,
                                            params=SamplingParams(temperature=0.7), gamma=4)
    stats.alpha, stats.alpha_tv, stats.tokens_per_pass, stats.expected_tokens_per_pass

One round (a function of both models; `rounds_per_dispatch` of them run in one dispatch,
as steps of the library's one decode loop, `qjax.nn.decode_core.run_block`, so the host
reads the tokens and done flags once per dispatch): the draft decodes
gamma tokens with its own KV cache, drawing each from `processed_logits` of its logits; the
target feeds the last emitted token and the gamma draft tokens (gamma + 1 positions) through
its cache in one forward; `speculative_core.verify` accepts a prefix and draws the next
token; both caches roll back to the accepted length by lowering each row's `length` (slots
at or past a row's length are hidden by the causal mask and rewritten by the next round).
Rows accept different numbers of tokens, so every row keeps its own length, output count and
done flag.

Exactness: every emitted token follows the target's processed distribution (temperature,
top-k, top-p, min-p; greedy when temperature is 0, where the output is token for token
`greedy_generate` of the target). The repetition penalty is refused: its distribution would
depend on the draft tokens of the same round. Random streams are per row:
`row_keys(seed, output position, stream)` with separate streams for the draft's draws, the
acceptance uniforms and the residual / bonus draw.

Cache bookkeeping: the target's cache holds every token but the last emitted one (`cur`).
The draft's does too, except after a round that accepted all gamma tokens: the draft never
fed its own last proposal, so that row carries it as `pending` and the next round's first
draft step feeds two tokens [pending, cur] (rows without one feed [cur, cur] and count one;
the extra slot sits past the row's length, hidden).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.infer import speculative_core
from qjax.infer.sampling import SamplingParams, as_batch, processed_logits, row_keys
from qjax.nn import kvcache
from qjax.nn.attention import kv_format
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, run_block, stop_table
from qjax.nn.generate import logits_step
from qjax.nn.model_split import merge, split_for_decode
from qjax.nn.transformer import Transformer

_DRAFT, _ACCEPT, _FINAL = 2, 1, 3  # random streams (row_keys' `stream`)


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """What a speculative run measured (sums over rows and rounds; rows count while not done).

  Attributes:
    gamma: draft tokens per round.
    rounds: target verification passes summed over rows (prefill not counted).
    tokens: tokens emitted by those passes (before cutting to max_tokens).
    reached_G: per draft position, how often a round reached it (all before it accepted).
    accepted_G: per draft position, how often it was accepted.
    beta_sum_G: per draft position, the sum of 1 - TV(p, q) over the rounds that reached it.
    kl_sum_G: per draft position, the sum over reached rounds of KL(emitted law || p), the
      emitted law computed from p and q (`speculative_core.emitted_distribution`); 0 up to
      float rounding when the verification is exact. None where not measured.
  """

  gamma: int
  rounds: int
  tokens: int
  reached_G: np.ndarray
  accepted_G: np.ndarray
  beta_sum_G: np.ndarray
  kl_sum_G: Optional[np.ndarray] = None

  @property
  def acceptance_by_position(self) -> np.ndarray:
    return self.accepted_G / np.maximum(self.reached_G, 1)

  @property
  def alpha(self) -> float:
    """Measured per-position acceptance rate: accepted / reached over all positions."""
    return float(self.accepted_G.sum() / max(self.reached_G.sum(), 1))

  @property
  def alpha_tv(self) -> float:
    """The same estimated from the distributions: mean of 1 - TV(p, q) at reached positions."""
    return float(self.beta_sum_G.sum() / max(self.reached_G.sum(), 1))

  @property
  def kl_exact(self) -> float:
    """Mean KL(emitted law || target law) over reached positions (nan when not measured)."""
    if self.kl_sum_G is None:
      return float('nan')
    return float(self.kl_sum_G.sum() / max(self.reached_G.sum(), 1))

  @property
  def tokens_per_pass(self) -> float:
    """Mean tokens emitted per target pass (the mean accepted length, bonus included)."""
    return self.tokens / max(self.rounds, 1)

  @property
  def passes_per_token(self) -> float:
    return self.rounds / max(self.tokens, 1)

  @property
  def expected_tokens_per_pass(self) -> float:
    """Leviathan et al.'s (1 - alpha^(gamma+1)) / (1 - alpha) at the measured alpha."""
    return float(speculative_core.expected_tokens_per_pass(self.alpha, self.gamma))

  def row(self) -> dict:
    """The headline numbers as a flat dict (a sweep row)."""
    return dict(gamma=self.gamma, alpha=self.alpha, alpha_tv=self.alpha_tv,
                tokens_per_pass=self.tokens_per_pass,
                expected_tokens_per_pass=self.expected_tokens_per_pass,
                passes_per_token=self.passes_per_token, rounds=self.rounds,
                tokens=self.tokens, kl_exact=self.kl_exact,
                acceptance_by_position=[float(a) for a in self.acceptance_by_position])


def layer_skip_draft(model: Transformer, num_layers: int) -> Transformer:
  """The target's first `num_layers` blocks, its final norm and head, sharing its arrays.

  Args:
    model: the target.
    num_layers: k, in [1, model.config.num_layers].

  Returns:
    A `Transformer` whose config has num_layers=k; its modules are the target's own (no copy),
    so quantizing or training the target changes the draft too.
  """
  cfg = model.config
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f'layer_skip_draft: num_layers={num_layers} must be in [1, '
                     f'{cfg.num_layers}] (the target has {cfg.num_layers} blocks).')
  dcfg = cfg.replace(num_layers=num_layers)
  draft = nnx.eval_shape(lambda: Transformer(dcfg, rngs=nnx.Rngs(0)))
  draft.embed, draft.final_norm, draft.lm_head = model.embed, model.final_norm, model.lm_head
  draft.layers = nnx.List(list(model.layers)[:num_layers])
  return draft


def check_compatible(target, draft, gamma: int, target_tokenizer=None,
                     draft_tokenizer=None) -> None:
  """Raise unless `draft` can draft for `target`: same vocabulary (and tokenizer), gamma >= 1."""
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f'speculative: gamma={gamma!r} must be an int >= 1 (draft tokens per '
                     'target pass).')
  tv, dv = target.config.vocab_size, draft.config.vocab_size
  if tv != dv:
    raise ValueError(f'speculative: the draft has vocab_size={dv} but the target {tv}; a '
                     'draft must share the target vocabulary (use a draft of the same family).')
  if (target_tokenizer is None) != (draft_tokenizer is None):
    raise ValueError('speculative: pass both tokenizers or neither.')
  if target_tokenizer is not None and target_tokenizer is not draft_tokenizer:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
      raise ValueError('speculative: the draft and target tokenizers map tokens to different '
                       'ids; token ids would mean different text. Use the same tokenizer.')


@functools.partial(jax.jit, static_argnums=(0, 2, 4, 8), donate_argnums=(6,))
def _rounds(tgraph, tstate, dgraph, dstate, gamma, params, ctx, loop: LoopState, rounds: int):
  """Up to `rounds` draft-verify rounds on `decode_core.run_block` (fewer once every row is
  done); returns (ctx, the rounds' `Decoded` tokens, their stats summed)."""
  target, draft = merge(tgraph, tstate), merge(dgraph, dstate)
  zeros = jax.eval_shape(lambda c: _round(target, draft, gamma, params, loop, c)[3], ctx)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zeros)

  def step(loop, ctx):
    ctx, totals = ctx
    tokens_BX, num_B, ctx, stats = _round(target, draft, gamma, params, loop, ctx)
    zero_BX = jnp.zeros(tokens_BX.shape, jnp.float32)
    return tokens_BX, zero_BX, num_B, loop.carry, (ctx, jax.tree.map(jnp.add, totals, stats))

  out, (ctx, totals) = run_block(step, loop, (ctx, zeros), rounds, width=gamma + 1)
  return ctx, out, totals


def _round(target, draft, gamma, params, loop, ctx):
  """One draft-verify round for every row: (tokens_BX, num_B, ctx, stats), the first num_B
  of the X = gamma + 1 tokens accepted (the first is NON_FINITE where a logit was not)."""
  tcache, dcache = ctx['tcache'], ctx['dcache']
  cur_B, pend_B, has_pend_B = loop.tok_B, ctx['pending_B'], ctx['has_pending_B']
  gen_B, live_B = loop.count_B, loop.live_B

  # Finished rows still run (fixed shapes) but keep their lengths; their writes go to slots
  # past the length, moved down where the cache would overflow (those rows are never read).
  t_len_B, d_len_B = tcache.length, dcache.length
  park = lambda len_B, c: jnp.where(live_B, len_B, jnp.minimum(len_B, c.max_len - gamma - 1))
  tcache = dataclasses.replace(tcache, length=park(t_len_B, tcache))
  dcache = dataclasses.replace(dcache, length=park(d_len_B, dcache))

  # Draft step 0: [pending, cur] (two new tokens) or [cur, cur] (one; the second is hidden).
  feed_B2 = jnp.stack([jnp.where(has_pend_B, pend_B, cur_B), cur_B], axis=1)
  d_start_B = dcache.length
  logits_B2V, dcache = draft(feed_B2, cache=dcache)
  dcache = dataclasses.replace(dcache, length=d_start_B + 1 + has_pend_B.astype(jnp.int32))
  logits_BV = jnp.where(has_pend_B[:, None], logits_B2V[:, 1], logits_B2V[:, 0])

  def draw(logits_BV, i):
    q_logp_BV = processed_logits(logits_BV, params)
    keys_B = row_keys(params.seed_B, gen_B + i, _DRAFT)
    return jax.vmap(jax.random.categorical)(keys_B, q_logp_BV).astype(jnp.int32), q_logp_BV

  d_B, q_BV = draw(logits_BV, 0)

  def step(carry, i):
    dcache, d_B = carry
    logits_B1V, dcache = draft(d_B[:, None], cache=dcache)
    nd_B, q_BV = draw(logits_B1V[:, 0], i)
    return (dcache, nd_B), (nd_B, q_BV)

  (dcache, _), (ds_GB, qs_GBV) = jax.lax.scan(step, (dcache, d_B), jnp.arange(1, gamma))
  draft_BG = jnp.concatenate([d_B[:, None], ds_GB.swapaxes(0, 1)], axis=1)
  q_BGV = jnp.concatenate([q_BV[:, None], qs_GBV.swapaxes(0, 1)], axis=1)

  # The target scores cur and the gamma draft tokens in one forward.
  logits_BXV, tcache = target(jnp.concatenate([cur_B[:, None], draft_BG], axis=1),
                              cache=tcache)
  num_acc_B, tokens_BX, beta_BG, p_BXV = verify_round(
      logits_BXV, q_BGV, draft_BG, params, gen_B, validate.finite_rows(logits_BV))
  kl_BG = speculative_core.kl_divergence(
      speculative_core.emitted_distribution(p_BXV[:, :gamma], q_BGV), p_BXV[:, :gamma])
  num_new_B = num_acc_B + 1
  full_B = num_acc_B == gamma
  new_t_len_B = jnp.where(live_B, t_len_B + num_new_B, t_len_B)
  new_d_len_B = jnp.where(live_B, new_t_len_B - full_B.astype(jnp.int32), d_len_B)
  ctx = dict(tcache=dataclasses.replace(tcache, length=new_t_len_B),
             dcache=dataclasses.replace(dcache, length=new_d_len_B),
             pending_B=jnp.where(live_B, draft_BG[:, -1], pend_B),
             has_pending_B=jnp.where(live_B, full_B, has_pend_B))
  reached_BG = (jnp.arange(gamma)[None] <= num_acc_B[:, None]) & live_B[:, None]
  accepted_BG = (jnp.arange(gamma)[None] < num_acc_B[:, None]) & live_B[:, None]
  stats = dict(rounds=jnp.sum(live_B), tokens=jnp.sum(jnp.where(live_B, num_new_B, 0)),
               reached_G=jnp.sum(reached_BG, 0), accepted_G=jnp.sum(accepted_BG, 0),
               beta_sum_G=jnp.sum(jnp.where(reached_BG, beta_BG, 0.0), 0),
               kl_sum_G=jnp.sum(jnp.where(reached_BG, kl_BG, 0.0), 0))
  return tokens_BX, num_new_B, ctx, stats


def verify_round(logits_BXV, q_BGV, draft_BG, params, gen_B, draft_finite_B):
  """Verify a round's gamma draft tokens against the target's logits over [cur, drafts]
  (`speculative_core.verify` on the processed distributions, with the acceptance and final
  streams of each row's keys at its round start gen_B). Returns (num_acc_B, tokens_BX,
  beta_BG, p_BXV); a row whose target logits at a position it used (the accepted prefix and
  the final draw), or whose first draft logits (`draft_finite_B`, of the row's own context),
  were not finite gets NON_FINITE as its first token, which ends it (never a draw from NaN).
  Non-finite logits after a draft token the target rejects belong to that proposal, not to
  the request: a draft position with non-finite logits is rejected, and the final token
  is drawn from the target's distribution there, so the row goes on."""
  b, x = logits_BXV.shape[:2]
  p_BXV = processed_logits(logits_BXV.reshape(b * x, -1),
                           jax.tree.map(lambda a: jnp.repeat(a, x), params)).reshape(b, x, -1)
  uniform_BG = jax.vmap(lambda k: jax.random.uniform(k, (x - 1,)))(
      row_keys(params.seed_B, gen_B, _ACCEPT))
  # (The uniforms and final key are per round start gen_B: a key is reused only by a later
  # round at the same output position, whose history never depended on it.)
  num_acc_B, tokens_BX, beta_BG = speculative_core.verify(
      p_BXV, q_BGV, draft_BG, uniform_BG, row_keys(params.seed_B, gen_B, _FINAL))
  finite_BX = validate.finite_rows(logits_BXV.reshape(b * x, -1)).reshape(b, x)
  used_BX = jnp.arange(x)[None] <= num_acc_B[:, None]
  finite_B = jnp.all(finite_BX | ~used_BX, axis=1) & draft_finite_B
  tokens_BX = tokens_BX.at[:, 0].set(jnp.where(finite_B, tokens_BX[:, 0], validate.NON_FINITE))
  return num_acc_B, tokens_BX, beta_BG, p_BXV


def _prefill(model, prompt_BT, cache):
  if prompt_BT.shape[1] == 0:
    return cache
  return logits_step(model, prompt_BT, cache)[1]


def speculative_generate(target, draft, prompt_BT, max_tokens: int, params=None,
                         gamma: int = 4, target_tokenizer=None, draft_tokenizer=None,
                         return_state: bool = False, rounds_per_dispatch: int = 4):
  """Sample `max_tokens` tokens from `target` with `draft` proposing `gamma` per pass.

  Args:
    target: the `Transformer` whose distribution the output follows.
    draft: any `Transformer` with the same vocabulary (quantized target, `layer_skip_draft`,
      a separate small model); its own KV format is used for its cache.
    prompt_BT: int token ids, the same length T >= 1 for every row.
    max_tokens: tokens to generate per row (>= 1).
    params: one `SamplingParams` for every row (default greedy), or a list of B; temperature,
      top-k, top-p, min-p, seed and stop_tokens are used; repetition_penalty must be 1.
    gamma: draft tokens per target pass (>= 1).
    target_tokenizer, draft_tokenizer: optional; checked to map tokens to the same ids.
    return_state: also return the final state (dict: 'tcache', 'dcache', 'cur_B',
      'pending_B', 'has_pending_B', 'gen_B', 'out_BN'), e.g. to check the caches.
    rounds_per_dispatch: rounds run on the device per dispatch (a `lax.while_loop`; it stops
      once every row is done); the host reads the done flags and stats once per dispatch.
      The tokens do not depend on it.

  Returns:
    (tokens_B(T+max_tokens), stats[, state]): prompt + output (after a row's first stop
    token the row repeats it, so rows keep one width; `truncate_at_stop` cuts it), and a
    `SpecStats`.
  """
  check_compatible(target, draft, gamma, target_tokenizer, draft_tokenizer)
  max_tokens = validate.count(max_tokens, 'max_tokens', 'speculative_generate')
  prompt_BT = jnp.asarray(validate.token_ids(prompt_BT, target.config.vocab_size,
                                             'speculative_generate', ndim=2), jnp.int32)
  b, t = prompt_BT.shape
  params = SamplingParams(temperature=0.0) if params is None else params
  plist = [params] * b if isinstance(params, SamplingParams) else list(params)
  for p in plist:
    if p.repetition_penalty != 1:
      raise ValueError(f'speculative_generate: repetition_penalty={p.repetition_penalty} is '
                       'not supported (the penalised distribution would depend on the '
                       "round's draft tokens); use 1.0.")
    p.check_vocab(target.config.vocab_size)
  batch = as_batch(plist, b)
  need = t + max_tokens + gamma - 1  # the most slots a live row writes during a round
  for name, model in (('target', target), ('draft', draft)):
    if need > model.config.max_len:
      raise ValueError(f'speculative_generate: prompt {t} + max_tokens {max_tokens} + gamma '
                       f'{gamma} - 1 = {need} exceeds the {name} config.max_len='
                       f'{model.config.max_len}; generate fewer tokens or lower gamma.')
  # Room for rows that finished early to keep running a round past their end (_round).
  size = min(need + gamma + 1, target.config.max_len, draft.config.max_len)
  tcache = _prefill(target, prompt_BT[:, :-1],
                    kvcache.init_cache(target.config, b, size, fmt=kv_format(target)))
  dcache = _prefill(draft, prompt_BT[:, :-1],
                    kvcache.init_cache(draft.config, b, size, fmt=kv_format(draft)))
  stop_BS = stop_table([p.stop_tokens for p in plist])
  loop = LoopState.start(prompt_BT[:, -1], max_tokens, stop_BS=stop_BS)
  zeros_B = lambda dtype=jnp.int32: jnp.zeros((b,), dtype)  # distinct buffers (donated)
  ctx = dict(tcache=tcache, dcache=dcache, pending_B=zeros_B(), has_pending_B=zeros_B(bool))
  rounds_per_dispatch = validate.count(rounds_per_dispatch, 'rounds_per_dispatch',
                                       'speculative_generate')
  tgraph, tstate = split_for_decode(target)
  dgraph, dstate = split_for_decode(draft)
  totals, rows = None, [[] for _ in range(b)]
  for _ in range(-(-max_tokens // rounds_per_dispatch)):  # every live row emits >= 1 a round
    ctx, out, stats = _rounds(tgraph, tstate, dgraph, dstate, gamma, batch, ctx, loop,
                              rounds_per_dispatch)
    loop = out.state
    tok_BW, num_B, live_B, stats = jax.device_get((out.tok_BW, out.num_B, loop.live_B, stats))
    totals = stats if totals is None else jax.tree.map(np.add, totals, stats)
    for row, toks, num in zip(rows, tok_BW, num_B):
      row.extend(toks[:num].tolist())
    if not live_B.any():
      break
  bad = [i for i, row in enumerate(rows) if row and row[-1] < 0]
  if bad:
    raise FloatingPointError(
        f'speculative_generate: the target or draft logits of row {bad[0]} are not finite '
        "(NaN or inf), so no token can be chosen; check both models' weights for NaN/inf "
        '(e.g. jnp.isfinite on every parameter).')
  out_BN = np.zeros((b, max_tokens + gamma + 1), np.int32)
  for i, row in enumerate(rows):
    out_BN[i, :len(row)] = row
    out_BN[i, len(row):max_tokens] = row[-1]  # after a stop token, repeat it (one width)
  spec = SpecStats(gamma=gamma, rounds=int(totals['rounds']), tokens=int(totals['tokens']),
                   reached_G=np.asarray(totals['reached_G']),
                   accepted_G=np.asarray(totals['accepted_G']),
                   beta_sum_G=np.asarray(totals['beta_sum_G']),
                   kl_sum_G=np.asarray(totals['kl_sum_G']))
  tokens = jnp.concatenate([prompt_BT, jnp.asarray(out_BN[:, :max_tokens])], axis=1)
  if not return_state:
    return tokens, spec
  return tokens, spec, dict(ctx, cur_B=loop.tok_B, gen_B=loop.count_B, out_BN=out_BN)
