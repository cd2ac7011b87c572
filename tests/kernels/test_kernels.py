"""The optional jax.ffi CPU kernel (qjax.kernels): against a numpy reference when it is
available, and a clean, named refusal when it is not."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import int_format, qeinsum, quantize
from qjax import kernels
from qjax.kernels import _build

KEY = jax.random.split(jax.random.key(7), 4)


def test_status_names_the_state():
  s = kernels.status()
  assert (s == 'available') == kernels.available()
  assert s == 'available' or any(w in s for w in ('not built', 'failed', 'disabled'))


def test_kernel_is_available_exactly_where_the_cpu_can_run_it():
  # Every test below returns early without the kernel, so a kernel that stopped building on
  # an AVX2 machine (CI's, most laptops) would otherwise pass silently: wherever a compiler
  # and a CPU with AVX2 + FMA exist, first use must have built (or found) and loaded it.
  if os.environ.get('QJAX_CPU_KERNEL') == '0':
    assert not kernels.available() and kernels.isa() is None
    assert 'disabled' in kernels.status()
    return
  level = _build.best_isa(kernels.cpu_flags())
  if level is None or _build.compiler() is None:
    assert not kernels.available() and kernels.isa() is None
    assert 'not built' in kernels.status()
    return
  assert kernels.available(), kernels.status()
  built = os.environ.get('QJAX_KERNEL_ISA') or level  # a lower level asked for on purpose
  assert kernels.isa() == ('avx2' if built == 'avx2' else 'avx512')
  info = kernels.info()
  assert info['cpu_isa'] == level and info['build'] in ('cached', 'built')
  # in the per-user cache, never in the source tree
  assert pathlib.Path(info['library']).is_relative_to(_build.cache_root())
  assert not (pathlib.Path(kernels.__file__).parent / 'build').exists()


def _padded(scale_QF, f_padded):
  """Scales for a packed int4 'kn' weight of odd F: the kernel's F is the padded length."""
  s = np.asarray(scale_QF, np.float32)
  return jnp.asarray(np.pad(s, [(0, 0), (0, f_padded - s.shape[1])], constant_values=1.0))


@pytest.mark.parametrize('m,n', [(1, 70), (5, 33), (16, 70), (3, 1)])
def test_kernel_matches_numpy(m, n):
  x = np.asarray(jax.random.normal(KEY[0], (m, 256)), np.float32)
  w = jax.random.normal(KEY[1], (256, n)) / 8
  q8 = quantize(w, int_format(8, channel_axes=(1,)))
  wb = w.astype(jnp.bfloat16)
  if not kernels.available():
    assert kernels.isa() is None
    with pytest.raises(RuntimeError, match='check available'):
      kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8')
    with pytest.raises(ValueError, match="path='kernel'"):
      qjax.qdot(x, q8, path='kernel')
    return
  x64 = x.astype(np.float64)
  # numpy reference: codes times scales, f64 sums.
  ref8 = x64 @ (np.asarray(q8.codes(), np.float64) * np.asarray(q8.scale))
  np.testing.assert_allclose(kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8'), ref8,
                             rtol=1e-4, atol=1e-4)
  for g in (32, 64, 128):
    q4 = quantize(w, int_format(4, group_size=g, channel_axes=(1,)))
    c4 = np.asarray(q4.codes(), np.float64).reshape(256 // g, g, n)
    ref4 = x64 @ (c4 * np.asarray(q4.scale)[:, None, :]).reshape(256, n)
    y4 = kernels.gemv(x, q4.data, _padded(q4.scale, 2 * q4.data.shape[1]), 'kn', 'int4')
    assert y4.shape == (m, n + n % 2)
    np.testing.assert_allclose(y4[:, :n], ref4, rtol=1e-4, atol=1e-4)
  refb = x64 @ np.asarray(wb.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(kernels.gemv(x, wb, None, 'kn', 'bf16'), refb, rtol=1e-4, atol=1e-4)
  # the head layout 'nk': W (N, K), contracted last
  for g in (32, 64, 128):
    qh = quantize(w.T, int_format(4, group_size=g, channel_axes=(0,), group_axis=1))
    ch = np.asarray(qh.codes(), np.float64).reshape(n, 256 // g, g)
    ch = ch * np.asarray(qh.scale)[:, :, None]
    np.testing.assert_allclose(kernels.gemv(x, qh.data, qh.scale, 'nk', 'int4'),
                               x64 @ ch.reshape(n, 256).T, rtol=1e-4, atol=1e-4)
  qh8 = quantize(w.T, int_format(8, channel_axes=(0,)))
  np.testing.assert_allclose(kernels.gemv(x, qh8.data, qh8.scale, 'nk', 'int8'), ref8,
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(kernels.gemv(x, wb.T, None, 'nk', 'bf16'), refb, rtol=1e-4,
                             atol=1e-4)


def test_kernel_propagates_nan_and_zero_rows():
  if not kernels.available():
    assert kernels.status() != 'available'
    return
  w = jax.random.normal(KEY[2], (128, 45))
  x = np.array(jax.random.normal(KEY[3], (3, 128)), np.float32)
  x[1, 5] = np.nan
  x[2] = 0.0
  q8 = quantize(w, int_format(8, channel_axes=(1,)))
  q4 = quantize(w, int_format(4, group_size=32, channel_axes=(1,)))
  wb = w.astype(jnp.bfloat16)
  qh = quantize(w.T, int_format(4, group_size=32, channel_axes=(0,), group_axis=1))
  qh8 = quantize(w.T, int_format(8, channel_axes=(0,)))
  ys = [kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8'),
        kernels.gemv(x, q4.data, _padded(q4.scale, 46), 'kn', 'int4')[:, :45],
        kernels.gemv(x, wb, None, 'kn', 'bf16'), kernels.gemv(x, wb.T, None, 'nk', 'bf16'),
        kernels.gemv(x, qh.data, qh.scale, 'nk', 'int4'),
        kernels.gemv(x, q8.data, q8.scale, 'kn', 'int8', act='int8'),
        kernels.gemv(x, qh8.data, qh8.scale, 'nk', 'int8', act='int8')]
  for y in map(np.asarray, ys):
    assert y.shape == (3, 45)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and (y[2] == 0).all()


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


def _int8_act_reference(x, codes_DF, scale_QF):
  """numpy: x quantized per row and per group of D (scale amax / 127, half-even rounding,
  +-127), integer dots per group, rescaled: qeinsum's 'int8' numerics, written out in f64."""
  x = np.asarray(x, np.float64)
  q = scale_QF.shape[0]
  m, d = x.shape
  xg = x.reshape(m, q, d // q)
  amax = np.abs(xg).max(axis=2, keepdims=True)
  sx = np.where(amax == 0, 1.0, amax.astype(np.float32) / np.float32(127.0)).astype(np.float64)
  qx = np.clip(np.round((xg / sx).astype(np.float32)), -127, 127)
  c = np.asarray(codes_DF, np.float64).reshape(q, d // q, -1)
  dots = np.einsum('mqd,qdf->mqf', qx, c)  # exact integers
  return np.einsum('mqf,mq,qf->mf', dots, sx[:, :, 0], np.asarray(scale_QF, np.float64))


@pytest.mark.parametrize('m,n', [(1, 70), (3, 33), (16, 70)])
def test_int8_activation_kernel_matches_a_numpy_reference(m, n):
  x = np.asarray(jax.random.normal(KEY[0], (m, 256)), np.float32)
  w = jax.random.normal(KEY[1], (256, n)) / 8
  cases = [(quantize(w, int_format(8, channel_axes=(1,))), 'int8'),  # 2 parts of 128 rows
           (quantize(w, int_format(8, group_size=64, channel_axes=(1,))), 'int8'),
           (quantize(w, int_format(4, group_size=128, channel_axes=(1,))), 'int4'),
           (quantize(w, int_format(4, group_size=64, channel_axes=(1,))), 'int4'),
           (quantize(w, int_format(4, group_size=32, channel_axes=(1,))), 'int4')]
  if not kernels.available():
    with pytest.raises(RuntimeError, match='check available'):
      kernels.gemv(x, cases[0][0].data, cases[0][0].scale, 'kn', 'int8', act='int8')
    return
  for q, kind in cases:
    s = np.broadcast_to(np.asarray(q.scale), (q.scale.shape[0], n))
    ref = _int8_act_reference(x, q.codes(), s)
    y = kernels.gemv(x, q.data, _padded(s, q.data.shape[1] * (2 if kind == 'int4' else 1)),
                     'kn', kind, act='int8')
    assert y.shape[0] == m
    np.testing.assert_allclose(y[:, :n], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # the head layout (V, D): groups of 64 / 128 along D (int4 needs 128, int8 64)
  for bits, g in ((8, None), (8, 64), (4, 128)):
    qh = quantize(w.T, int_format(bits, group_size=g, channel_axes=(0,), group_axis=1))
    ref = _int8_act_reference(x, np.asarray(qh.codes()).T, np.asarray(qh.scale).T)
    y = kernels.gemv(x, qh.data, qh.scale, 'nk', f'int{bits}', act='int8')
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_int8_activation_kernel_on_threaded_shapes():
  # weights of >= 1 MiB run on XLA's thread pool (smaller ones on the calling thread)
  if not kernels.available():
    return
  x = np.asarray(jax.random.normal(KEY[4], (2, 1024)), np.float32)
  w = jax.random.normal(KEY[5], (1024, 1040)) / 8
  q = quantize(w, int_format(8, channel_axes=(1,)))
  ref = _int8_act_reference(x, q.codes(), np.asarray(q.scale))
  y = kernels.gemv(x, q.data, q.scale, 'kn', 'int8', act='int8')
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  qh = quantize(jnp.concatenate([w.T, w.T]), int_format(4, group_size=128, channel_axes=(0,),
                                                        group_axis=1))
  ref = _int8_act_reference(x, np.asarray(qh.codes()).T, np.asarray(qh.scale).T)
  y = kernels.gemv(x, qh.data, qh.scale, 'nk', 'int4', act='int8')
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
