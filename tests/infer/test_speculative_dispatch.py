"""`speculative_generate` with several rounds per dispatch: the tokens and statistics of one
round per dispatch (greedy and sampled), and greedy still equals `greedy_generate`."""

import numpy as np
import pytest
from flax import nnx

from qjax.infer import SamplingParams, layer_skip_draft, speculative_generate
from qjax.nn import Transformer, TransformerConfig, greedy_generate

CFG = TransformerConfig.tiny(max_len=48)


@pytest.fixture(scope='module')
def models():
  target = Transformer(CFG, rngs=nnx.Rngs(2))
  return target, layer_skip_draft(target, 1)


def _prompt():
  return np.random.default_rng(3).integers(0, CFG.vocab_size, (3, 5))


@pytest.mark.parametrize('params', [
    SamplingParams(temperature=0.0),
    [SamplingParams(temperature=0.9, seed=s, stop_tokens=(7,)) for s in (1, 2, 3)]])
def test_rounds_per_dispatch_do_not_change_tokens_or_stats(models, params):
  target, draft = models
  want, want_st = speculative_generate(target, draft, _prompt(), 14, params, gamma=3,
                                       rounds_per_dispatch=1)
  for rounds in (3, 16):
    got, st = speculative_generate(target, draft, _prompt(), 14, params, gamma=3,
                                   rounds_per_dispatch=rounds)
    np.testing.assert_array_equal(got, want)
    assert (st.rounds, st.tokens) == (want_st.rounds, want_st.tokens)
    np.testing.assert_array_equal(st.accepted_A, want_st.accepted_A)
    np.testing.assert_allclose(st.beta_sum_A, want_st.beta_sum_A, rtol=1e-5)
  if isinstance(params, SamplingParams):
    np.testing.assert_array_equal(want, greedy_generate(target, _prompt(), 14))


def test_bad_rounds_per_dispatch_is_refused(models):
  with pytest.raises(ValueError, match='rounds_per_dispatch=0'):
    speculative_generate(*models, _prompt(), 4, rounds_per_dispatch=0)
