"""Evaluation of a model against data and against another model (float vs quantized).

Everything here runs the model through one jitted function of (graphdef, state, tokens), so a
quantized model's codes are arguments, not constants folded into the executable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.nn import greedy_generate


@functools.partial(jax.jit, static_argnums=0)
def _nll_sum(graphdef, state, windows_BT1):
  model = nnx.merge(graphdef, state)
  logits_BTV = model(windows_BT1[:, :-1])
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp_BTV, windows_BT1[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(nll_BT)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens_BT):
  return nnx.merge(graphdef, state)(tokens_BT)


def logits(model: nnx.Module, tokens_BT) -> jax.Array:
  """Full-forward logits, jitted with the model's arrays as arguments."""
  graphdef, state = nnx.split(model)
  return _logits(graphdef, state, jnp.asarray(tokens_BT))


def perplexity(model: nnx.Module, windows: np.ndarray, batch: int = 8) -> dict:
  """Perplexity over [n, T + 1] token windows (predicting tokens 1..T of each window).

  Returns:
    dict with 'nll' (mean negative log-likelihood, nats/token), 'ppl' and 'tokens'.
  """
  graphdef, state = nnx.split(model)
  total, count = 0.0, 0
  for i in range(0, len(windows), batch):
    w = jnp.asarray(windows[i:i + batch])
    total += float(_nll_sum(graphdef, state, w))
    count += w.shape[0] * (w.shape[1] - 1)
  nll = total / count
  return {'nll': nll, 'ppl': math.exp(nll), 'tokens': count}


def unigram_perplexity(train_ids: np.ndarray, eval_windows: np.ndarray, vocab: int) -> float:
  """Perplexity of an add-one-smoothed unigram model fit on `train_ids` (the baseline)."""
  counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
  logp = np.log(counts / counts.sum())
  return float(np.exp(-logp[eval_windows[:, 1:]].mean()))


def logit_diff(ref_BTV, test_BTV) -> dict:
  """Max and mean absolute difference of logits, and top-1 agreement per position."""
  d = jnp.abs(ref_BTV.astype(jnp.float32) - test_BTV.astype(jnp.float32))
  top1 = jnp.mean(jnp.argmax(ref_BTV, -1) == jnp.argmax(test_BTV, -1))
  return {'max_abs_logit_diff': float(jnp.max(d)), 'mean_abs_logit_diff': float(jnp.mean(d)),
          'top1_agreement': float(top1)}


def kl_divergence(ref_BTV, test_BTV) -> float:
  """Mean KL(ref || test) of next-token distributions, nats."""
  p = jax.nn.log_softmax(ref_BTV.astype(jnp.float32), -1)
  q = jax.nn.log_softmax(test_BTV.astype(jnp.float32), -1)
  return float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))


def greedy_agreement(ref_model, test_model, prompts_BT, num_tokens: int) -> dict:
  """Fraction of positions where two models' greedy continuations agree.

  Returns:
    dict with 'greedy_agreement' (mean over positions of exact token equality, counting every
    position after the first disagreement as it comes) and 'greedy_prefix' (mean length of
    the identical prefix, in tokens).
  """
  same, prefix = greedy_match(ref_model, test_model, prompts_BT, num_tokens)
  return {'greedy_agreement': float(same.mean()), 'greedy_prefix': float(prefix.mean())}


def greedy_match(ref_model, test_model, prompts_BT, num_tokens: int):
  """(same_BO, prefix_B): where two models' greedy continuations of O = num_tokens tokens
  agree, and each prompt's identical-prefix length."""
  prompts_BT = jnp.asarray(prompts_BT)
  t = prompts_BT.shape[1]
  a = np.asarray(greedy_generate(ref_model, prompts_BT, num_tokens))[:, t:]
  b = np.asarray(greedy_generate(test_model, prompts_BT, num_tokens))[:, t:]
  same = a == b
  return same, np.where(same.all(1), num_tokens, np.argmin(same, axis=1))
