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
