"""LLM.int8(): threshold 0 is the float product, outlier features stay in float, jit; the
dynamic trigger rate (features and tokens in float) counted on constructed inputs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.algorithms import llm_int8_matmul, outlier_counts, outlier_features
from qjax.algorithms.llm_int8 import convert_layer, llm_int8_layers, trigger_rate
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers,
                     quantize_model)
from qjax.nn.layers import tap_inputs
from qjax.algorithms.llm_int8_core import A8_FMT, W8_FMT
from qjax.core import int_format, qdot, quantize

D = 2048  # wide enough that two outlier features are < 0.1% of the columns


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(64, D))
  x[:, [17, 1500]] *= rng.uniform(20.0, 60.0, size=2)  # systematic outlier features
  w = rng.normal(size=(D, 128)) / np.sqrt(D)
  return jnp.asarray(x.astype(np.float32)), jnp.asarray(w.astype(np.float32))


def test_threshold_zero_is_the_float_product():
  x, w = _data()
  y, frac = llm_int8_matmul(x, w, threshold=0.0)
  np.testing.assert_array_equal(y, x @ w)
  assert float(frac) == 0.0


def test_plain_vector_wise_is_qdot_w8a8():
  x, w = _data()
  y, frac = llm_int8_matmul(x, w, threshold=float('inf'))
  np.testing.assert_array_equal(y, qdot(x, quantize(w, W8_FMT), act_fmt=A8_FMT, path='int8'))
  assert float(frac) == 1.0


class DecompositionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_outliers_in_float_beat_plain_int8(self):
    x, w = _data()
    f = self.variant(llm_int8_matmul)
    y, frac = f(x, w, 6.0)
    plain, _ = f(x, w, float('inf'))
    ref = x @ w
    err, err_plain = float(jnp.linalg.norm(y - ref)), float(jnp.linalg.norm(plain - ref))
    assert float(frac) > 0.999 and float(frac) == 1 - 2 / D
    assert err < 0.25 * err_plain, (err, err_plain)

  @chex.variants(with_jit=True, without_jit=True)
  def test_outlier_mask(self):
    x, _ = _data()
    mask = np.asarray(self.variant(outlier_features)(x, 6.0))
    assert list(np.flatnonzero(mask)) == [17, 1500]


def test_int8_weight_storage():
  x, w = _data()
  y_q, _ = llm_int8_matmul(x, quantize(w, W8_FMT))  # outlier rows from the int8 weight
  y_f, _ = llm_int8_matmul(x, w)
  rel = float(jnp.linalg.norm(y_q - y_f) / jnp.linalg.norm(x @ w))
  assert rel < 0.02, rel


def test_leading_axes_are_tokens():
  x, w = _data()
  y, frac = llm_int8_matmul(x.reshape(4, 16, D), w)
  y2, frac2 = llm_int8_matmul(x, w)
  np.testing.assert_allclose(y.reshape(64, -1), y2, rtol=1e-6, atol=1e-6)
  assert float(frac) == float(frac2)


def test_bad_input_is_named():
  x, w = _data()
  with pytest.raises(ValueError, match=r'x_MD holds 1 NaN/Inf.*index \(3, 9\)'):
    llm_int8_matmul(x.at[3, 9].set(jnp.nan), w)
  with pytest.raises(ValueError, match='threshold=-1.0 must be >= 0'):
    llm_int8_matmul(x, w, threshold=-1.0)
  with pytest.raises(ValueError, match='activations have last dimension 100'):
    llm_int8_matmul(x[:, :100], w)
  with pytest.raises(ValueError, match='weight format int4.* is not vector-wise int8'):
    llm_int8_matmul(x, quantize(w, int_format(4, channel_axes=(1,))))
  with pytest.raises(ValueError, match=r'weight format int8 tiles\(2048,128\) is not vector-wise'):
    llm_int8_matmul(x, quantize(w, int_format(8)))


def test_outlier_counts_golden():
  # 8 tokens x 16 features in [-1, 1]; entries above 6 at (2, 3), (5, 3) and (5, 9): the
  # float path takes features {3, 9} (2 of 16), triggered by tokens {2, 5} (2 of 8).
  x = np.random.default_rng(0).uniform(-1, 1, (8, 16)).astype(np.float32)
  x[2, 3], x[5, 3], x[5, 9] = 10.0, -7.0, 8.0
  c = outlier_counts(jnp.asarray(x), 6.0)
  assert float(c['features']) == 2 / 16 and float(c['tokens']) == 2 / 8
  assert float(c['entries']) == 3 / (8 * 16)
  assert list(np.flatnonzero(outlier_features(jnp.asarray(x), 6.0))) == [3, 9]
  c = outlier_counts(jnp.asarray(x.reshape(2, 4, 16)), 9.0)  # leading axes are tokens
  assert float(c['features']) == 1 / 16 and float(c['tokens']) == 1 / 8


def _spiked_tiny(spike_token: int, feature: int):
  """A tiny model whose embedding rows are +-1, except `spike_token`'s, which is 100 at
  `feature`: after block 0's RMS norm (weight 1) every entry is +-1 except that one (~7.97)."""
  cfg = TransformerConfig.tiny(max_len=64)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rows = np.where(np.random.default_rng(1).random((cfg.vocab_size, cfg.d_model)) < 0.5,
                  -1.0, 1.0).astype(np.float32)
  rows[spike_token, feature] = 100.0
  model.embed.w.set_value(jnp.asarray(rows))
  return model


def test_trigger_rate_golden_on_the_tiny_model():
  spike, feature = 7, 5
  model = _spiked_tiny(spike, feature)
  policy = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(8))))
  qmodel = quantize_model(model, policy)[0]
  for _, layer in einsum_layers(qmodel):  # what apply_method(..., 'llm_int8') does, uncalibrated
    if layer.quantized:
      convert_layer(layer, 4.0)
  tokens = np.full((2, 16), 3, np.int32)
  tokens[0, [1, 4]] = spike  # call 1: 2 of 16 tokens spike; call 2: 1 of 16
  tokens[1, 9] = spike
  rate = trigger_rate(qmodel, tokens, batch_size=1)
  assert rate['calls'] == 2 and rate['tokens_seen'] == 32
  d = model.config.d_model
  for proj in ('q_proj', 'k_proj', 'v_proj'):  # block 0's attention sees the normed embedding
    layer = rate['layers'][f'layers/0/attn/{proj}']
    assert layer['features'] == 1 / d, layer  # one column in float, in each call
    assert layer['tokens'] == 3 / 32 and layer['entries'] == 3 / (32 * d), layer
  # Every layer's share agrees with the int8 fraction the layer's own forward computes.
  names = {id(l): p for p, l in llm_int8_layers(qmodel).items()}

  @jax.jit
  def own_fractions(state, tokens_BT):
    m, fracs = nnx.merge(graphdef, state), {}

    def tap(layer, x):
      if id(layer) in names:
        fracs.setdefault(names[id(layer)], layer.outlier_forward(x, layer.w.get_value())[1])

    names.update({id(l): p for p, l in llm_int8_layers(m).items()})
    with tap_inputs(tap):
      m(tokens_BT)
    return fracs

  graphdef, state = nnx.split(qmodel)
  fracs = own_fractions(state, jnp.asarray(tokens[:1]))
  first = jax.tree.map(float, trigger_rate(qmodel, tokens[:1])['layers'])
  assert set(fracs) == set(first) and len(first) == 7 * model.config.num_layers
  for p, frac_int8 in fracs.items():
    np.testing.assert_allclose(first[p]['features'], 1 - float(frac_int8), rtol=1e-6,
                               err_msg=p)


def test_trigger_rate_refuses_a_model_without_llm_int8():
  model = Transformer(TransformerConfig.tiny(max_len=64), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='no LLM.int8'):
    trigger_rate(model, np.zeros((1, 8), np.int32))
