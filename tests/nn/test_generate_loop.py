"""`generate.decode_loop`: U decode steps per dispatch with stop tokens, per-row token limits
and finished rows on the device; the tokens of every U equal those of one step per call."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import SamplingParams, sample_generate
from qjax.nn import Transformer, TransformerConfig, generate, init_cache


@pytest.fixture(scope='module')
def model():
  return Transformer(TransformerConfig.tiny(max_len=64), rngs=nnx.Rngs(5))


def _prompt(b=3, t=4):
  return jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, t)), jnp.int32)


def _stepwise(m, prompt, steps):
  cache = init_cache(m.config, prompt.shape[0], 40)
  tok, cache = generate.greedy_step(m, prompt, cache)
  out = [tok]
  for _ in range(steps - 1):
    tok, cache = generate.greedy_step(m, tok[:, None], cache)
    out.append(tok)
  return np.stack(out, 1)


@pytest.mark.parametrize('block', [1, 3, 8, None])
def test_every_block_length_gives_the_same_tokens(model, block):
  prompt = _prompt()
  want = _stepwise(model, prompt, 10)
  got = generate.greedy_generate(model, prompt, 10, decode_block=block)
  np.testing.assert_array_equal(np.asarray(got)[:, 4:], want)


def test_stop_tokens_and_row_limits_end_rows_on_the_device(model):
  prompt = _prompt()
  want = _stepwise(model, prompt, 12)
  stop = int(want[1, 5])  # row 1 stops at its first occurrence of this token
  first_stop = int(np.flatnonzero(want[1] == stop)[0])
  cache = init_cache(model.config, 3, 40)
  tok, cache = generate.greedy_step(model, prompt, cache)
  stops = generate.stop_table([[], [stop], []])
  state = generate.LoopState.start(tok, [12, 12, 6], count_B=np.ones(3), stop_BZ=stops)
  loop = generate.decode_loop(model, cache, state, decode_block=4)
  rows = [[int(t)] for t in np.asarray(tok)]
  blocks = 0
  for new_BW, _, num_B in loop:
    blocks += 1
    for b in range(3):
      rows[b] += new_BW[b, :num_B[b]].tolist()
  assert rows[0] == want[0].tolist()
  assert rows[1] == want[1, :first_stop + 1].tolist()  # the stop token is kept
  assert rows[2] == want[2, :6].tolist()
  assert blocks == 3  # 11 steps of the longest row at 4 per block
  assert not np.asarray(loop.state.live_B).any()
  np.testing.assert_array_equal(loop.state.count_B, [12, first_stop + 1, 6])


def test_one_compilation_per_block_length(model):
  before = generate.step_compilations()['block']
  for steps in (9, 11, 13):  # one cache size (16), one block of 5
    generate.greedy_generate(model, _prompt(2, 3), steps, decode_block=5)
  assert generate.step_compilations()['block'] - before == 1


def test_sampling_is_independent_of_the_block_length(model):
  params = SamplingParams(temperature=0.9, top_k=20, seed=3)
  want, want_lp = sample_generate(model, _prompt(), params, 9)
  got, got_lp = sample_generate(model, _prompt(), params, 9, decode_block=2)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(got_lp, want_lp, rtol=1e-5, atol=1e-5)


def test_bad_block_is_refused(model):
  with pytest.raises(ValueError, match='decode_block=0'):
    generate.greedy_generate(model, _prompt(), 4, decode_block=0)
