"""AWQ: alpha = 0 is RTN, the search never loses to it, salient channels, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from algo_testdata import correlated_inputs, out_err, outlier_inputs, weight
from qjax.algorithms import absmean_update, awq_search, hessian_update, output_error
from qjax.core import dequantize, fp8_format, int_format, quantize

FORMATS = [int_format(4, channel_axes=(1,)), int_format(3, group_size=32, channel_axes=(1,)),
           int_format(4, group_size=64, channel_axes=(1,), symmetric=False)]


def _stats(x):
  return absmean_update(None, x, 0)[0], hessian_update(None, x, 0)[0]


def _w_hat(r):
  return dequantize(r.qweight) / r.s_D[:, None]


@pytest.fixture(scope='module')
def salient():
  x, idx = outlier_inputs(m=1024, d=256, n_out=6, mag=(5.0, 20.0))
  return x, idx, weight()


def test_absmean_streams_in_batches():
  x = correlated_inputs(m=300, d=32)
  stat, n = None, 0
  for i in range(0, 300, 70):
    stat, n = absmean_update(stat, x[i:i + 70], n)
  np.testing.assert_allclose(stat, jnp.mean(jnp.abs(x), axis=0), rtol=1e-5)


def test_output_error_is_the_per_token_output_mse():
  x = correlated_inputs(m=200, d=64)
  dw = weight(64, 16, seed=5) * 0.01
  h, _ = hessian_update(None, x, 0)
  np.testing.assert_allclose(output_error(dw, h), jnp.sum((x @ dw) ** 2) / 200, rtol=1e-4)


@pytest.mark.parametrize('fmt', FORMATS, ids=lambda f: f.name)
def test_alpha_zero_is_rtn_exactly(salient, fmt):
  x, _, w = salient
  r = awq_search(w, *_stats(x), fmt, alpha=0.0)
  rtn = quantize(w, fmt)
  np.testing.assert_array_equal(r.s_D, 1.0)
  np.testing.assert_array_equal(r.qweight.codes(), rtn.codes())
  np.testing.assert_array_equal(r.qweight.scale, rtn.scale)


@pytest.mark.parametrize('fmt', FORMATS, ids=lambda f: f.name)
def test_search_never_worse_than_alpha_zero(fmt):
  # Correlated inputs without planted outliers: the search has little to gain, must not lose.
  x, w = correlated_inputs(m=512, d=256), weight()
  act, h = _stats(x)
  r, r0 = awq_search(w, act, h, fmt), awq_search(w, act, h, fmt, alpha=0.0)
  assert r.error <= r0.error and float(r.errors[0]) == r0.error
  assert out_err(x, w, _w_hat(r)) <= out_err(x, w, _w_hat(r0)) * (1 + 1e-5)
  rc = awq_search(w, act, h, fmt, clip_search=True)
  assert rc.error <= r.error


@pytest.mark.parametrize('bits', [3, 4])
@pytest.mark.parametrize('group', [None, 32])
def test_beats_rtn_on_salient_channels(salient, bits, group):
  x, idx, w = salient
  fmt = int_format(bits, group_size=group, channel_axes=(1,))
  r = awq_search(w, *_stats(x), fmt)
  rtn = out_err(x, w, dequantize(quantize(w, fmt)))
  awq = out_err(x, w, _w_hat(r))
  assert 0 < r.alpha and awq < 0.8 * rtn, (awq, rtn, r.alpha)
  assert np.all(np.asarray(r.s_D)[idx] > 1.0)  # salient rows are scaled up


def test_bad_input_is_named(salient):
  x, _, w = salient
  act, h = _stats(x)
  fmt = int_format(4, channel_axes=(1,))
  with pytest.raises(ValueError, match=r'act_absmean_D holds 1 NaN/Inf.*index \(7,\)'):
    awq_search(w, act.at[7].set(jnp.nan), h, fmt)
  with pytest.raises(ValueError, match='act_absmean_D.3. = -1 is negative'):
    awq_search(w, act.at[3].set(-1.0), h, fmt)
  with pytest.raises(ValueError, match='all zeros'):
    awq_search(w, jnp.zeros_like(act), h, fmt)
  with pytest.raises(ValueError, match=r'alpha=1.5 is outside \[0, 1\]'):
    awq_search(w, act, h, fmt, alpha=1.5)
  with pytest.raises(ValueError, match=r'bits in \(2, 3, 4, 5, 6, 8\)'):
    awq_search(w, act, h, fp8_format('e5m2'))
  with pytest.raises(ValueError, match=r'expected act_absmean_D of shape \(256,\)'):
    awq_search(w, act[:10], h, fmt)
  with pytest.raises(ValueError, match='x_MD holds 1 NaN/Inf'):
    absmean_update(None, x.at[0, 0].set(jnp.inf), 0)
