"""Range calibration and error metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import int_format


def _heavy_tailed(seed=0, shape=(64, 256)):
  x = jax.random.normal(jax.random.key(seed), shape)
  return x.at[:, 7].multiply(40.0)  # one outlier per row


def test_absmax_and_minmax_per_granularity():
  x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6) - 5.0
  lo, hi = qjax.compute_range(x, int_format(8, channel_axes=(0,)))
  np.testing.assert_array_equal(hi.ravel(), [5, 6, 12, 18])
  lo, hi = qjax.compute_range(x, int_format(8, channel_axes=(0,), symmetric=False))
  np.testing.assert_array_equal(lo.ravel(), [-5, 1, 7, 13])
  np.testing.assert_array_equal(hi.ravel(), [0, 6, 12, 18])
  # groups of 2 along axis 0 x channels along axis 1: one range per (group, col), shape (2, 6)
  lo, hi = qjax.compute_range(x, int_format(8, group_size=2, channel_axes=(1,)))
  assert hi.shape == (2, 6)
  np.testing.assert_array_equal(hi[1], np.abs(np.asarray(x)[2:4]).max(0))


def test_percentile_clips_below_absmax():
  x = _heavy_tailed()
  fmt = int_format(4, calibration='percentile', calibration_arg=99.0, channel_axes=(0,))
  lo, hi = qjax.compute_range(x, fmt)
  _, amax = qjax.compute_range(x, int_format(4, channel_axes=(0,)))
  assert (hi < amax).all() and (hi > 0).all()
  np.testing.assert_allclose(hi.ravel(), np.percentile(np.abs(np.asarray(x)), 99.0, axis=1),
                             rtol=1e-5)


def test_bad_percentile():
  with pytest.raises(ValueError, match='calibration_arg in \\(50, 100\\]'):
    int_format(4, calibration='percentile', calibration_arg=101)


@pytest.mark.parametrize('bits', [3, 4])
def test_mse_search_never_worse_than_absmax(bits):
  x = _heavy_tailed()
  base = int_format(bits, channel_axes=(0,))
  err_abs = qjax.mse(x, qjax.dequantize(qjax.quantize(x, base)))
  err_mse = qjax.mse(x, qjax.dequantize(qjax.quantize(x, base.replace(calibration='mse'))))
  assert float(err_mse) <= float(err_abs)
  # On Gaussian data at 3 bits clipping strictly helps.
  g = jax.random.normal(jax.random.key(1), (32, 512))
  e1 = qjax.mse(g, qjax.quantize(g, int_format(3, channel_axes=(0,))).dequantize())
  e2 = qjax.mse(g, qjax.quantize(g, int_format(3, channel_axes=(0,), calibration='mse'))
                .dequantize())
  assert float(e2) < 0.9 * float(e1)


def test_metrics_golden():
  x = jnp.array([1.0, -2.0, 3.0, 0.0])
  xh = jnp.array([1.5, -2.0, 3.0, 0.0])
  assert float(qjax.max_abs_error(x, xh)) == 0.5
  assert float(qjax.mse(x, xh)) == 0.0625
  np.testing.assert_allclose(float(qjax.sqnr_db(x, xh)), 10 * np.log10(14 / 0.25), rtol=1e-6)


def test_sqnr_grows_about_6db_per_bit():
  x = jax.random.normal(jax.random.key(0), (64, 1024))
  s = [float(qjax.sqnr_db(x, qjax.quantize(x, int_format(b, channel_axes=(0,))).dequantize()))
       for b in (4, 5, 6, 8)]
  assert all(4.5 < b - a < 7.5 for a, b in zip(s, s[1:3]))
