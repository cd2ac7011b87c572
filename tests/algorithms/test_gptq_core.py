"""GPTQ: exact RTN at H = I, an independent unblocked reference, gains over RTN, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from algo_testdata import correlated_inputs, out_err, outlier_inputs, weight
from qjax.algorithms import gptq_quantize, hessian_update
from qjax.core import dequantize, fp8_format, int_format, quantize


def _naive_gptq(w, h, fmt, damp=0.01, act_order=False):
  """Textbook GPTQ in float64 numpy: one row at a time, full update, no blocks."""
  w, h = np.array(w, np.float64), np.array(h, np.float64)
  d = w.shape[0]
  dead = np.diag(h) == 0
  h[dead, dead] = 1.0
  w[dead] = 0.0
  h += damp * np.mean(np.diag(h)) * np.eye(d)
  perm = np.argsort(-np.diag(h), kind='stable') if act_order else np.arange(d)
  u = np.linalg.cholesky(np.linalg.inv(h[perm][:, perm])).T
  wp, g = w[perm], fmt.group_size or d
  scales, codes = {}, np.zeros_like(wp)
  for k in range(d):
    grp = perm[k] // g
    if grp not in scales:
      rows = wp[[i for i in range(d) if perm[i] // g == grp]]
      if fmt.symmetric:
        amax = np.abs(rows).max(0) if fmt.channel_axes else np.abs(rows).max()
        s, z = np.where(amax > 0, amax / fmt.qmax, 1.0), 0.0
      else:
        lo = np.minimum(rows.min(0) if fmt.channel_axes else rows.min(), 0)
        hi = np.maximum(rows.max(0) if fmt.channel_axes else rows.max(), 0)
        s = np.where(hi > lo, (hi - lo) / (fmt.qmax - fmt.qmin), 1.0)
        z = np.clip(np.round(fmt.qmin - lo / s), fmt.qmin, fmt.qmax)
      scales[grp] = (s, z)
    s, z = scales[grp]
    c = np.clip(np.round(wp[k] / s) + z, fmt.qmin, fmt.qmax)
    codes[k] = c
    err = (wp[k] - (c - z) * s) / u[k, k]
    wp[k + 1:] -= np.outer(u[k, k + 1:], err)
  return codes[np.argsort(perm)]


@pytest.fixture(scope='module')
def corr():
  x = correlated_inputs()
  h, _ = hessian_update(None, x, 0)
  return x, h, weight()


def test_hessian_streams_in_batches():
  x = correlated_inputs(m=300, d=64)
  h, n = None, 0
  for i in range(0, 300, 70):  # uneven last batch
    h, n = hessian_update(h, x[i:i + 70], n)
  assert n == 300
  np.testing.assert_allclose(h, 2 * x.T @ x / 300, rtol=1e-5, atol=1e-4)
  h3, _ = hessian_update(None, x.reshape(3, 100, 64), 0)  # leading axes are tokens
  np.testing.assert_allclose(h3, h, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('fmt', [
    int_format(4, channel_axes=(1,)),
    int_format(4, channel_axes=(1,), symmetric=False),
    int_format(3, group_size=32, channel_axes=(1,)),
    int_format(3, group_size=32, channel_axes=(1,), symmetric=False),
    int_format(4, group_size=128, channel_axes=(1,)),
    int_format(4, group_size=128, channel_axes=(1,), symmetric=False),
    int_format(2, group_size=32),  # groups shared across F
    int_format(8),  # one scale for the tensor
    int_format(4, group_size=32, channel_axes=(1,), calibration='mse', calibration_arg=20),
    int_format(4, group_size=32, channel_axes=(1,), pow2_scale=True, scale_dtype='bfloat16'),
], ids=lambda f: f.name)
def test_identity_hessian_is_rtn_exactly(fmt):
  w = weight(256, 96)
  # RTN jitted as GPTQ is: eager, each op is its own program, and XLA may round a fused
  # expression differently from the same ops run one by one (1 ulp of an mse-searched scale
  # under the suite's fast-compile flags, tests/conftest.py).
  q, rtn = gptq_quantize(w, jnp.eye(256), fmt), jax.jit(quantize, static_argnums=1)(w, fmt)
  assert jax.tree.structure(q) == jax.tree.structure(rtn) and q.qtype == rtn.qtype
  assert q.data.shape == rtn.data.shape and q.data.dtype == rtn.data.dtype
  assert q.scale.shape == rtn.scale.shape and q.scale.dtype == rtn.scale.dtype
  np.testing.assert_array_equal(q.codes(), rtn.codes())
  np.testing.assert_array_equal(q.scale, rtn.scale)
  if not fmt.symmetric:
    np.testing.assert_array_equal(q.zero_point, rtn.zero_point)


@pytest.mark.parametrize('act_order', [False, True])
@pytest.mark.parametrize('fmt', [int_format(3, group_size=16, channel_axes=(1,)),
                                 int_format(4, channel_axes=(1,), symmetric=False),
                                 int_format(2, group_size=32)],
                         ids=lambda f: f.name)
def test_matches_unblocked_reference(act_order, fmt):
  # D = 96 with 40-row blocks: padding, groups straddling blocks, act-order permutation.
  x = correlated_inputs(m=400, d=96, seed=3)
  x = x.at[:, 7].multiply(20.0)  # makes act-order visit a group out of order
  h, _ = hessian_update(None, x, 0)
  w = weight(96, 48, seed=4)
  q = gptq_quantize(w, h, fmt, block_size=40, act_order=act_order)
  ref = _naive_gptq(w, h, fmt, act_order=act_order)
  # Identical on this data; float32 vs float64 could flip a code at a rounding tie.
  assert np.mean(np.asarray(q.codes()) == ref) > 0.999


def test_block_size_does_not_change_the_math(corr):
  x, h, w = corr
  fmt = int_format(4, group_size=32, channel_axes=(1,))
  a = gptq_quantize(w, h, fmt, block_size=128).codes()
  b = gptq_quantize(w, h, fmt, block_size=48).codes()
  assert np.mean(np.asarray(a) == np.asarray(b)) > 0.999


@pytest.mark.parametrize('bits', [3, 4])
@pytest.mark.parametrize('group', [None, 32])
def test_beats_rtn_on_correlated_inputs(corr, bits, group):
  x, h, w = corr
  fmt = int_format(bits, group_size=group, channel_axes=(1,))
  rtn = out_err(x, w, dequantize(quantize(w, fmt)))
  gptq = out_err(x, w, dequantize(gptq_quantize(w, h, fmt)))
  assert gptq < 0.5 * rtn, (gptq, rtn)


@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('bits', [3, 4])
def test_act_order_not_worse_with_outlier_columns(bits, seed):
  x, _ = outlier_inputs(m=1024, d=128, seed=seed)
  h, _ = hessian_update(None, x, 0)
  w = weight(128, 128, seed=seed + 10)
  fmt = int_format(bits, group_size=32, channel_axes=(1,))
  plain = out_err(x, w, dequantize(gptq_quantize(w, h, fmt)))
  ordered = out_err(x, w, dequantize(gptq_quantize(w, h, fmt, act_order=True)))
  assert ordered <= plain, (ordered, plain)


def test_dead_inputs_quantize_to_zero():
  x = correlated_inputs(m=256, d=64).at[:, [3, 40]].set(0.0)
  h, _ = hessian_update(None, x, 0)
  w = weight(64, 32)
  q = gptq_quantize(w, h, int_format(4, group_size=16, channel_axes=(1,), symmetric=False),
                    act_order=True)
  w_hat = dequantize(q)
  assert np.isfinite(np.asarray(w_hat)).all()
  np.testing.assert_array_equal(w_hat[jnp.array([3, 40])], 0.0)


def test_small_calibration_set_needs_damping():
  x = correlated_inputs(m=8, d=64)  # rank 8 < D = 64: H is singular
  h, _ = hessian_update(None, x, 0)
  w = weight(64, 32)
  q = gptq_quantize(w, h, int_format(4, channel_axes=(1,)))
  assert np.isfinite(np.asarray(dequantize(q))).all()
  with pytest.raises(ValueError, match=r'not positive definite.*raise damp'):
    gptq_quantize(w, h, int_format(4, channel_axes=(1,)), damp=0.0)


def test_bad_input_is_named():
  w, h = weight(64, 32), jnp.eye(64)
  fmt = int_format(4, channel_axes=(1,))
  with pytest.raises(ValueError, match=r'h_DD holds 1 NaN/Inf.*index \(2, 5\)'):
    gptq_quantize(w, h.at[2, 5].set(jnp.nan), fmt)
  with pytest.raises(ValueError, match='x_MD holds 1 NaN/Inf'):
    hessian_update(None, jnp.ones((4, 64)).at[1, 1].set(jnp.inf), 0)
  with pytest.raises(ValueError, match=r'fp8e4m3.*bits in \(2, 3, 4, 5, 6, 8\)'):
    gptq_quantize(w, h, fp8_format('e4m3', channel_axes=(1,)))
  with pytest.raises(ValueError, match=r'h_DD has shape \(32, 32\).*D=64'):
    gptq_quantize(w, jnp.eye(32), fmt)
  with pytest.raises(ValueError, match='damp=-0.1 must be >= 0'):
    gptq_quantize(w, h, fmt, damp=-0.1)
  with pytest.raises(ValueError, match=r'channel_axes=\(0,\) is not supported'):
    gptq_quantize(w, h, int_format(4, channel_axes=(0,)))
  with pytest.raises(ValueError, match='group_size=48 does not divide axis 0'):
    gptq_quantize(w, h, int_format(4, group_size=48, channel_axes=(1,)))
  with pytest.raises(ValueError, match='expected a 2-d weight'):
    gptq_quantize(w[None], h, fmt)
