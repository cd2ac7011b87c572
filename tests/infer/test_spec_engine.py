"""Speculative decoding inside the engine: greedy rounds give the plain engine's tokens
(== greedy alone, test_engine) while rows accept different numbers of draft tokens."""

import jax
import numpy as np
import pytest
from flax import nnx

from qjax.infer import Engine, EngineConfig, SamplingParams, SpeculativeEngine, layer_skip_draft
from qjax.nn import Transformer, TransformerConfig

CFG = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=48)
LENS, MAX_TOKENS = (3, 19, 9, 5), (9, 7, 12, 8)


def _prompts():
  keys = jax.random.split(jax.random.key(0), len(LENS))
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
  assert st.accepted_G[0] > 0 and st.reached_G[0] > st.accepted_G[0]
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
