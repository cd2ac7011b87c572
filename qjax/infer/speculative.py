"""Speculative decoding: a cheap draft proposes gamma tokens, the target verifies them in one pass.

    from qjax.infer import SamplingParams, speculative_generate, layer_skip_draft
    draft = quantize_model(target, policy)[0]        # (a) self-draft, any qjax policy
    draft = layer_skip_draft(target, num_layers=2)   # (b) the first k layers + the head
    tokens_BT, stats = speculative_generate(target, draft, prompt_BT, max_tokens=32,
                                            params=SamplingParams(temperature=0.7), gamma=4)
    stats.alpha, stats.alpha_tv, stats.tokens_per_pass, stats.expected_tokens_per_pass

One round (`qjax.infer.spec_round`, the program the serving engine's speculative rounds run
too; `rounds_per_dispatch` of them per dispatch, as steps of the library's one decode loop,
so the host reads the tokens and done flags once per dispatch): the draft decodes gamma
tokens with its own KV cache, drawing each from `processed_logits` of its logits; the target
feeds the last emitted token and the gamma draft tokens (gamma + 1 positions) through its
cache in one forward; `speculative_core.verify` accepts a prefix and draws the next token;
both caches roll back to the accepted length by lowering each row's `length` (slots at or
past a row's length are hidden by the causal mask and rewritten by the next round). Rows
accept different numbers of tokens, so every row keeps its own length, output count and
done flag. The caches are contiguous `KVCache`s, run through `qjax.nn.kvcache.forward`.

Exactness: every emitted token follows the target's processed distribution (temperature,
top-k, top-p, min-p; greedy when temperature is 0, where the output is token for token
`greedy_generate` of the target). The repetition penalty is refused: its distribution would
depend on the draft tokens of the same round. Random streams are per row
(`spec_round` module docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.infer import spec_round, speculative_core
from qjax.infer.sampling import SamplingParams, as_batch
from qjax.nn import kvcache
from qjax.nn.attention import kv_format
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, stop_table
from qjax.nn.generate import logits_step
from qjax.nn.model_split import split_for_decode
from qjax.nn.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """What a speculative run measured (sums over rows and rounds; rows count while not done).

  Attributes:
    gamma: draft tokens per round.
    rounds: target verification passes summed over rows (prefill not counted).
    tokens: tokens emitted by those passes (before cutting to max_tokens).
    reached_A: per draft position, how often a round reached it (all before it accepted).
    accepted_A: per draft position, how often it was accepted.
    beta_sum_A: per draft position, the sum of 1 - TV(p, q) over the rounds that reached it.
    kl_sum_A: per draft position, the sum over reached rounds of KL(emitted law || p), the
      emitted law computed from p and q (`speculative_core.emitted_distribution`); 0 up to
      float rounding when the verification is exact. None where not measured.
  """

  gamma: int
  rounds: int
  tokens: int
  reached_A: np.ndarray
  accepted_A: np.ndarray
  beta_sum_A: np.ndarray
  kl_sum_A: Optional[np.ndarray] = None

  @property
  def acceptance_by_position(self) -> np.ndarray:
    return self.accepted_A / np.maximum(self.reached_A, 1)

  @property
  def alpha(self) -> float:
    """Measured per-position acceptance rate: accepted / reached over all positions."""
    return float(self.accepted_A.sum() / max(self.reached_A.sum(), 1))

  @property
  def alpha_tv(self) -> float:
    """The same estimated from the distributions: mean of 1 - TV(p, q) at reached positions."""
    return float(self.beta_sum_A.sum() / max(self.reached_A.sum(), 1))

  @property
  def kl_exact(self) -> float:
    """Mean KL(emitted law || target law) over reached positions (nan when not measured)."""
    if self.kl_sum_A is None:
      return float('nan')
    return float(self.kl_sum_A.sum() / max(self.reached_A.sum(), 1))

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

  @classmethod
  def from_sums(cls, gamma: int, sums: Optional[dict] = None) -> 'SpecStats':
    """The statistics of per-row sums of rounds (`spec_round.zero_stats`'s fields, host
    arrays, rows along axis 0), or of no round (None)."""
    if sums is None:
      return cls(gamma=gamma, rounds=0, tokens=0, reached_A=np.zeros(gamma, np.int64),
                 accepted_A=np.zeros(gamma, np.int64), beta_sum_A=np.zeros(gamma))
    total = {k: np.sum(v, axis=0, dtype=np.float64 if v.dtype.kind == 'f' else np.int64)
             for k, v in sums.items()}
    return cls(gamma=gamma, rounds=int(total['rounds_B']), tokens=int(total['tokens_B']),
               reached_A=total['reached_BA'], accepted_A=total['accepted_BA'],
               beta_sum_A=total['beta_BA'], kl_sum_A=total.get('kl_BA'))

  def __add__(self, other: 'SpecStats') -> 'SpecStats':
    """The statistics of both runs of rounds together (the same gamma)."""
    add = lambda a, b: b if a is None else a if b is None else a + b
    return SpecStats(gamma=self.gamma, rounds=self.rounds + other.rounds,
                     tokens=self.tokens + other.tokens,
                     reached_A=self.reached_A + other.reached_A,
                     accepted_A=self.accepted_A + other.accepted_A,
                     beta_sum_A=self.beta_sum_A + other.beta_sum_A,
                     kl_sum_A=add(self.kl_sum_A, other.kl_sum_A))

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
    return_state: also return the final state (dict: 'tcache', 'dcache', 'cur_B', 'gen_B',
      'out_BO'), e.g. to check the caches (each holds every token but `cur_B`).
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
  # Room for rows that finished early to keep running a round past their end (a row that
  # would pass the cache writes lower: `kvcache.forward`).
  size = min(need + gamma + 1, target.config.max_len, draft.config.max_len)
  tcache = _prefill(target, prompt_BT[:, :-1],
                    kvcache.init_cache(target.config, b, size, fmt=kv_format(target)))
  dcache = _prefill(draft, prompt_BT[:, :-1],
                    kvcache.init_cache(draft.config, b, size, fmt=kv_format(draft)))
  stop_BZ = stop_table([p.stop_tokens for p in plist])
  loop = LoopState.start(prompt_BT[:, -1], max_tokens, stop_BZ=stop_BZ)
  rounds_per_dispatch = validate.count(rounds_per_dispatch, 'rounds_per_dispatch',
                                       'speculative_generate')
  how = spec_round.RoundConfig(gamma=gamma, block=rounds_per_dispatch,
                               forward=kvcache.forward, measure_kl=True)
  tgraph, tstate = split_for_decode(target)
  dgraph, dstate = split_for_decode(draft)
  spec, rows = SpecStats.from_sums(gamma), [[] for _ in range(b)]
  for _ in range(-(-max_tokens // rounds_per_dispatch)):  # every live row emits >= 1 a round
    out, tcache, dcache, stats = spec_round.rounds(tgraph, tstate, dgraph, dstate, how,
                                                   tcache, dcache, loop, batch)
    loop = out.state
    tok_BW, num_B, live_B, stats = jax.device_get((out.tok_BW, out.num_B, loop.live_B, stats))
    spec += SpecStats.from_sums(gamma, stats)
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
  out_BO = np.zeros((b, max_tokens + gamma + 1), np.int32)
  for i, row in enumerate(rows):
    out_BO[i, :len(row)] = row
    out_BO[i, len(row):max_tokens] = row[-1]  # after a stop token, repeat it (one width)
  tokens = jnp.concatenate([prompt_BT, jnp.asarray(out_BO[:, :max_tokens])], axis=1)
  if not return_state:
    return tokens, spec
  return tokens, spec, dict(tcache=tcache, dcache=dcache, cur_B=loop.tok_B,
                            gen_B=loop.count_B, out_BO=out_BO)
