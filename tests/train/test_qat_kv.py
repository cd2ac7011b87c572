"""KV-cache QAT: train == serve through a quantized cache, gradients through K/V, bad formats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, init_cache,
                     kv_format, with_kv_format)
from qjax.train import QATScale, convert, make_optimizer, make_qat_optimizer, prepare_qat, qat_step

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=32, d_ff=64, max_len=32)
POLICY = QuantPolicy((QuantRule('embed', exempt=True),
                      QuantRule('.*', int_format(4, group_size=16, pow2_scale=True))),
                     path='dequant')


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


def _train(m, steps=3):
  learned = bool(jax.tree.leaves(nnx.state(m, QATScale)))
  opt = make_qat_optimizer(m, make_optimizer(1e-2, 10, 1), scale_lr=1e-2 if learned else None)
  for i in range(steps):
    qat_step(m, opt, jax.random.randint(jax.random.key(10 + i), (4, 17), 0, CFG.vocab_size))
  return m


def _serve(m, tokens, fmt, prefill=6):
  """Logits of prefill + one-token decode steps through a cache of `fmt`, jitted."""
  graphdef, state = nnx.split(m)
  step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c))
  cache = init_cache(CFG, tokens.shape[0], CFG.max_len, fmt=fmt)
  logits, cache = step(state, tokens[:, :prefill], cache)
  chunks = [logits]
  for i in range(prefill, tokens.shape[1]):
    logits, cache = step(state, tokens[:, i:i + 1], cache)
    chunks.append(logits)
  return np.asarray(jnp.concatenate(chunks, 1))


def _full(m, tokens):
  return np.asarray(nnx.jit(lambda m, t: m(t))(m, tokens))


@pytest.mark.parametrize('kv', ['int4', 'fp8'])
def test_qat_forward_equals_prefill_and_decode_through_the_quantized_cache(model, kv):
  """Within 1e-5 of the logit scale, the float model's own cache-vs-full tolerance.

  The quantized cache adds nothing to it: the same decode through a float cache (which then
  holds the fake-quantized K/V) is bit-identical (tests/nn/test_kv_format.py), and the
  converted model serves exactly what the QAT model computes.
  """
  qat = _train(prepare_qat(model, POLICY, learn_scales=True, kv=kv)[0])
  assert kv_format(qat).name == {'int4': 'int4-ch012', 'fp8': 'fp8e4m3-ch012'}[kv]
  tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, CFG.vocab_size)
  want = _full(qat, tokens)
  np.testing.assert_allclose(_serve(qat, tokens, kv), want, atol=1e-5 * np.abs(want).max(),
                             rtol=0)
  qmodel, _ = convert(qat, POLICY)
  assert kv_format(qmodel) == kv_format(qat)
  np.testing.assert_array_equal(_full(qmodel, tokens), want)  # pow2 scales: bit for bit
  np.testing.assert_array_equal(_serve(qmodel, tokens, kv), _serve(qat, tokens, kv))
  # The KV format is really in the forward: without it the logits move.
  assert np.abs(_full(with_kv_format(qat, None), tokens) - want).max() > 1e-3 * np.abs(
      want).max()


def test_gradient_flows_through_k_and_v(model):
  """The k/v projections get gradients (STE), and they are those of the quantized forward."""
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, CFG.vocab_size)
  loss = lambda m: jnp.mean(m(tokens) ** 2)
  with_kv = prepare_qat(model, POLICY, kv='int4')[0]
  without = prepare_qat(model, POLICY)[0]
  grad = nnx.jit(nnx.grad(loss))  # one compile per model; eager, the backward took 3x longer
  g_kv, g_plain = grad(with_kv), grad(without)
  for layer in range(CFG.num_layers):
    for proj in ('k_proj', 'v_proj'):
      g = np.asarray(g_kv['layers'][layer]['attn'][proj]['w'][...])
      g0 = np.asarray(g_plain['layers'][layer]['attn'][proj]['w'][...])
      assert np.isfinite(g).all() and np.abs(g).max() > 1e-3 * np.abs(g0).max()
      assert not np.allclose(g, g0, rtol=1e-3, atol=0)  # computed at the quantized K/V


def test_bad_kv_format_is_a_clear_value_error(model):
  with pytest.raises(ValueError, match=r"prepare_qat: kv='int3' is unknown; use one of "
                                       r"\['fp8', 'fp8_e5m2', 'int4', 'int8'\]"):
    prepare_qat(model, POLICY, kv='int3')
  with pytest.raises(ValueError, match='prepare_qat: kv: KV format int8-ch1 must have a scale '
                                       'per token and kv head'):
    prepare_qat(model, POLICY, kv=int_format(8, channel_axes=(1,)))
