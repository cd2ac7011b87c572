"""The engine's jitted programs: the packed step, the decode block, and the one way both draw.

`draw` takes a row's token from its logits as the sampler does (`qjax.infer.sampling.sample`,
per-row seeds at the row's output index); a batch whose rows are all greedy takes the argmax
(`argmax_or_non_finite`) and skips the sampler's passes over the vocabulary, unless a
repetition penalty changes the argmax. A row whose logits are not finite gets `NON_FINITE`.

`step` runs one packed step (`qjax.infer.engine`): every token against the paged cache, then
`draw` at each row's last token. `decode_block` runs up to U decode steps of the live rows on
the library's one decode loop (`qjax.nn.decode_core.run_block`), each step feeding every
live row's last token in the unpacked (B, 1) layout and drawing with `draw`; the loop ends a
row at a stop token, its max_tokens or a non-finite logit, all on the device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qjax.infer import paged
from qjax.infer.sampling import row_keys, sample
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.decode_core import LoopState, run_block
from qjax.nn.generate import argmax_or_non_finite
from qjax.nn.model_split import merge

STEP = 'engine.step'  # the names the programs count their traces under (`qjax.nn.traces`)
BLOCK = 'engine.decode_block'


def _greedy(logits_BV):
  """Greedy tokens and their model log-probabilities, as `sample` gives for greedy rows."""
  tok_B = argmax_or_non_finite(logits_BV)
  lse_B = jax.nn.logsumexp(logits_BV, axis=-1)
  return tok_B, jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B


def draw(logits_BV, params, position_B, seen_BV=None):
  """Tokens and model log-probabilities of a batch's rows (module docstring)."""
  def sampled(x_BV):
    tok_B, logprob_B = sample(x_BV, params, row_keys(params.seed_B, position_B), seen_BV)
    return validate.mark_non_finite(tok_B, x_BV), logprob_B

  if seen_BV is not None:  # the penalty changes the argmax: the general path
    return sampled(logits_BV)
  return jax.lax.cond(jnp.all(params.temperature_B == 0), _greedy, sampled, logits_BV)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3,))
def step(graphdef, state, tokens_BT, cache, last_B, params, position_B, seen_BV):
  """One packed step: returns each row's (token, log-probability) at its last fed token and
  the cache."""
  traces.traced(STEP)
  model = merge(graphdef, state)
  x_BTD, cache = paged.forward(model, tokens_BT, cache)
  x_B1D = x_BTD.reshape(-1, 1, x_BTD.shape[-1])[last_B]  # last_B: each row's last token
  tok_B, logprob_B = draw(model.logits(x_B1D)[:, 0], params, position_B, seen_BV)
  return tok_B, logprob_B, cache


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def decode_block(graphdef, state, cache, rows: LoopState, params, block: int, stop_early):
  """Up to `block` decode steps of the live rows on `decode_core.run_block` (module
  docstring); ends early when no row is live, or, with `stop_early`, once a row finished.
  Returns (cache, rows, tok_BW, logprob_BW, num_B): row b generated tok_BW[b, :num_B[b]].
  The values of rows that are not live are never read (they may differ from what the host
  would build for an idle row)."""
  traces.traced(BLOCK)
  model = merge(graphdef, state)

  def one(rows, cache):
    cache = dataclasses.replace(cache, num_new=rows.live_B.astype(jnp.int32))
    x_BTD, cache = paged.forward(model, rows.tok_B[:, None], cache)
    tok_B, lp_B = draw(model.logits(x_BTD)[:, 0], params, rows.count_B)
    return tok_B[:, None], lp_B[:, None], jnp.ones_like(rows.count_B), rows.carry, cache

  out, cache = run_block(one, rows, cache, block, stop_early=stop_early)
  cache = dataclasses.replace(cache, num_new=jnp.zeros_like(cache.num_new))
  return cache, out.state, out.tok_BW, out.extra_BW, out.num_B
