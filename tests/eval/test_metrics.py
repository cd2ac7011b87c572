"""qjax.eval.metrics against independent numpy computations and golden values."""

import math

import jax
import numpy as np
from flax import nnx

from qjax.eval import metrics
from qjax.nn import Transformer, TransformerConfig


def _model(seed=0):
  return Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(seed))


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_perplexity_equals_a_numpy_nll_over_the_models_logits():
  model = _model()
  windows = np.asarray(jax.random.randint(jax.random.key(1), (5, 9), 0, 256))
  got = metrics.perplexity(model, windows, batch=2)  # uneven last batch
  logp = _log_softmax(np.asarray(metrics.logits(model, windows[:, :-1]), np.float64))
  nll = -np.take_along_axis(logp, windows[:, 1:, None], -1).mean()
  assert got['tokens'] == 5 * 8
  np.testing.assert_allclose(got['nll'], nll, rtol=1e-5)
  np.testing.assert_allclose(got['ppl'], math.exp(nll), rtol=1e-5)


def test_unigram_perplexity_golden():
  # counts + 1 over a vocab of 4: [3, 2, 1, 1] / 7; eval tokens 0 and 1.
  train = np.asarray([0, 0, 1])
  windows = np.asarray([[2, 0, 1]])
  want = math.exp(-(math.log(3 / 7) + math.log(2 / 7)) / 2)
  np.testing.assert_allclose(metrics.unigram_perplexity(train, windows, 4), want, rtol=1e-12)


def test_kl_and_logit_diff_golden():
  ref = np.log(np.asarray([[[0.5, 0.25, 0.25]]], np.float32))
  test = np.log(np.asarray([[[0.25, 0.5, 0.25]]], np.float32))
  want = 0.5 * math.log(2) + 0.25 * math.log(0.5)
  np.testing.assert_allclose(metrics.kl_divergence(ref, test), want, rtol=1e-5)
  assert metrics.kl_divergence(ref, ref) == 0.0
  d = metrics.logit_diff(ref, test)
  np.testing.assert_allclose(d['max_abs_logit_diff'], math.log(2), rtol=1e-6)
  np.testing.assert_allclose(d['mean_abs_logit_diff'], 2 * math.log(2) / 3, rtol=1e-6)
  assert d['top1_agreement'] == 0.0


def test_greedy_agreement_of_a_model_with_itself_and_with_another():
  a, b = _model(0), _model(1)
  prompts = np.asarray(jax.random.randint(jax.random.key(2), (2, 4), 0, 256))
  same = metrics.greedy_agreement(a, a, prompts, 3)
  assert same == {'greedy_agreement': 1.0, 'greedy_prefix': 3.0}
  other = metrics.greedy_agreement(a, b, prompts, 3)
  assert other['greedy_agreement'] < 1.0 and other['greedy_prefix'] < 3.0
