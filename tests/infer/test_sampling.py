"""Sampling: the processed distribution against a numpy reference, seeded draws, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from qjax.infer import (SamplingBatch, SamplingParams, finish_reason, processed_logits,
                        row_keys, sample, sample_generate, seen_mask, trim_stop_string,
                        truncate_at_stop)
from qjax.nn import Transformer, TransformerConfig, greedy_generate

# Jitted once per shape: eager dispatch of the sort/cumsum chain is slower than compiling.
processed_logits = jax.jit(processed_logits)
sample = jax.jit(sample)


def _ref_probs(logits_V, p: SamplingParams, seen_V=None):
  """An independent numpy reference: each filter applied in turn on the unsorted vector."""
  x = np.asarray(logits_V, np.float64).copy()
  if seen_V is not None:
    r = p.repetition_penalty
    x[seen_V] = np.where(x[seen_V] > 0, x[seen_V] / r, x[seen_V] * r)
  if p.temperature == 0:
    out = np.zeros_like(x)
    out[np.argmax(x)] = 1
    return out
  x = x / p.temperature
  keep = np.ones(x.shape, bool)
  if p.top_k:
    keep[np.argsort(-x)[p.top_k:]] = False
  if p.top_p < 1:
    probs = np.where(keep, np.exp(x - x.max()), 0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p.top_p) + 1)  # the first index where the mass reaches p
    drop = np.zeros(x.shape, bool)
    drop[order[n:]] = True
    keep &= ~drop
  if p.min_p:
    probs = np.exp(x - x.max())
    keep &= probs >= p.min_p  # relative to the largest, which has probs == 1
  out = np.where(keep, np.exp(x - x.max()), 0)
  return out / out.sum()


_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=2.0, top_p=0.3),
]


def _logits(b, v, seed=0, scale=2.0):
  return jax.random.normal(jax.random.key(seed), (b, v)) * scale


def test_processed_distribution_matches_numpy_reference_mixed_batch():
  logits_BV = _logits(len(_PARAMS), 32)
  logp_BV = processed_logits(logits_BV, SamplingBatch.stack(_PARAMS))
  for b, p in enumerate(_PARAMS):
    ref = _ref_probs(logits_BV[b], p)
    got = np.exp(np.asarray(logp_BV[b], np.float64))
    np.testing.assert_array_equal(got > 0, ref > 0, err_msg=f'support of row {b}: {p}')
    np.testing.assert_allclose(got, ref, atol=1e-6, err_msg=f'row {b}: {p}')


def test_masks_shrink_the_support_as_the_parameters_say():
  logits_BV = _logits(1, 64, seed=3)
  count = lambda p: int(jnp.sum(jnp.isfinite(processed_logits(
      logits_BV, SamplingBatch.stack([p])))))
  assert count(SamplingParams(top_k=7)) == 7
  assert count(SamplingParams()) == 64
  assert count(SamplingParams(top_p=1e-6)) == 1
  ref = _ref_probs(logits_BV[0], SamplingParams(min_p=0.3))
  assert count(SamplingParams(min_p=0.3)) == int((ref > 0).sum()) < 64


def test_greedy_and_top_k_1_are_argmax_whatever_the_key():
  logits_BV = _logits(6, 50, seed=1)
  want = np.argmax(np.asarray(logits_BV), axis=-1)
  for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1)):
    batch = SamplingBatch.repeat(p, 6)
    for seed in range(3):
      tok_B, _ = sample(logits_BV, batch, row_keys(batch.seed_B + seed, jnp.arange(6)))
      np.testing.assert_array_equal(np.asarray(tok_B), want)


def test_logprobs_are_the_models_log_softmax_of_the_chosen_token():
  logits_BV = _logits(4, 20, seed=2)
  batch = SamplingBatch.repeat(SamplingParams(temperature=0.8), 4)
  tok_B, logprob_B = sample(logits_BV, batch, row_keys(batch.seed_B, jnp.zeros(4, jnp.int32)))
  ref = jax.nn.log_softmax(logits_BV)[jnp.arange(4), tok_B]
  np.testing.assert_allclose(np.asarray(logprob_B), np.asarray(ref), rtol=1e-6)


def test_repetition_penalty_matches_numpy():
  logits_BV = _logits(2, 16, seed=4)
  seen_BV = seen_mask(jnp.array([[1, 3, 3, 9], [0, 15, 2, 2]]), 16)
  assert int(seen_BV.sum()) == 6
  params = [SamplingParams(repetition_penalty=1.5), SamplingParams(repetition_penalty=0.7,
                                                                   temperature=0.5)]
  logp_BV = processed_logits(logits_BV, SamplingBatch.stack(params), seen_BV)
  for b, p in enumerate(params):
    ref = _ref_probs(logits_BV[b], p, np.asarray(seen_BV[b]))
    np.testing.assert_allclose(np.exp(np.asarray(logp_BV[b])), ref, atol=1e-6)


def test_empirical_frequencies_match_the_processed_distribution():
  """Chi-square goodness of fit, 20000 draws with per-row seeds; threshold p > 1e-3."""
  n, v = 20_000, 12
  logits_1V = _logits(1, v, seed=5, scale=1.5)
  for p in (SamplingParams(temperature=0.8, top_k=8), SamplingParams(top_p=0.85, min_p=0.05)):
    batch = SamplingBatch.repeat(p, n).with_seeds(np.arange(n))
    tok_B, _ = sample(jnp.broadcast_to(logits_1V, (n, v)), batch,
                               row_keys(batch.seed_B, jnp.zeros(n, jnp.int32)))
    probs = _ref_probs(logits_1V[0], p)
    counts = np.bincount(np.asarray(tok_B), minlength=v)
    assert counts[probs == 0].sum() == 0, 'a token off the support was drawn'
    support = probs > 0
    _, pval = stats.chisquare(counts[support], n * probs[support] / probs[support].sum())
    assert pval > 1e-3, (p, counts, n * probs)
    # ...and the test has power: the unprocessed distribution is rejected.
    raw = np.asarray(jax.nn.softmax(logits_1V[0]), np.float64)
    assert stats.chisquare(counts, n * raw / raw.sum())[1] < 1e-6


@pytest.fixture(scope='module')
def tiny_model():
  return Transformer(TransformerConfig.tiny(vocab_size=64, max_len=32), rngs=nnx.Rngs(0))


def test_a_request_samples_the_same_tokens_alone_or_in_a_batch(tiny_model):
  prompt = jnp.array([[5, 9, 2, 7]])
  mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
  alone, alone_lp = sample_generate(tiny_model, prompt, mine, 3)
  others = [SamplingParams(temperature=0.5, seed=1), mine, SamplingParams(temperature=0),
            SamplingParams(top_k=3, seed=7, repetition_penalty=1.3)]
  prompts = jnp.array([[1, 2, 3, 4], [5, 9, 2, 7], [8, 8, 8, 8], [0, 1, 0, 1]])
  batched, batched_lp = sample_generate(tiny_model, prompts, others, 3)
  np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(alone[0]))
  np.testing.assert_allclose(np.asarray(batched_lp[1]), np.asarray(alone_lp[0]), atol=1e-5)
  other_seed, _ = sample_generate(tiny_model, prompt, mine.replace(seed=99), 3)
  assert not np.array_equal(np.asarray(other_seed), np.asarray(alone))
  # The greedy row is plain greedy decoding.
  np.testing.assert_array_equal(np.asarray(batched[2]),
                                np.asarray(greedy_generate(tiny_model, prompts[2:3], 3)[0]))


@pytest.mark.parametrize('kw, named', [
    (dict(temperature=-0.1), 'temperature=-0.1'), (dict(top_p=0.0), 'top_p=0.0'),
    (dict(top_p=1.5), 'top_p=1.5'), (dict(top_k=-2), 'top_k=-2'), (dict(min_p=2), 'min_p=2'),
    (dict(repetition_penalty=0), 'repetition_penalty=0'), (dict(max_tokens=0), 'max_tokens=0'),
    (dict(max_tokens=-3), 'max_tokens=-3'), (dict(stop_tokens=(-1,)), '-1'),
    (dict(stop_strings=('',)), "''"), (dict(temperature=float('nan')), 'nan'),
])
def test_bad_params_raise_naming_the_value(kw, named):
  with pytest.raises(ValueError, match=named.replace('.', r'\.').replace('(', r'\(')):
    SamplingParams(**kw)


def test_finish_reason_and_stop_helpers():
  p = SamplingParams(max_tokens=4, stop_tokens=(7,), stop_strings=('END',))
  assert finish_reason(p, [1, 2], 'ab') is None
  assert finish_reason(p, [1, 7], 'ab') == 'stop'
  assert finish_reason(p, [1, 2], 'abEND') == 'stop'
  assert finish_reason(p, [1, 2, 3, 4], 'abcd') == 'length'
  with pytest.raises(ValueError, match='output_text'):
    finish_reason(p, [1, 2])
  assert trim_stop_string('hello END world', p) == 'hello '
  assert truncate_at_stop([3, 7, 9, 9, 9], p) == [3, 7]
  assert truncate_at_stop([3, 4, 5, 6, 8, 9], p) == [3, 4, 5, 6]
