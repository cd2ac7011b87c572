"""Prompts padded to buckets: one prefill compile for lengths 5, 6, 7; the same outputs."""

import jax
import numpy as np
import pytest
from flax import nnx

from qjax.nn import (Transformer, TransformerConfig, generate, greedy_generate, greedy_step,
                     init_cache, logits_step)

# Layer 0 local (window 8), layer 1 global: padding meets a ring and a full-length layer.
CFG = TransformerConfig.tiny(num_layers=2, sliding_window=8, global_every=2, max_len=64)


@pytest.fixture(scope='module')
def model_and_tokens():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 24), 0, CFG.vocab_size))
  return model, tokens, np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))


def test_bucket_lengths():
  assert [generate.bucket_length(t) for t in (1, 2, 5, 7, 8, 9)] == [1, 2, 8, 8, 8, 16]
  assert generate.bucket_length(5, (4, 12, 32)) == 12
  assert generate.bucket_length(40, (4, 12, 32)) == 40  # above every bucket: unpadded
  assert generate.bucket_length(5, ()) == 5


def test_prompts_of_5_6_7_compile_one_prefill_with_unpadded_outputs(model_and_tokens):
  model, tokens, full = model_and_tokens
  before = generate.step_compilations()['greedy']
  for t in (5, 6, 7):
    tok, cache = greedy_step(model, tokens[:, :t], init_cache(CFG, 2, 32))
    np.testing.assert_array_equal(tok, full[:, t - 1].argmax(-1))
    assert int(cache.length[0]) == t
    tok, _ = greedy_step(model, tokens[:, t:t + 1], cache)  # decode on the padded prefill
    np.testing.assert_array_equal(tok, full[:, t].argmax(-1))
  assert generate.step_compilations()['greedy'] - before == 2  # one prefill, one decode
  with pytest.raises(ValueError, match='buckets=.*must be positive ints'):
    greedy_step(model, tokens[:, :5], init_cache(CFG, 2, 32), buckets=(0,))


def test_padded_logits_equal_the_unpadded_ones_past_a_ring(model_and_tokens):
  model, tokens, full = model_and_tokens
  # A 12-slot ring; prompts of 13..15 tokens padded to 16: the read-then-write path.
  before = generate.step_compilations()['logits']
  for t in (13, 15):
    cache = init_cache(CFG, 2, 40, ring_slack=4)
    assert cache.k[0].shape[1] == 12
    logits, cache = logits_step(model, tokens[:, :t], cache, buckets=None)
    assert logits.shape[1] == t
    np.testing.assert_allclose(logits, full[:, :t], rtol=2e-4, atol=2e-4)
    for p in range(t, 24):  # decode past the window: the padding was never stored
      logits, cache = logits_step(model, tokens[:, p:p + 1], cache)
      np.testing.assert_allclose(logits[:, 0], full[:, p], rtol=2e-4, atol=2e-4)
  assert generate.step_compilations()['logits'] - before == 2  # width 16, and T = 1


def test_greedy_generate_shares_its_compiles_across_prompt_lengths(model_and_tokens):
  model, tokens, _ = model_and_tokens
  got5 = greedy_generate(model, tokens[:, :5], 4)  # prefill width 8, cache 16
  before = generate.step_compilations()['greedy']
  got7 = greedy_generate(model, tokens[:, :7], 4)
  assert generate.step_compilations()['greedy'] == before  # the same two executables
  np.testing.assert_array_equal(got7, greedy_generate(model, tokens[:, :7], 4, buckets=()))
  assert got5.shape == (2, 9)
  np.testing.assert_array_equal(got5[:, :5], tokens[:, :5])
