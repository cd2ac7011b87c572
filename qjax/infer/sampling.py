"""Sampling: per-request parameters, the distribution a step samples from, seeded draws.

    from qjax.infer import SamplingParams, SamplingBatch, processed_logits, sample, row_keys
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams()]  # 2 rows
    batch = SamplingBatch.stack(params)                  # per-row arrays of shape (B,)
    logp_BV = processed_logits(logits_BV, batch)         # log of what is sampled from
    keys_B = row_keys(batch.seed_B, position_B)          # fold_in(key(seed), position)
    tok_B, logprob_B = sample(logits_BV, batch, keys_B)  # tokens and their model log-probs
    reason = finish_reason(params[0], output_tokens, output_text)   # host side: stop / length

The transform, applied per row in this order (HF and vLLM apply the same order):

1. repetition penalty r on tokens already seen (`seen_BV`, prompt and output): a positive
   logit is divided by r, a negative one multiplied by r (Keskar et al. 2019);
2. temperature t: logits / t; t = 0 is greedy: the distribution is one-hot at the argmax;
3. top-k (k = 0: off): keep the logits >= the k-th largest;
4. top-p (p = 1: off): keep the smallest head of the sorted, top-k-filtered distribution whose
   mass reaches p (the token that crosses p is kept, so one token always survives);
5. min-p (0: off): keep tokens whose probability is >= min_p times the largest one.

`processed_logits` returns the normalised log-probabilities of that distribution (-inf off its
support). Speculative decoding computes the target's p and the draft's q with it, so the
tokens it accepts follow exactly the distribution plain `sample` draws from.

Per-request seeds: row b's key at output position i is `fold_in(key(seed_b), i)`, so a
request's tokens depend on its own seed, prompt and parameters, never on its batch
neighbours (the transform is per row and every draw uses only its row's key). Rows of one
batch may carry different parameters: `SamplingBatch` holds them as arrays of shape (B,), so
one compiled step serves any mix of requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qjax.nn import generate as nn_generate
from qjax.nn import validate
from qjax.nn.attention import kv_format
from qjax.nn.kvcache import init_cache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples; validated on construction (errors name the value).

  Attributes:
    temperature: >= 0; 0 is greedy (argmax), 1 the model's distribution.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: nucleus mass in (0, 1]; 1 keeps all.
    min_p: in [0, 1]; keep tokens with probability >= min_p * the largest; 0 keeps all.
    repetition_penalty: > 0; 1 is off, > 1 discourages tokens already in prompt or output.
    max_tokens: tokens to generate, >= 1.
    stop_tokens: token ids that end the request (the stop token is kept in the output).
    stop_strings: strings that end the request once the output text contains one (the text
      is cut before it, see `trim_stop_string`).
    seed: the request's random stream (any int; used modulo 2**32).
    logprobs: whether the caller wants the chosen tokens' log-probabilities returned.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  max_tokens: int = 16
  stop_tokens: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  seed: int = 0
  logprobs: bool = False

  def __post_init__(self):
    bad = lambda msg: ValueError(f'SamplingParams: {msg}')
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)
    integer = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)
    t = self.temperature
    if not real(t) or not math.isfinite(t) or t < 0:
      raise bad(f'temperature={t!r} must be a finite number >= 0 (0 is greedy).')
    if not integer(self.top_k) or self.top_k < 0:
      raise bad(f'top_k={self.top_k!r} must be an int >= 0 (0 keeps every token).')
    if not real(self.top_p) or not 0 < self.top_p <= 1:
      raise bad(f'top_p={self.top_p!r} must be in (0, 1] (1 keeps every token).')
    if not real(self.min_p) or not 0 <= self.min_p <= 1:
      raise bad(f'min_p={self.min_p!r} must be in [0, 1] (0 keeps every token).')
    r = self.repetition_penalty
    if not real(r) or not math.isfinite(r) or r <= 0:
      raise bad(f'repetition_penalty={r!r} must be a finite number > 0 (1 is off).')
    if not integer(self.max_tokens) or self.max_tokens < 1:
      raise bad(f'max_tokens={self.max_tokens!r} must be an int >= 1.')
    object.__setattr__(self, 'stop_tokens',
                       validate.int_tuple(self.stop_tokens, 'stop_tokens', 'SamplingParams'))
    object.__setattr__(self, 'stop_strings',
                       validate.string_tuple(self.stop_strings, 'stop_strings',
                                             'SamplingParams'))
    if not integer(self.seed):
      raise bad(f'seed={self.seed!r} must be an int.')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def replace(self, **kw) -> 'SamplingParams':
    return dataclasses.replace(self, **kw)

  def check_vocab(self, vocab_size: int) -> None:
    """Raise if a stop token is outside a vocabulary of `vocab_size` tokens."""
    for tok in self.stop_tokens:
      if tok >= vocab_size:
        raise ValueError(f'SamplingParams: stop token {tok} is outside the vocabulary of '
                         f'{vocab_size} tokens; use ids in [0, {vocab_size}).')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
  """The distribution-defining parameters of B requests, one entry per row (a pytree).

  Attributes:
    temperature_B: float32; 0 marks a greedy row.
    top_k_B: int32; 0 is off.
    top_p_B: float32; 1 is off.
    min_p_B: float32; 0 is off.
    repetition_penalty_B: float32; 1 is off.
    seed_B: uint32, each row's seed.
  """

  temperature_B: jax.Array
  top_k_B: jax.Array
  top_p_B: jax.Array
  min_p_B: jax.Array
  repetition_penalty_B: jax.Array
  seed_B: jax.Array

  @classmethod
  def stack(cls, params: Sequence[SamplingParams]) -> 'SamplingBatch':
    """The batch of `params`, row b = params[b]."""
    if not params:
      raise ValueError('SamplingBatch.stack: got no SamplingParams; pass one per row.')
    col = lambda name, dtype: jnp.asarray(np.array([getattr(p, name) for p in params], dtype))
    return cls(temperature_B=col('temperature', np.float32), top_k_B=col('top_k', np.int32),
               top_p_B=col('top_p', np.float32), min_p_B=col('min_p', np.float32),
               repetition_penalty_B=col('repetition_penalty', np.float32),
               seed_B=jnp.asarray(np.array([p.seed % 2**32 for p in params], np.uint32)))

  @classmethod
  def repeat(cls, params: SamplingParams, batch: int) -> 'SamplingBatch':
    """B rows of the same `params`."""
    return cls.stack([params] * batch)

  @property
  def batch(self) -> int:
    return int(self.temperature_B.shape[0])

  def with_seeds(self, seed_B) -> 'SamplingBatch':
    """The same parameters with per-row seeds `seed_B` (ints, shape (B,))."""
    seed_B = jnp.asarray(np.asarray(seed_B, np.int64) % 2**32, jnp.uint32)
    return dataclasses.replace(self, seed_B=seed_B)


def row_keys(seed_B: jax.Array, position_B: jax.Array, stream: int = 0) -> jax.Array:
  """Per-row PRNG keys `fold_in(fold_in(key(seed_b), position_b), stream)`, shape (B,).

  Args:
    seed_B: each row's seed (uint32).
    position_B: each row's output position (the index of the token being drawn).
    stream: which of several independent draws at one position (speculative decoding uses
      separate streams for the draft, the acceptance test and the residual).

  Returns:
    typed keys of shape (B,).
  """
  def one(seed, pos):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), pos), stream)
  return jax.vmap(one)(seed_B, position_B.astype(jnp.uint32))


def seen_mask(tokens_BT: jax.Array, vocab_size: int,
              valid_BT: Optional[jax.Array] = None) -> jax.Array:
  """seen_BV: whether token v occurs among the (valid) tokens of row b (repetition penalty)."""
  if valid_BT is None:
    valid_BT = jnp.ones(tokens_BT.shape, bool)
  b = tokens_BT.shape[0]
  rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], tokens_BT.shape)
  return jnp.zeros((b, vocab_size), bool).at[rows_BT, tokens_BT].max(valid_BT)


def mark_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
  """seen_BV with each row's new token marked."""
  return seen_BV.at[jnp.arange(seen_BV.shape[0]), tokens_B].set(True)


def _rank_cut(x_BV, params):
  """The smallest logit each row keeps after top-k, then top-p (module docstring), (B, 1)."""
  v = x_BV.shape[-1]
  sorted_BV = -jnp.sort(-x_BV, axis=-1)  # descending
  k_B = jnp.where((params.top_k_B <= 0) | (params.top_k_B > v), v, params.top_k_B)
  kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
  topk_BV = jnp.where(sorted_BV >= kth_B1, sorted_BV, -jnp.inf)
  probs_BV = jax.nn.softmax(topk_BV, axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  # top_p = 1 is off outright: rounding can push the mass before the last tokens past 1.
  keep_BV = (mass_before_BV < params.top_p_B[:, None]) | (params.top_p_B[:, None] >= 1)
  keep_BV = keep_BV & jnp.isfinite(topk_BV) | (jnp.arange(v) == 0)
  num_kept_B1 = jnp.sum(keep_BV, axis=-1, keepdims=True)
  return jnp.take_along_axis(sorted_BV, num_kept_B1 - 1, axis=-1)


def processed_logits(logits_BV: jax.Array, params: SamplingBatch,
                     seen_BV: Optional[jax.Array] = None) -> jax.Array:
  """Log-probabilities of the distribution each row samples from (module docstring).

  Args:
    logits_BV: the model's logits at the position being sampled.
    params: per-row parameters (`SamplingBatch`).
    seen_BV: tokens already in each row's prompt and output (for the repetition penalty),
      or None (no penalty whatever the parameter says).

  Returns:
    logp_BV in float32: normalised, -inf off the support; a greedy row is one-hot (0 at the
    argmax of the penalised logits, -inf elsewhere).
  """
  x_BV = logits_BV.astype(jnp.float32)
  if seen_BV is not None:
    r_B1 = params.repetition_penalty_B[:, None]
    x_BV = jnp.where(seen_BV, jnp.where(x_BV > 0, x_BV / r_B1, x_BV * r_B1), x_BV)
  v = x_BV.shape[-1]
  greedy_B1 = (params.temperature_B == 0)[:, None]
  x_BV = x_BV / jnp.where(greedy_B1, 1.0, params.temperature_B[:, None])

  # The sort is the step's cost at a large vocabulary (262k for Gemma): skip it when no row
  # truncates by rank or mass (greedy, plain temperature and min-p need only the max).
  truncates_B = (params.temperature_B > 0) & (
      ((params.top_k_B > 0) & (params.top_k_B < v)) | (params.top_p_B < 1))
  cut_B1 = jax.lax.cond(jnp.any(truncates_B), functools.partial(_rank_cut, params=params),
                        lambda x: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype), x_BV)
  max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
  min_p_B1 = params.min_p_B[:, None]
  floor_B1 = jnp.where(min_p_B1 > 0, max_B1 + jnp.log(jnp.maximum(min_p_B1, 1e-38)), -jnp.inf)
  keep_BV = (x_BV >= cut_B1) & (x_BV >= floor_B1)
  logp_BV = jax.nn.log_softmax(jnp.where(keep_BV, x_BV, -jnp.inf), axis=-1)

  onehot_BV = jax.nn.one_hot(jnp.argmax(x_BV, axis=-1), v, dtype=bool)
  return jnp.where(greedy_B1, jnp.where(onehot_BV, 0.0, -jnp.inf), logp_BV)


def sample_from(logp_BV: jax.Array, keys_B: jax.Array) -> jax.Array:
  """tokens_B (int32): one draw per row from `logp_BV` with that row's key."""
  return jax.vmap(jax.random.categorical)(keys_B, logp_BV).astype(jnp.int32)


def sample(logits_BV: jax.Array, params: SamplingBatch, keys_B: jax.Array,
           seen_BV: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """Draw each row's next token from `processed_logits`; jittable.

  Args:
    logits_BV: the model's logits at the position being sampled.
    params: per-row parameters.
    keys_B: per-row keys (`row_keys(params.seed_B, position_B)`).
    seen_BV: tokens already seen per row, for the repetition penalty (None: no penalty).

  Returns:
    (tokens_B int32, logprob_B float32): the chosen tokens and their log-probabilities under
    the model (log_softmax of `logits_BV`, before penalty, temperature and truncation, as
    vLLM reports them), so greedy rows get informative values too.
  """
  tokens_B = sample_from(processed_logits(logits_BV, params, seen_BV), keys_B)
  model_logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  logprob_B = jnp.take_along_axis(model_logp_BV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, logprob_B


def finish_reason(params: SamplingParams, output_tokens: Sequence[int],
                  output_text: Optional[str] = None) -> Optional[str]:
  """Host side: why a request is finished, or None while it goes on ('error', non-finite
  logits, is decided by the engine, not here).

  Args:
    params: the request's parameters.
    output_tokens: the tokens generated so far (not the prompt).
    output_text: their decoded text, needed only when `params.stop_strings` is set.

  Returns:
    'stop' (a stop token was generated, or the text contains a stop string), 'length'
    (max_tokens reached) or None.
  """
  if output_tokens and int(output_tokens[-1]) in params.stop_tokens:
    return 'stop'
  if params.stop_strings:
    if output_text is None:
      raise ValueError('finish_reason: the request has stop_strings '
                       f'{params.stop_strings!r}; pass output_text (the decoded output).')
    if any(s in output_text for s in params.stop_strings):
      return 'stop'
  if len(output_tokens) >= params.max_tokens:
    return 'length'
  return None


def trim_stop_string(text: str, params: SamplingParams) -> str:
  """`text` cut before the earliest stop string it contains (unchanged if none)."""
  cuts = [text.find(s) for s in params.stop_strings if s in text]
  return text[:min(cuts)] if cuts else text


def truncate_at_stop(tokens: Sequence[int], params: SamplingParams) -> list[int]:
  """Host side: `tokens` up to and including the first stop token, at most max_tokens."""
  out = []
  for tok in list(tokens)[:params.max_tokens]:
    out.append(int(tok))
    if int(tok) in params.stop_tokens:
      break
  return out


def _sample_pick(logits_BV, params, position_B, seen_BV):
  tok_B, logprob_B = sample(logits_BV, params, row_keys(params.seed_B, position_B), seen_BV)
  seen_BV = mark_seen(seen_BV, tok_B)
  return validate.mark_non_finite(tok_B, logits_BV), logprob_B, seen_BV


def _sample_block_pick(logits_BV, count_B, carry):
  """`_sample_pick` as a `decode_loop` pick: count_B is each row's output position."""
  params, seen_BV = carry
  tok_B, logprob_B, seen_BV = _sample_pick(logits_BV, params, count_B, seen_BV)
  return tok_B, logprob_B, (params, seen_BV)


def as_batch(params, batch: int) -> SamplingBatch:
  """A `SamplingBatch` of B rows from one SamplingParams, a list of B, or a SamplingBatch."""
  if isinstance(params, SamplingParams):
    return SamplingBatch.repeat(params, batch)
  if isinstance(params, SamplingBatch):
    out = params
  else:
    out = SamplingBatch.stack(list(params))
  if out.batch != batch:
    raise ValueError(f'sampling parameters for {out.batch} rows given for a batch of {batch} '
                     'rows; pass one SamplingParams per row (or a single one for all).')
  return out


def sample_generate(model, prompt_BT: jax.Array, params, max_tokens: int, *,
                    decode_block: Optional[int] = None):
  """Plain (one token per step) sampled continuation of `prompt_BT` by `max_tokens` tokens.

  Args:
    model: a `qjax.nn.Transformer` (float or quantized; its KV format is used for the cache).
    prompt_BT: int token ids, the same length T for every row.
    params: one `SamplingParams` for every row, a list of B, or a `SamplingBatch`. Only the
      distribution-defining fields are used here; stop tokens and strings are applied by the
      caller with `truncate_at_stop` / `finish_reason`.
    max_tokens: tokens to generate (>= 1).
    decode_block: decode steps per dispatch (`qjax.nn.generate.decode_loop`); None: all in
      one (padded to a power of two). The tokens do not depend on it.

  Returns:
    (tokens_B(T+max_tokens), logprob_B(max_tokens)): prompt + output, and the model
    log-probability of every output token. Output token i of row b is drawn with
    `row_keys(seed_b, i)`, so a row's tokens do not depend on the rest of the batch.

  Raises:
    ValueError: bad ids or counts (`qjax.nn.validate`).
    FloatingPointError: non-finite logits at some step (checked once, after the loop).
  """
  cfg = model.config
  prompt_BT = validate.token_ids(prompt_BT, cfg.vocab_size, 'sample_generate', ndim=2)
  max_tokens = validate.count(max_tokens, 'max_tokens', 'sample_generate')
  b, t = prompt_BT.shape
  if t + max_tokens > cfg.max_len:
    raise ValueError(f'sample_generate: a prompt of {t} tokens + {max_tokens} new tokens '
                     f'exceeds config.max_len={cfg.max_len}; shorten one of them.')
  batch = as_batch(params, b)
  prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
  cache = init_cache(cfg, b, t + max_tokens, fmt=kv_format(model))
  seen_BV = seen_mask(prompt_BT, cfg.vocab_size)
  (tok_B, logprob_B, seen_BV), cache = nn_generate.decode_step(
      model, prompt_BT, cache, _sample_pick, batch, jnp.zeros((b,), jnp.int32), seen_BV)
  toks, logps = [np.asarray(prompt_BT), np.asarray(tok_B)[:, None]], [
      np.asarray(logprob_B)[:, None]]
  if max_tokens > 1:  # the rest on the device, `decode_block` steps per dispatch
    block = nn_generate.bucket_length(max_tokens - 1) if decode_block is None else decode_block
    state = nn_generate.LoopState.start(tok_B, max_tokens, count_B=np.ones(b),
                                        carry=(batch, seen_BV))
    loop = nn_generate.decode_loop(model, cache, state, pick=_sample_block_pick,
                                   decode_block=block)
    new_BO, logp_BO = nn_generate.collect(loop, max_tokens - 1)
    toks.append(new_BO)
    logps.append(logp_BO)
  tokens = np.concatenate(toks, axis=1).astype(np.int32)
  validate.raise_non_finite(tokens, 'sample_generate', start=t)
  return jnp.asarray(tokens), jnp.asarray(np.concatenate(logps, axis=1))
