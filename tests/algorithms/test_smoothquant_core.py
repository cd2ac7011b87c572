"""SmoothQuant: the float product is unchanged, W8A8 error drops with outliers, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from algo_testdata import outlier_inputs, weight
from qjax.algorithms import absmax_update, smooth, smooth_scales, smoothquant_weight, w8a8_matmul
from qjax.algorithms.smoothquant_core import W8_FMT
from qjax.core import quantize


@pytest.fixture(scope='module')
def data():
  x, idx = outlier_inputs(m=512, d=256, n_out=6, mag=(10.0, 50.0))
  return x, idx, weight()


def test_absmax_streams_in_batches(data):
  x = data[0]
  amax = None
  for i in range(0, 512, 100):
    amax = absmax_update(amax, x[i:i + 100])
  np.testing.assert_array_equal(amax, jnp.max(jnp.abs(x), axis=0))


@pytest.mark.parametrize('alpha', [0.0, 0.5, 0.8, 1.0])
def test_float_product_unchanged(data, alpha):
  x, _, w = data
  s = smooth_scales(absmax_update(None, x), w, alpha)
  assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
  xs, ws = smooth(x, w, s)
  y = x @ w
  np.testing.assert_allclose(xs @ ws, y, atol=1e-5 * float(jnp.max(jnp.abs(y))) * 10)


def test_smoothing_lowers_w8a8_error(data):
  x, idx, w = data
  s = smooth_scales(absmax_update(None, x), w, 0.5)
  y = x @ w
  plain = float(jnp.linalg.norm(w8a8_matmul(x, quantize(w, W8_FMT)) - y))
  smoothed = float(jnp.linalg.norm(w8a8_matmul(x, smoothquant_weight(w, s), s) - y))
  assert smoothed < 0.5 * plain, (smoothed, plain)
  assert np.all(np.asarray(s)[idx] > np.median(np.asarray(s)))  # outliers are divided down


def test_dead_channels_get_finite_scales(data):
  x, _, w = data
  amax = absmax_update(None, x.at[:, 3].set(0.0))
  s = smooth_scales(amax, w.at[5].set(0.0), 0.5)
  assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)


def test_bad_input_is_named(data):
  x, _, w = data
  amax = absmax_update(None, x)
  with pytest.raises(ValueError, match=r'alpha=1.5 is outside \[0, 1\]'):
    smooth_scales(amax, w, 1.5)
  with pytest.raises(ValueError, match=r'alpha=-0.1 is outside'):
    smooth_scales(amax, w, -0.1)
  with pytest.raises(ValueError, match=r'act_absmax_D holds 1 NaN/Inf.*index \(9,\)'):
    smooth_scales(amax.at[9].set(jnp.inf), w, 0.5)
  with pytest.raises(ValueError, match='is negative'):
    smooth_scales(amax.at[9].set(-2.0), w, 0.5)
  with pytest.raises(ValueError, match='x_MD holds 1 NaN/Inf'):
    absmax_update(None, x.at[4, 4].set(jnp.nan))
  with pytest.raises(ValueError, match=r'act_absmax_D has shape \(10,\).*D=256'):
    smooth_scales(amax[:10], w, 0.5)
  with pytest.raises(ValueError, match='activations have last dimension 128'):
    w8a8_matmul(x[:, :128], quantize(w, W8_FMT))
