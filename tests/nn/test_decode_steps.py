"""`generate.decode_steps`: many decode steps in one dispatch, the same tokens as one step per
call, one compilation per block length, the cache's room checked before anything runs."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, generate,
                     init_cache, quantize_model)


@pytest.fixture(scope='module')
def model():
  return Transformer(TransformerConfig.tiny(max_len=48), rngs=nnx.Rngs(3))


def _prompt(b=2, t=5):
  return jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, t)), jnp.int32)


def _stepwise(m, prompt, steps):
  cache = init_cache(m.config, prompt.shape[0], 40)
  tok, cache = generate.greedy_step(m, prompt, cache)
  out = [tok]
  for _ in range(steps - 1):
    tok, cache = generate.greedy_step(m, tok[:, None], cache)
    out.append(tok)
  return np.stack(out, 1)


@pytest.mark.parametrize('quantized', [False, True])
def test_block_equals_one_step_per_call(model, quantized):
  m = model
  if quantized:
    m = quantize_model(Transformer(model.config, rngs=nnx.Rngs(3)),
                       QuantPolicy((QuantRule('.*', int_format(4, group_size=32)),)))[0]
  prompt, steps = _prompt(), 9
  want = _stepwise(m, prompt, steps)
  cache = init_cache(m.config, 2, 40)
  tok, cache = generate.greedy_step(m, prompt, cache)
  new, extra, cache, carry = generate.decode_steps(m, tok, cache, steps - 1)
  np.testing.assert_array_equal(np.concatenate([np.asarray(tok)[:, None], new], 1), want)
  assert new.shape == (2, steps - 1) and extra.shape == (2, steps - 1) and carry == ()
  np.testing.assert_array_equal(cache.length, [5 + steps - 1] * 2)
  np.testing.assert_array_equal(generate.greedy_generate(m, prompt, steps)[:, 5:], want)


def test_one_compilation_per_block_length(model):
  prompt = _prompt()
  before = generate.step_compilations()['block']
  for steps in (5, 6, 7):  # one block of 8 (a cache size no other test uses)
    cache = init_cache(model.config, 2, 36)
    tok, cache = generate.greedy_step(model, prompt, cache)
    generate.decode_steps(model, tok, cache, steps)
  assert generate.step_compilations()['block'] - before == 1


def test_a_pick_with_a_carry(model):
  """A pick threads its carry through the loop: here, a count of steps and a forced token."""
  def pick(logits_BV, step, carry):
    del logits_BV
    tok_B = jnp.full((2,), 7, jnp.int32) + step
    return tok_B, jnp.full((2,), 0.5), carry + 1
  cache = init_cache(model.config, 2, 40)
  tok, cache = generate.greedy_step(model, _prompt(), cache)
  new, extra, _, carry = generate.decode_steps(model, tok, cache, 4, pick, jnp.int32(0))
  np.testing.assert_array_equal(new, [[7, 8, 9, 10]] * 2)
  np.testing.assert_array_equal(extra, 0.5)
  assert int(carry) == 4


def test_no_room_is_refused_before_the_loop(model):
  cache = init_cache(model.config, 2, 8)
  tok, cache = generate.greedy_step(model, _prompt(), cache)
  with pytest.raises(ValueError, match='exceed the cache max_len=8'):
    generate.decode_steps(model, tok, cache, 4)
  with pytest.raises(ValueError, match='block=2 is shorter than num_steps=3'):
    generate.decode_steps(model, tok, cache, 3, block=2)
