"""The optional jax.ffi CPU kernel (qjax.kernels): against a numpy reference when it is
available, and a clean, named refusal when it is not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import int_format, qeinsum, quantize
from qjax import kernels

KEY = jax.random.split(jax.random.key(7), 4)


def test_status_names_the_state():
  s = kernels.status()
  assert (s == 'available') == kernels.available()
  assert s == 'available' or any(w in s for w in ('not built', 'failed', 'disabled'))


@pytest.mark.parametrize('m', [1, 5, 16])
def test_kernel_matches_numpy(m):
  x = np.asarray(jax.random.normal(KEY[0], (m, 192)), np.float32)
  w = jax.random.normal(KEY[1], (192, 70)) / 8
  q8 = quantize(w, int_format(8, channel_axes=(1,)))
  q4 = quantize(w, int_format(4, group_size=64, channel_axes=(1,)))
  wb = w.astype(jnp.bfloat16)
  if not kernels.available():
    with pytest.raises(RuntimeError, match='check available'):
      kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8')
    with pytest.raises(ValueError, match="path='kernel'"):
      qjax.qdot(x, q8, path='kernel')
    return
  # numpy reference: codes times scales, f64 sums.
  ref8 = x.astype(np.float64) @ (np.asarray(q8.codes(), np.float64) * np.asarray(q8.scale))
  y8 = kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8')
  np.testing.assert_allclose(y8, ref8, rtol=1e-4, atol=1e-4)
  c4 = np.asarray(q4.codes(), np.float64).reshape(3, 64, 70)
  ref4 = x.astype(np.float64) @ (c4 * np.asarray(q4.scale)[:, None, :]).reshape(192, 70)
  y4 = kernels.gemv(x, q4.data, q4.scale, 'kn', 'int4')
  assert y4.shape == (m, 70)
  np.testing.assert_allclose(y4, ref4, rtol=1e-4, atol=1e-4)
  refb = x.astype(np.float64) @ np.asarray(wb.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(kernels.gemv(x, wb, None, 'kn', 'bf16'), refb, rtol=1e-4, atol=1e-4)
  # the head layout 'nk': W (N, K), contracted last
  qh = quantize(w.T, int_format(4, group_size=32, channel_axes=(0,), group_axis=1))
  ch = np.asarray(qh.codes(), np.float64).reshape(70, 6, 32) * np.asarray(qh.scale)[:, :, None]
  refh = x.astype(np.float64) @ ch.reshape(70, 192).T
  np.testing.assert_allclose(kernels.gemv(x, qh.data, qh.scale, 'nk', 'int4'), refh,
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(kernels.gemv(x, wb.T, None, 'nk', 'bf16'), refb, rtol=1e-4,
                             atol=1e-4)


def test_explicit_kernel_path_and_its_limits():
  w = jax.random.normal(KEY[2], (128, 64))
  x = jax.random.normal(KEY[3], (40, 128))  # more rows than auto sends to the kernel
  q = quantize(w, int_format(8, channel_axes=(1,), symmetric=False))
  with pytest.raises(ValueError, match="path='kernel'"):
    qjax.qdot(x, q, path='kernel')  # zero points: not a kernel layout
  q = quantize(w, int_format(4, group_size=32, channel_axes=(1,)))
  if kernels.available():
    np.testing.assert_allclose(qjax.qdot(x, q, path='kernel'), x @ q.dequantize(), rtol=1e-4,
                               atol=1e-4)
  qf = quantize(w, qjax.fp8_format(channel_axes=(1,)))
  with pytest.raises(ValueError, match="path='kernel'"):
    qjax.qdot(x, qf, path='kernel')  # fp8 codes: no kernel


def _int8_act_reference(x, codes_KN, scale_GN):
  """numpy: x quantized per row and per group of K (scale amax / 127, half-even rounding,
  +-127), integer dots per group, rescaled: qeinsum's 'int8' numerics, written out in f64."""
  x = np.asarray(x, np.float64)
  g = scale_GN.shape[0]
  m, k = x.shape
  xg = x.reshape(m, g, k // g)
  amax = np.abs(xg).max(axis=2, keepdims=True)
  sx = np.where(amax == 0, 1.0, amax.astype(np.float32) / np.float32(127.0)).astype(np.float64)
  qx = np.clip(np.round((xg / sx).astype(np.float32)), -127, 127)
  c = np.asarray(codes_KN, np.float64).reshape(g, k // g, -1)
  dots = np.einsum('mgk,gkn->mgn', qx, c)  # exact integers
  return np.einsum('mgn,mg,gn->mn', dots, sx[:, :, 0], np.asarray(scale_GN, np.float64))


@pytest.mark.parametrize('m', [1, 3, 16])
def test_int8_activation_kernel_matches_a_numpy_reference(m):
  x = np.asarray(jax.random.normal(KEY[0], (m, 256)), np.float32)
  w = jax.random.normal(KEY[1], (256, 70)) / 8
  cases = [(quantize(w, int_format(8, channel_axes=(1,))), 'int8'),
           (quantize(w, int_format(4, group_size=128, channel_axes=(1,))), 'int4'),
           (quantize(w, int_format(4, group_size=32, channel_axes=(1,))), 'int4')]
  if not kernels.available():
    with pytest.raises(RuntimeError, match='check available'):
      kernels.gemv(x, cases[0][0].data, cases[0][0].scale, 'kn', 'int8', act='int8')
    return
  for q, kind in cases:
    s = np.broadcast_to(np.asarray(q.scale), (q.scale.shape[0], 70))
    ref = _int8_act_reference(x, q.codes(), s)
    y = kernels.gemv(x, q.data, jnp.asarray(s), 'kn', kind, act='int8')
    assert y.shape == (m, 70)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # the head layout (V, D): groups of 128 along D (int4 needs 128, int8 64)
  for bits in (8, 4):
    qh = quantize(w.T, int_format(bits, group_size=128, channel_axes=(0,), group_axis=1))
    ref = _int8_act_reference(x, np.asarray(qh.codes()).T, np.asarray(qh.scale).T)
    y = kernels.gemv(x, qh.data, qh.scale, 'nk', f'int{bits}', act='int8')
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_int8_activation_kernel_propagates_nan_and_zero_rows():
  if not kernels.available():
    assert kernels.status() != 'available'
    return
  w = jax.random.normal(KEY[2], (128, 64))
  q = quantize(w, int_format(4, group_size=64, channel_axes=(1,)))
  x = np.array(jax.random.normal(KEY[3], (3, 128)), np.float32)
  x[1, 5] = np.nan
  x[2] = 0.0
  y = np.asarray(kernels.gemv(x, q.data, q.scale, 'kn', 'int4', act='int8'))
  assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and (y[2] == 0).all()


def test_int8_activations_take_the_kernel_at_decode_shapes():
  # qeinsum's 'int8' path (W8A8 / W4A8 policies) runs M <= 16 rows on the kernel's integer
  # dots and equals the XLA tiled form of the same numerics; a group length the kernel
  # cannot take (32 along D of a head) stays on the XLA path.
  from qjax.core import tiled_path
  w = jax.random.normal(KEY[4], (256, 96)) / 8
  q = quantize(w, int_format(4, group_size=128, channel_axes=(1,)))
  x = jax.random.normal(KEY[5], (2, 1, 256))
  f = jax.jit(lambda x, q: qeinsum('BTD,DF->BTF', x, q, act_fmt=int_format(8)))
  hlo = f.lower(x, q).as_text()
  assert ('qjax_gemv_kn_int4_a8' in hlo) == kernels.available()
  ref = tiled_path.tiled_einsum('BTD', 'DF', 'BTF', x, q, 'int', jnp.float32)
  np.testing.assert_allclose(f(x, q), ref, rtol=1e-5, atol=1e-5)
  qh = quantize(w.T, int_format(8, group_size=32, channel_axes=(0,), group_axis=1))
  g = jax.jit(lambda x, q: qeinsum('BTD,VD->BTV', x, q, act_fmt=int_format(8)))
  assert 'qjax_gemv_nk' not in g.lower(x, qh).as_text()
