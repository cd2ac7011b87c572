"""The math of speculative decoding: modified rejection sampling and its acceptance theory.

Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318). A draft with
distributions q_1..q_G proposes tokens d_1..d_G (d_i ~ q_i, each conditioned on the ones
before); the target scores the same prefixes, giving p_1..p_{G+1}. Position i accepts d_i
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection j the token is redrawn
from the residual norm(max(0, p_j - q_j)); after G acceptances a bonus token is drawn from
p_{G+1}. Every emitted token then follows p exactly (the theorem of both papers), whatever q
is. The chance that position i accepts, given it is reached, is

    beta_i = sum_v min(p_i(v), q_i(v)) = 1 - TV(p_i, q_i),

so with a constant alpha = E[beta] the tokens emitted per target pass are
(1 - alpha^(G+1)) / (1 - alpha) (`expected_tokens_per_pass`).

Greedy decoding is the case where p and q are one-hot (`processed_logits` at temperature 0):
d_i is accepted iff it is the target's argmax, and the residual is the target's argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expected_tokens_per_pass(alpha, gamma: int):
  """(1 - alpha^(gamma+1)) / (1 - alpha): mean tokens per target pass at acceptance `alpha`.

  Args:
    alpha: per-position acceptance rate in [0, 1] (a float or an array).
    gamma: draft tokens per pass (>= 1).

  Returns:
    The expectation, gamma + 1 at alpha = 1.
  """
  alpha = jnp.asarray(alpha, jnp.float32)
  safe = jnp.where(alpha < 1, alpha, 0.5)
  return jnp.where(alpha < 1, (1 - safe ** (gamma + 1)) / (1 - safe), gamma + 1.0)


def acceptance_prob(p_logp_BGV: jax.Array, q_logp_BGV: jax.Array) -> jax.Array:
  """beta_BG = sum_v min(p, q) = 1 - TV(p, q) at each of G positions."""
  return jnp.sum(jnp.minimum(jnp.exp(p_logp_BGV), jnp.exp(q_logp_BGV)), axis=-1)


def verify(p_logp_BXV: jax.Array, q_logp_BGV: jax.Array, draft_BG: jax.Array,
           uniform_BG: jax.Array, final_keys_B: jax.Array):
  """Accept a prefix of the draft and draw the next token (modified rejection sampling).

  Args:
    p_logp_BXV: the target's log-probabilities at X = G + 1 positions (the distribution
      sampled from: `processed_logits`).
    q_logp_BGV: the draft's at the first G positions, from the same transform.
    draft_BG: the draft tokens, d_i drawn from q_i.
    uniform_BG: U[0, 1) draws, one per position, for the acceptance tests.
    final_keys_B: per-row keys for the token drawn after the accepted prefix.

  Returns:
    (num_accepted_B, tokens_BX, beta_BG): accepted draft tokens per row (0..G); the emitted
    tokens (tokens_BX[b, :num_accepted_B[b] + 1] are valid: the accepted prefix of the draft,
    then the residual or bonus token); and the acceptance probability of every position.
  """
  b, g = draft_BG.shape
  v = q_logp_BGV.shape[-1]
  p_draft_BG = jnp.take_along_axis(p_logp_BXV[:, :g], draft_BG[..., None], axis=-1)[..., 0]
  q_draft_BG = jnp.take_along_axis(q_logp_BGV, draft_BG[..., None], axis=-1)[..., 0]
  # u < p/q compared in logs; q(d) > 0 because d was drawn from q.
  accept_BG = jnp.log(uniform_BG) < p_draft_BG - q_draft_BG
  num_accepted_B = jnp.sum(jnp.cumprod(accept_BG.astype(jnp.int32), axis=1), axis=1)

  # The residual at the first rejection; after G acceptances q is "nothing", so it is p.
  q_ext_BXV = jnp.concatenate([jnp.exp(q_logp_BGV), jnp.zeros((b, 1, v), jnp.float32)], 1)
  at_B11 = num_accepted_B[:, None, None]
  p_j_BV = jnp.take_along_axis(jnp.exp(p_logp_BXV), at_B11, axis=1)[:, 0]
  q_j_BV = jnp.take_along_axis(q_ext_BXV, at_B11, axis=1)[:, 0]
  residual_BV = jnp.maximum(p_j_BV - q_j_BV, 0.0)
  # A rejection means p(d) < q(d), so the residual has mass; rounding aside, fall back to p.
  residual_BV = jnp.where(jnp.sum(residual_BV, -1, keepdims=True) > 0, residual_BV, p_j_BV)
  final_B = jax.vmap(jax.random.categorical)(final_keys_B, jnp.log(residual_BV))

  tokens_BX = jnp.concatenate([draft_BG, jnp.zeros((b, 1), draft_BG.dtype)], axis=1)
  tokens_BX = jnp.where(jnp.arange(g + 1)[None] == num_accepted_B[:, None],
                        final_B[:, None].astype(draft_BG.dtype), tokens_BX)
  beta_BG = acceptance_prob(p_logp_BXV[:, :g], q_logp_BGV)
  return num_accepted_B, tokens_BX, beta_BG


def emitted_distribution(p_logp_BGV: jax.Array, q_logp_BGV: jax.Array) -> jax.Array:
  """The law of the token `verify` emits at a reached position, computed from p and q.

  A draft token d ~ q is kept with probability min(1, p(d) / q(d)); otherwise (probability
  1 - beta) the token comes from norm(max(0, p - q)). The emitted law is therefore
  min(p, q) + (1 - beta) * norm(max(0, p - q)), which is p by algebra; evaluated in float
  it measures how far the implementation's arithmetic is from that identity.

  Returns:
    probs_BGV (float32), with `verify`'s fallback to p where the residual has no mass.
  """
  p_BGV, q_BGV = jnp.exp(p_logp_BGV), jnp.exp(q_logp_BGV)
  kept_BGV = jnp.minimum(p_BGV, q_BGV)
  residual_BGV = jnp.maximum(p_BGV - q_BGV, 0.0)
  mass_BG1 = jnp.sum(residual_BGV, -1, keepdims=True)
  residual_BGV = jnp.where(mass_BG1 > 0, residual_BGV / jnp.where(mass_BG1 > 0, mass_BG1, 1),
                           p_BGV)
  return kept_BGV + (1 - jnp.sum(kept_BGV, -1, keepdims=True)) * residual_BGV


def kl_divergence(probs_BGV: jax.Array, logp_BGV: jax.Array) -> jax.Array:
  """KL(probs || exp(logp)) per position; inf where probs has mass off logp's support."""
  log_ratio_BGV = jnp.log(jnp.where(probs_BGV > 0, probs_BGV, 1.0)) - logp_BGV
  return jnp.sum(jnp.where(probs_BGV > 0, probs_BGV * log_ratio_BGV, 0.0), axis=-1)
