"""A model's KV format: full forward == quantized-cache serving, STE gradients, bad formats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import int_format
from qjax.nn import (Transformer, TransformerConfig, greedy_generate, greedy_step, init_cache,
                     kv_format, kvcache, logits_step, with_kv_format)
from qjax.nn.attention import attend
from qjax.nn.rope import apply_rope

CFG = TransformerConfig.tiny()  # GQA, global attention
GROUPED_INT4 = int_format(4, channel_axes=(0, 1, 2), group_size=8, group_axis=3)


def _tokens(b, t, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def _forwards(model):
  graphdef, state = nnx.split(model)
  full = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c))
  return state, full, step


def _prefill_decode(state, step, tokens, cache, prefill=5):
  logits, cache = step(state, tokens[:, :prefill], cache)
  chunks = [logits]
  for i in range(prefill, tokens.shape[1]):
    logits, cache = step(state, tokens[:, i:i + 1], cache)
    chunks.append(logits)
  return np.asarray(jnp.concatenate(chunks, 1))


@pytest.mark.parametrize('fmt', ['int8', 'int4', 'fp8', GROUPED_INT4],
                         ids=lambda f: getattr(f, 'name', f))
@pytest.mark.backend(
    'cpu',
    reason=(
        'bit-identical logits across two compiled programs hold on XLA:CPU; XLA:GPU fuses'
        ' them differently'))
def test_full_forward_equals_serving_through_a_cache_of_the_format(fmt):
  """Bit for bit where the float model's own cache is (one prefill of the whole sequence).

  A decode step computes K/V with matmuls of other shapes than the full forward, so there
  the float model differs by float rounding (`test_transformer`: 1e-5); the quantized cache
  adds nothing to that: its logits equal a float cache holding the fake-quantized K/V bit for
  bit (quantize-on-write == `fake_quant`), so no code rounds differently.
  """
  model = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(0)), fmt)
  state, full, step = _forwards(model)
  tokens = _tokens(2, 10)
  want = np.asarray(full(state, tokens))
  got, _ = step(state, tokens, init_cache(CFG, 2, 10, fmt=kv_format(model)))
  np.testing.assert_array_equal(np.asarray(got), want)

  quantized = _prefill_decode(state, step, tokens, init_cache(CFG, 2, 12, fmt=kv_format(model)))
  np.testing.assert_allclose(quantized, want, atol=1e-5 * np.abs(want).max(), rtol=0)
  float_cache = _prefill_decode(state, step, tokens, init_cache(CFG, 2, 12))
  np.testing.assert_array_equal(quantized, float_cache)

  # ... and the format does change the model: K/V really are quantized in the full forward.
  plain = np.asarray(_forwards(with_kv_format(model, None))[1](state, tokens))
  assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()


def test_kv_gradient_is_straight_through():
  """d out / d (k, v) with a KV format == d attend / d (k, v) at the quantized k, v (STE)."""
  attn = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(1)), 'int4').layers[0].attn
  keys = jax.random.split(jax.random.key(2), 4)
  b, t, n, k, h = 2, 6, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
  q = jax.random.normal(keys[0], (b, t, n, h)) * h ** -0.5
  k_BTKH = apply_rope(jax.random.normal(keys[1], (b, t, k, h)), jnp.arange(t)[None], 1e4)
  v_BTKH = jax.random.normal(keys[2], (b, t, k, h))
  r = jax.random.normal(keys[3], (b, t, n, h))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))

  def hooked(k_, v_):
    return jnp.sum(attn.core(q, k_, v_, pos, None)[0] * r)

  def plain(k_, v_):
    return jnp.sum(attend(q, k_, v_, pos, pos) * r)

  kq, vq = kvcache.through_format(attn.kv_fmt, k_BTKH, v_BTKH)
  assert not np.array_equal(kq, k_BTKH)
  np.testing.assert_array_equal(hooked(k_BTKH, v_BTKH), plain(kq, vq))
  got = jax.grad(hooked, argnums=(0, 1))(k_BTKH, v_BTKH)
  want = jax.grad(plain, argnums=(0, 1))(kq, vq)
  for g, w in zip(got, want):
    assert float(jnp.abs(g).max()) > 0
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
  # not the gradient at the float k, v: the forward really ran at the quantized values
  assert not np.allclose(got[0], jax.grad(plain)(k_BTKH, v_BTKH), rtol=1e-3, atol=1e-5)


def test_greedy_generation_caches_in_the_models_format(monkeypatch):
  model = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(0)), 'int4')
  built = []
  real = kvcache.init_cache
  monkeypatch.setattr(kvcache, 'init_cache',
                      lambda *a, **kw: built.append(kw.get('fmt')) or real(*a, **kw))
  out = greedy_generate(model, _tokens(2, 4), 5)
  assert [f.name for f in built] == ['int4-ch012']
  # the same tokens as argmax of the full forward, which quantizes K/V the same way
  full = np.asarray(model(out[:, :-1]))
  np.testing.assert_array_equal(np.argmax(full[:, 3:], -1), np.asarray(out[:, 4:]))


def test_bad_kv_formats_are_clear_value_errors():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"fmt='int3' is unknown; use one of \['fp8', "
                                       r"'fp8_e5m2', 'int4', 'int8'\]"):
    with_kv_format(model, 'int3')
  with pytest.raises(ValueError, match='fmt=4 is not a KV cache format'):
    with_kv_format(model, 4)
  with pytest.raises(ValueError, match='scale per token and kv head'):
    with_kv_format(model, int_format(8, channel_axes=(2,)))
  with pytest.raises(ValueError, match='head_dim=32 by 12, which does not divide it'):
    with_kv_format(model, int_format(8, channel_axes=(0, 1, 2), group_size=12, group_axis=3))
  m4 = with_kv_format(model, 'int4')
  with pytest.raises(ValueError, match='stores K/V as int4-ch012.*cache holds int8-ch012'):
    m4(_tokens(1, 3), cache=init_cache(CFG, 1, 8, fmt='int8'))
  m4.layers[1].attn.kv_fmt = None
  with pytest.raises(ValueError, match=r"different KV formats \['float', 'int4-ch012'\]"):
    kv_format(m4)


def test_writing_past_the_cache_at_the_step_boundary_is_an_error():
  """The jitted step functions check on the host before they dispatch: an overflowing step
  raises, naming the row, instead of clamping onto the last slots."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  _, cache = greedy_step(model, _tokens(2, 6), init_cache(CFG, 2, 8))
  _, fits = greedy_step(model, _tokens(2, 2), cache)  # exactly full: fine
  np.testing.assert_array_equal(fits.length, [8, 8])
  for step in (greedy_step, logits_step):
    with pytest.raises(ValueError, match='row 0 has 8 cached \\+ 1 new tokens exceed the '
                                         'cache max_len=8'):
      step(model, _tokens(2, 1), fits)
