"""Speculative decoding: greedy identity, exactness of the sampled distribution, theory,
rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from qjax.core import int_format
from qjax.infer import (SamplingBatch, SamplingParams, expected_tokens_per_pass,
                        layer_skip_draft, processed_logits, speculative_generate, verify)
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, greedy_generate,
                     quantize_model, with_kv_format)
from qjax.nn.generate import logits_step

# Jitted forwards and transforms: eager dispatch of these is slower than compiling them once.
_forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))
processed_logits = jax.jit(processed_logits)
V = 8  # a vocabulary small enough to tabulate the joint law of two tokens (64 cells)
CFG = TransformerConfig.tiny(vocab_size=V, max_len=32)


@pytest.fixture(scope='module')
def target():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def other():
  """A separate one-layer model with the same vocabulary (draft kind (c))."""
  return Transformer(CFG.replace(num_layers=1), rngs=nnx.Rngs(7))


def _chi2_pvalue(counts, probs):
  """Chi-square p-value, cells with expected count < 5 pooled into one."""
  expected = counts.sum() * probs
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  assert obs[~keep].sum() == 0, 'a sequence of probability 0 was generated'
  exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # float rounding of the total
  return stats.chisquare(obs[keep], exp)[1]


def test_greedy_speculative_is_greedy_decoding_for_every_draft_kind(target, other):
  prompt = jnp.array([[1, 2, 3], [7, 0, 5]])
  want = np.asarray(greedy_generate(target, prompt, 7))
  int4 = int_format(4, group_size=32)
  quantized, _ = quantize_model(target, QuantPolicy((QuantRule('embed', exempt=True),
                                                     QuantRule('.*', int4))))
  # (layer_skip_draft and `other` have one graph, so gamma 2 compiles once for both.)
  drafts = [(with_kv_format(quantized, 'int4'), 3), (layer_skip_draft(target, 1), 2),
            (other, 2)]
  for draft, gamma in drafts:
    out, st = speculative_generate(target, draft, prompt, 7, gamma=gamma)
    np.testing.assert_array_equal(np.asarray(out), want, err_msg=f'gamma={gamma}')
    assert st.tokens >= 7 and st.rounds >= 1
    assert st.expected_tokens_per_pass >= 1


def _joint_law(model, prompt, params):
  """p(x1, x2 | prompt) under `params`' processed distribution, as a (V, V) table."""
  batch = SamplingBatch.repeat(params, V)
  p1 = np.exp(np.asarray(processed_logits(_forward(model, prompt)[:, -1],
                                          SamplingBatch.stack([params]))))[0]
  seqs = jnp.concatenate([jnp.repeat(prompt, V, 0), jnp.arange(V)[:, None]], axis=1)
  p2 = np.exp(np.asarray(processed_logits(_forward(model, seqs)[:, -1], batch)))
  return (p1[:, None] * p2).astype(np.float64)


@pytest.fixture(scope='module')
def sampled_run(target, other):
  """3000 seeded rows of one prompt, 2 tokens each, drafted by `other` with gamma 2."""
  n = 3000
  prompt = jnp.array([[3, 1, 4]])
  params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
  out, st, state = speculative_generate(target, other, jnp.repeat(prompt, n, 0), 2,
                                        params=params, gamma=2, return_state=True)
  return prompt, params[0], np.asarray(out[:, 3:]), st, state


def test_speculative_sampling_follows_the_target_not_the_draft(target, other, sampled_run):
  """Goodness of fit of the first two tokens' joint law; thresholds p > 1e-3 / p < 1e-6."""
  prompt, params, out_B2, st, _ = sampled_run
  counts = np.bincount(out_B2[:, 0] * V + out_B2[:, 1], minlength=V * V)
  assert _chi2_pvalue(counts, _joint_law(target, prompt, params).ravel()) > 1e-3
  assert _chi2_pvalue(counts, _joint_law(other, prompt, params).ravel()) < 1e-6
  assert 0.05 < st.alpha < 0.95  # the draft is neither useless nor the target


def test_speculative_sampling_is_exact_with_top_k_and_top_p(target, other, sampled_run):
  """Same shapes as `sampled_run` (no new compile); truncation makes some cells impossible."""
  prompt, *_ = sampled_run
  n = 3000
  params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=10_000 + s)
            for s in range(n)]
  out, _ = speculative_generate(target, other, jnp.repeat(prompt, n, 0), 2, params=params,
                                gamma=2)
  out_B2 = np.asarray(out[:, 3:])
  counts = np.bincount(out_B2[:, 0] * V + out_B2[:, 1], minlength=V * V)
  law = _joint_law(target, prompt, params[0]).ravel()
  assert (law == 0).sum() > 0  # the filters removed some continuations...
  assert _chi2_pvalue(counts, law) > 1e-3  # ...and none of those was generated (asserted)


def test_measured_alpha_agrees_with_the_tv_estimate(sampled_run):
  *_, st, _ = sampled_run
  sigma = np.sqrt(st.alpha * (1 - st.alpha) / st.reached_A.sum())
  assert abs(st.alpha - st.alpha_tv) < 4 * sigma + 1e-3, (st.alpha, st.alpha_tv, sigma)


def test_caches_after_rollback_give_the_logits_of_a_fresh_forward(target, other, sampled_run):
  """Both caches hold every emitted token but the last, whatever the rows accepted."""
  prompt, _, _, _, state = sampled_run
  gen_B, out_BO = np.asarray(state['gen_B']), np.asarray(state['out_BO'])
  cur_B1 = state['cur_B'][:, None]
  t_logits_B1V, _ = logits_step(target, cur_B1, state['tcache'])
  d_logits_B1V, _ = logits_step(other, cur_B1, state['dcache'])
  rows = {}  # one row per generated length
  for b in range(len(gen_B)):
    rows.setdefault(gen_B[b], b)
  assert len(rows) >= 2, rows
  rows = sorted(rows.values())
  # Right-padded to one width: causal logits at a row's last token ignore the padding.
  seqs = np.zeros((len(rows), prompt.shape[1] + out_BO.shape[1]), np.int32)
  for i, b in enumerate(rows):
    seqs[i] = np.concatenate([np.asarray(prompt[0]), out_BO[b]])
  last = prompt.shape[1] + gen_B[rows] - 1
  for model, logits_B1V in ((target, t_logits_B1V), (other, d_logits_B1V)):
    fresh_V = np.asarray(_forward(model, jnp.asarray(seqs)))[np.arange(len(rows)), last]
    np.testing.assert_allclose(np.asarray(logits_B1V)[rows, 0], fresh_V, atol=2e-4)


def _synthetic(b, g, p_V, q_V, seed):
  """verify() on i.i.d. positions with fixed p and q (draft tokens drawn from q)."""
  k_draft, k_u, k_final = jax.random.split(jax.random.key(seed), 3)
  p_logp = jnp.broadcast_to(jnp.log(jnp.asarray(p_V, jnp.float32)), (b, g + 1, len(p_V)))
  q_logp = jnp.broadcast_to(jnp.log(jnp.asarray(q_V, jnp.float32)), (b, g, len(q_V)))
  draft_BA = jax.random.categorical(k_draft, q_logp).astype(jnp.int32)
  uniform_BA = jax.random.uniform(k_u, (b, g))
  return _verify(p_logp, q_logp, draft_BA, uniform_BA, jax.random.split(k_final, b))


_verify = jax.jit(verify)
B_SYN, A_SYN = 6000, 3  # one shape for every synthetic case: one compile


def test_accepted_length_matches_the_formula_with_alpha_from_tv():
  p = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0, 0, 0])
  q = np.array([0.2, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0])
  alpha = np.minimum(p, q).sum()  # 1 - TV(p, q) = 0.65
  b, g = B_SYN, A_SYN
  num_acc_B, tokens_BX, beta_BA = _synthetic(b, g, p, q, seed=0)
  np.testing.assert_allclose(np.asarray(beta_BA), alpha, rtol=1e-5)
  measured = float(jnp.mean(num_acc_B + 1))
  want = float(expected_tokens_per_pass(alpha, g))
  sigma = float(jnp.std(num_acc_B + 1)) / np.sqrt(b)
  assert abs(measured - want) < 4 * sigma, (measured, want, sigma)
  # Every emitted token, the first one included, follows p exactly.
  first = np.asarray(tokens_BX[:, 0])
  assert _chi2_pvalue(np.bincount(first, minlength=8), p) > 1e-3


def test_degenerate_drafts_identical_accepts_all_disjoint_accepts_none():
  p = np.array([0.4, 0.3, 0.3, 0, 0, 0, 0, 0])
  num_acc_B, _, beta_BA = _synthetic(B_SYN, A_SYN, p, p, seed=1)
  assert int(num_acc_B.min()) == A_SYN and np.allclose(np.asarray(beta_BA), 1.0)
  q = np.array([0, 0, 0, 0.5, 0.25, 0.25, 0, 0])
  num_acc_B, tokens_BX, beta_BA = _synthetic(B_SYN, A_SYN, p, q, seed=2)
  assert int(num_acc_B.max()) == 0 and float(jnp.max(beta_BA)) == 0.0
  assert _chi2_pvalue(np.bincount(np.asarray(tokens_BX[:, 0]), minlength=8), p) > 1e-3


def test_bad_inputs_raise_clear_errors(target, other):
  prompt = jnp.array([[1, 2]])
  wrong_vocab = Transformer(CFG.replace(vocab_size=16, num_layers=1), rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match='vocab_size=16'):
    speculative_generate(target, wrong_vocab, prompt, 2)
  with pytest.raises(ValueError, match='gamma=0'):
    speculative_generate(target, other, prompt, 2, gamma=0)
  with pytest.raises(ValueError, match='repetition_penalty=1.2'):
    speculative_generate(target, other, prompt, 2, SamplingParams(repetition_penalty=1.2))
  with pytest.raises(ValueError, match='max_tokens=0'):
    speculative_generate(target, other, prompt, 0)
  with pytest.raises(ValueError, match='exceeds the target config.max_len=32'):
    speculative_generate(target, other, prompt, 30, gamma=4)

  class Tok:
    def __init__(self, vocab):
      self.vocab = vocab

    def get_vocab(self):
      return self.vocab
  with pytest.raises(ValueError, match='different ids'):
    speculative_generate(target, other, prompt, 2, target_tokenizer=Tok({'a': 0, 'b': 1}),
                         draft_tokenizer=Tok({'a': 1, 'b': 0}))


def test_emitted_law_is_the_target_law_and_a_wrong_residual_is_caught():
  from qjax.infer.speculative_core import emitted_distribution, kl_divergence
  p = jnp.log(jnp.asarray([[[0.5, 0.2, 0.15, 0.1, 0.05, 0, 0, 0]]], jnp.float32))
  q = jnp.log(jnp.asarray([[[0.2, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0]]], jnp.float32))
  law = emitted_distribution(p, q)
  np.testing.assert_allclose(np.asarray(law), np.exp(np.asarray(p)), atol=1e-6)
  assert abs(float(kl_divergence(law, p)[0, 0])) < 1e-6
  # Drawing the residual from max(0, p - q) without the (1 - beta) weight would not be p.
  wrong = jnp.minimum(jnp.exp(p), jnp.exp(q)) + jnp.maximum(jnp.exp(p) - jnp.exp(q), 0) / 0.35
  wrong = wrong / wrong.sum(-1, keepdims=True)
  assert float(kl_divergence(wrong, p)[0, 0]) > 0.01
  # Mass where p has none is an infinite KL.
  assert np.isinf(float(kl_divergence(jnp.exp(q), p)[0, 0]))
