"""Speculative decoding inside the engine: greedy rounds give the plain engine's tokens
(== greedy alone, test_engine) while rows accept different numbers of draft tokens; several
rounds per dispatch on the one decode loop give the tokens of one round per dispatch."""

import jax
import numpy as np
import pytest
from flax import nnx

from qjax.infer import Engine, EngineConfig, SamplingParams, SpeculativeEngine, layer_skip_draft
from qjax.nn import Transformer, TransformerConfig

CFG = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=48)
LENS, MAX_TOKENS = (3, 19, 9, 5), (9, 7, 12, 8)


def _prompts(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(LENS))
  return [np.asarray(jax.random.randint(k, (n,), 0, CFG.vocab_size)).tolist()
          for k, n in zip(keys, LENS)]


def test_greedy_rounds_equal_plain_decoding_with_per_row_accepted_lengths():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  cfg = EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=1, ring=False)
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
  plain = Engine(model, cfg)
  want = plain.generate(_prompts(), params)
  engine = SpeculativeEngine(model, layer_skip_draft(model, 1), cfg, gamma=3)
  assert engine.generate(_prompts(), params) == want
  st = engine.spec_stats
  # The 1-layer draft agrees with the 2-layer target only sometimes: rounds end at
  # different draft positions, so rows advance by different lengths.
  assert st.rounds > 0 and 0 < st.alpha < 1
  assert st.accepted_A[0] > 0 and st.reached_A[0] > st.accepted_A[0]
  assert 1 < st.tokens_per_pass < 4
  assert engine.stats.steps < plain.stats.steps  # fewer target passes for the same tokens
  assert engine.allocator.num_free == 31
  np.testing.assert_allclose(st.tokens_per_pass, st.tokens / st.rounds)
  with pytest.raises(ValueError, match="preemption='swap'; only 'recompute'"):
    SpeculativeEngine(model, model, EngineConfig(preemption='swap'))
  with pytest.raises(ValueError, match='repetition_penalty=1.2 is not supported'):
    engine.add_request([1, 2], SamplingParams(repetition_penalty=1.2))
  with pytest.raises(ValueError, match='gamma=0 must be an int >= 1'):
    SpeculativeEngine(model, model, cfg, gamma=0)


DISPATCH_MAX_TOKENS = (9, 17, 12, 8)


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


def _run(model, rounds, params):
  cfg = EngineConfig(max_batch=2, page_size=4, num_pages=40, chunk_size=4, ring=False)
  engine = SpeculativeEngine(model, layer_skip_draft(model, 1), cfg, gamma=3,
                             rounds_per_dispatch=rounds)
  return engine.generate(_prompts(1), params), engine


def test_several_rounds_per_dispatch_give_the_tokens_of_one(model):
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in DISPATCH_MAX_TOKENS]
  want, one = _run(model, 1, params)
  # A stop token from the middle of a row's output: the device ends that row there.
  stop = want[1][6]
  params[1] = SamplingParams(temperature=0.0, max_tokens=DISPATCH_MAX_TOKENS[1],
                             stop_tokens=(stop,))
  want_stop, _ = _run(model, 1, params)
  assert want_stop[1] == want[1][:want[1].index(stop) + 1]
  for rounds in (2, 5):
    got, engine = _run(model, rounds, params)
    assert got == want_stop
    assert engine.allocator.num_free == 39
  got, engine = _run(model, 4, [SamplingParams(temperature=0.0, max_tokens=n)
                                for n in DISPATCH_MAX_TOKENS])
  assert got == want
  st, st1 = engine.spec_stats, one.spec_stats
  assert st.rounds == st1.rounds and st.tokens == st1.tokens
  np.testing.assert_array_equal(st.accepted_A, st1.accepted_A)
  np.testing.assert_allclose(st.beta_sum_A, st1.beta_sum_A, rtol=1e-5)
  assert engine.stats.steps == one.stats.steps  # the same rounds, fewer dispatches
  assert engine.stats.dispatches < one.stats.dispatches
  with pytest.raises(ValueError, match='rounds_per_dispatch=0'):
    SpeculativeEngine(model, model, EngineConfig(ring=False), rounds_per_dispatch=0)


def test_sampled_requests_run_the_same_rounds_at_any_rounds_per_dispatch(model):
  params = [SamplingParams(temperature=0.8, seed=s, max_tokens=n)
            for s, n in enumerate(DISPATCH_MAX_TOKENS)]
  want, one = _run(model, 1, params)
  got, engine = _run(model, 3, params)
  assert got == want
  assert engine.spec_stats.rounds == one.spec_stats.rounds > 0
