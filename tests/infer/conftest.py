"""Fixtures shared by the paged-cache tests."""

import jax
import pytest
from flax import nnx

from qjax.infer import paged_forward


@pytest.fixture
def paged_logits_step():
  """`make(model)` -> `step(tokens_BT, cache)` -> (logits_BTV, cache): the model's forward
  over a paged cache, jitted. Each `make` traces anew, so it reads QJAX_PAGED_ATTENTION then."""
  def make(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens_BT, cache):
      m = nnx.merge(graphdef, state)
      x_BTD, cache = paged_forward(m, tokens_BT, cache)
      return m.logits(x_BTD), cache
    return lambda tokens_BT, cache: step(state, tokens_BT, cache)
  return make
