"""LLM.int8(): threshold 0 is the float product, outlier features stay in float, jit."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.algorithms import llm_int8_matmul, outlier_features
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
