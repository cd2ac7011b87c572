"""The math of speculative decoding: modified rejection sampling and its acceptance theory.

Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318). A draft with
distributions q_1..q_A proposes A = gamma tokens d_1..d_A (d_i ~ q_i, each conditioned on
the ones before); the target scores the same prefixes, giving p_1..p_{A+1}. Position i
accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection j the token
is redrawn from the residual norm(max(0, p_j - q_j)); after A acceptances a bonus token is
drawn from p_{A+1}. Every emitted token then follows p exactly (the theorem of both papers),
whatever q is. The chance that position i accepts, given it is reached, is

    beta_i = sum_v min(p_i(v), q_i(v)) = 1 - TV(p_i, q_i),

so with a constant alpha = E[beta] the tokens emitted per target pass are
(1 - alpha^(A+1)) / (1 - alpha) (`expected_tokens_per_pass`).

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


def acceptance_prob(p_logp_BAV: jax.Array, q_logp_BAV: jax.Array) -> jax.Array:
  """beta_BA = sum_v min(p, q) = 1 - TV(p, q) at each of A positions."""
  return jnp.sum(jnp.minimum(jnp.exp(p_logp_BAV), jnp.exp(q_logp_BAV)), axis=-1)


def verify(p_logp_BXV: jax.Array, q_logp_BAV: jax.Array, draft_BA: jax.Array,
           uniform_BA: jax.Array, final_keys_B: jax.Array):
  """Accept a prefix of the draft and draw the next token (modified rejection sampling).

  Args:
    p_logp_BXV: the target's log-probabilities at X = A + 1 positions (the distribution
      sampled from: `processed_logits`).
    q_logp_BAV: the draft's at the first A positions, from the same transform.
    draft_BA: the draft tokens, d_i drawn from q_i.
    uniform_BA: U[0, 1) draws, one per position, for the acceptance tests.
    final_keys_B: per-row keys for the token drawn after the accepted prefix.

  Returns:
    (num_accepted_B, tokens_BX, beta_BA): accepted draft tokens per row (0..A); the emitted
    tokens (tokens_BX[b, :num_accepted_B[b] + 1] are valid: the accepted prefix of the draft,
    then the residual or bonus token); and the acceptance probability of every position.
  """
  b, g = draft_BA.shape
  v = q_logp_BAV.shape[-1]
  p_draft_BA = jnp.take_along_axis(p_logp_BXV[:, :g], draft_BA[..., None], axis=-1)[..., 0]
  q_draft_BA = jnp.take_along_axis(q_logp_BAV, draft_BA[..., None], axis=-1)[..., 0]
  # u < p/q compared in logs; q(d) > 0 because d was drawn from q.
  accept_BA = jnp.log(uniform_BA) < p_draft_BA - q_draft_BA
  num_accepted_B = jnp.sum(jnp.cumprod(accept_BA.astype(jnp.int32), axis=1), axis=1)

  # The residual at the first rejection; after A acceptances q is "nothing", so it is p.
  q_ext_BXV = jnp.concatenate([jnp.exp(q_logp_BAV), jnp.zeros((b, 1, v), jnp.float32)], 1)
  at_B11 = num_accepted_B[:, None, None]
  p_j_BV = jnp.take_along_axis(jnp.exp(p_logp_BXV), at_B11, axis=1)[:, 0]
  q_j_BV = jnp.take_along_axis(q_ext_BXV, at_B11, axis=1)[:, 0]
  residual_BV = jnp.maximum(p_j_BV - q_j_BV, 0.0)
  # A rejection means p(d) < q(d), so the residual has mass; rounding aside, fall back to p.
  residual_BV = jnp.where(jnp.sum(residual_BV, -1, keepdims=True) > 0, residual_BV, p_j_BV)
  final_B = jax.vmap(jax.random.categorical)(final_keys_B, jnp.log(residual_BV))

  tokens_BX = jnp.concatenate([draft_BA, jnp.zeros((b, 1), draft_BA.dtype)], axis=1)
  tokens_BX = jnp.where(jnp.arange(g + 1)[None] == num_accepted_B[:, None],
                        final_B[:, None].astype(draft_BA.dtype), tokens_BX)
  beta_BA = acceptance_prob(p_logp_BXV[:, :g], q_logp_BAV)
  return num_accepted_B, tokens_BX, beta_BA


def emitted_distribution(p_logp_BAV: jax.Array, q_logp_BAV: jax.Array) -> jax.Array:
  """The law of the token `verify` emits at a reached position, computed from p and q.

  A draft token d ~ q is kept with probability min(1, p(d) / q(d)); otherwise (probability
  1 - beta) the token comes from norm(max(0, p - q)). The emitted law is therefore
  min(p, q) + (1 - beta) * norm(max(0, p - q)), which is p by algebra; evaluated in float
  it measures how far the implementation's arithmetic is from that identity.

  Returns:
    probs_BAV (float32), with `verify`'s fallback to p where the residual has no mass.
  """
  p_BAV, q_BAV = jnp.exp(p_logp_BAV), jnp.exp(q_logp_BAV)
  kept_BAV = jnp.minimum(p_BAV, q_BAV)
  residual_BAV = jnp.maximum(p_BAV - q_BAV, 0.0)
  mass_BA1 = jnp.sum(residual_BAV, -1, keepdims=True)
  residual_BAV = jnp.where(mass_BA1 > 0, residual_BAV / jnp.where(mass_BA1 > 0, mass_BA1, 1),
                           p_BAV)
  return kept_BAV + (1 - jnp.sum(kept_BAV, -1, keepdims=True)) * residual_BAV


def kl_divergence(probs_BAV: jax.Array, logp_BAV: jax.Array) -> jax.Array:
  """KL(probs || exp(logp)) per position; inf where probs has mass off logp's support."""
  log_ratio_BAV = jnp.log(jnp.where(probs_BAV > 0, probs_BAV, 1.0)) - logp_BAV
  return jnp.sum(jnp.where(probs_BAV > 0, probs_BAV * log_ratio_BAV, 0.0), axis=-1)
