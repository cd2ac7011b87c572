"""Nothing wrong passes silently at the library's boundary: token ids, stop strings, NaN
weights, and `Engine.generate` all-or-nothing (`qjax.nn.validate`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import (Engine, EngineConfig, GenerationError, SamplingParams,
                        SpeculativeEngine, sample_generate, speculative_generate)
from qjax.nn import (Transformer, TransformerConfig, decode_step, greedy_generate, greedy_step,
                     init_cache, logits_step)
from qjax.nn import validate
from qjax.nn.generate import argmax_last

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=32)
V = CFG.vocab_size
ENGINE = EngineConfig(max_batch=2, page_size=4, num_pages=20, chunk_size=8)


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def nan_model(model):
  m = nnx.clone(model)
  w = m.layers[0].mlp.up_proj.w
  w.set_value(w.get_value().at[0, 0].set(jnp.nan))
  return m


def _cache(b=1):
  return init_cache(CFG, b, 16)


# The entry points that take token ids, each called on a (1, T) prompt.
ENTRY_POINTS = {
    'greedy_generate': lambda m, p: greedy_generate(m, p, 2),
    'greedy_step': lambda m, p: greedy_step(m, p, _cache()),
    'decode_step': lambda m, p: decode_step(m, p, _cache(), argmax_last),
    'logits_step': lambda m, p: logits_step(m, p, _cache()),
    'sample_generate': lambda m, p: sample_generate(m, p, SamplingParams(seed=0), 2),
    'speculative_generate': lambda m, p: speculative_generate(m, m, p, 2),
    'engine': lambda m, p: Engine(m, ENGINE).generate([p[0]]),
}


@pytest.mark.parametrize('entry', sorted(ENTRY_POINTS))
@pytest.mark.parametrize('bad,message', [
    ([[1, V, 2]], rf'token id {V} at index \(0, 1\) is outside the vocabulary \[0, {V}\)'),
    ([[1, -1]], rf'token id -1 at index \(0, 1\) is outside the vocabulary \[0, {V}\)'),
    ([[1, 1.5, 2]], r'token ids must be integers, got dtype float64'),
    (np.array([[1.0, 2.0]]), r'token ids must be integers, got dtype float64'),
    ([[1, None]], r'token id None is not an integer'),
])
def test_every_entry_point_refuses_bad_ids(model, entry, bad, message):
  if entry == 'engine':  # one prompt of the engine is 1-d: the index has one entry
    message = message.replace(r'\(0, 1\)', r'\(1,\)')
  with pytest.raises(ValueError, match=message):
    ENTRY_POINTS[entry](model, bad)


@pytest.mark.parametrize('prompt,message', [
    ([1, 2, 3], r'token ids of shape \(3,\); expected shape \(B, T\).*wrap it: \[prompt\]'),
    ([[]], r'the prompt is empty \(shape \(1, 0\)\)'),
    ([], r'the prompt is empty'),
    ([[1, 2], [3]], r'token ids \[\[1, 2\], \[3\]\] are ragged; give every row the same'),
])
def test_prompts_of_the_wrong_shape_are_named(model, prompt, message):
  with pytest.raises(ValueError, match='greedy_generate: ' + message):
    greedy_generate(model, prompt, 2)


def test_ids_on_the_device_are_checked_inside_the_step(model):
  # No host read of a device array in the per-token steps: the row gets NaN logits / -1.
  bad = jnp.asarray([[1, 2], [3, V]], jnp.int32)
  logits, _ = logits_step(model, bad, _cache(2))
  assert np.isfinite(np.asarray(logits[0])).all() and np.isnan(np.asarray(logits[1])).all()
  tok, _ = greedy_step(model, bad, _cache(2))
  assert int(tok[0]) >= 0 and int(tok[1]) == validate.NON_FINITE


def test_a_jitted_forward_gives_nan_and_checked_forward_raises(model, nan_model):
  good = jnp.asarray([[1, 2, 3]], jnp.int32)
  np.testing.assert_allclose(validate.checked_forward(model, good), model(good), rtol=1e-5,
                             atol=1e-5)
  # Under jit the gather would clamp id V to row V-1; the logits from its position on are
  # NaN instead (the positions before it never see it, so they keep their values).
  traced = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray([[1, 2, V], [1, 2, 3]])))
  assert np.isnan(traced[0, 2]).all() and np.isfinite(traced[1]).all()
  np.testing.assert_allclose(traced[0, :2], traced[1, :2], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=rf'checked_forward: a token id is outside the '
                                       rf'vocabulary \[0, {V}\)'):
    validate.checked_forward(model, jnp.asarray([[1, 2, V]], jnp.int32))
  with pytest.raises(ValueError, match='checked_forward: the logits are not finite'):
    validate.checked_forward(nan_model, good)


def test_a_cache_overflow_under_a_callers_jit_gives_nan(model):
  # Two calls of 4 tokens on a 6-slot cache: the second used to clamp its writes onto the
  # last slots and return finite, wrong logits. Row 1 starts again at 0: it fits.
  import dataclasses  # pylint: disable=g-import-not-at-top
  step = nnx.jit(lambda m, t, c: m(t, cache=c))
  tokens = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
  logits, cache = step(model, tokens, init_cache(CFG, 2, 6))
  assert np.isfinite(np.asarray(logits)).all()
  cache = dataclasses.replace(cache, length=jnp.asarray([4, 0], jnp.int32))
  logits, _ = step(model, tokens, cache)
  assert np.isnan(np.asarray(logits[0])).all()
  np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(model(tokens[1:]))[0],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('run', [
    lambda m, p: greedy_generate(m, p, 3),
    lambda m, p: sample_generate(m, p, SamplingParams(temperature=1.0, seed=0), 3),
    lambda m, p: speculative_generate(m, m, p, 3, SamplingParams(temperature=1.0)),
], ids=['greedy_generate', 'sample_generate', 'speculative_generate'])
def test_nan_weights_raise_in_the_decode_loops(nan_model, run):
  with pytest.raises(FloatingPointError, match='row 0 .*not finite'):
    run(nan_model, [[1, 2, 3]])


@pytest.mark.parametrize('temperature', [0.0, 1.0])
@pytest.mark.parametrize('speculative', [False, True])
def test_nan_weights_end_engine_requests_with_error(nan_model, temperature, speculative):
  # The speculative engine's first step is a plain one (prefill): NaN shows there already.
  engine = (SpeculativeEngine(nan_model, nan_model, ENGINE, gamma=2) if speculative else
            Engine(nan_model, ENGINE))
  with pytest.raises(GenerationError, match='2 of 2 prompts failed') as info:
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=temperature,
                                                        max_tokens=4))
  assert info.value.outputs == [[], []]  # never token 0
  assert [engine.finish_reason(i) for i in ('0', '1')] == ['error', 'error']
  assert 'logits for output token 0 are not finite' in engine.error('0')
  assert not engine.scheduler.has_work and engine.allocator.num_free == ENGINE.num_pages - 1


def test_finish_reasons_of_healthy_requests(model):
  engine = Engine(model, ENGINE)
  engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
  assert engine.finish_reason('0') == 'length' and engine.error('0') is None


def test_stop_strings_must_be_a_sequence_of_strings():
  with pytest.raises(ValueError, match=r"stop_strings='ab' is one string, not a sequence of "
                                       r"them .*pass stop_strings=\('ab',\)"):
    SamplingParams(stop_strings='ab')
  with pytest.raises(ValueError, match=r'stop_tokens=5 is one id.*stop_tokens=\(5,\)'):
    SamplingParams(stop_tokens=5)
  assert SamplingParams(stop_strings=['ab']).stop_strings == ('ab',)


def test_generate_queues_nothing_when_one_request_is_bad(model):
  engine = Engine(model, ENGINE)
  with pytest.raises(ValueError, match=rf'request 2: token id {V} at index \(0,\)'):
    engine.generate([[1, 2], [3, 4], [V]])
  assert not engine.scheduler.has_work
  out = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2))
  assert len(out) == 1 and len(out[0]) == 2 and engine.stats.steps <= 2  # only its own work


def test_a_speculative_round_with_non_finite_logits_ends_the_request(model, nan_model):
  # A healthy target, a NaN draft: the prompt step is the target's (fine); the first round
  # sees the draft's NaN and ends the request with 'error' instead of drawing from NaN.
  engine = SpeculativeEngine(model, nan_model, ENGINE, gamma=2)
  with pytest.raises(GenerationError) as info:
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
  assert engine.finish_reason('0') == 'error' and len(info.value.outputs[0]) == 1
