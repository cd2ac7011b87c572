"""Decode-shape qeinsum paths (qjax.core.decode_paths): each equals dequantize-then-einsum,
and none writes a float copy of the weight (compiled temp memory <= 10% of the codes' bytes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import int_format, qeinsum, quantize
from qjax import kernels
from qjax.core import float_einsum

KEY = jax.random.split(jax.random.key(3), 6)
KN_FORMATS = [int_format(8, channel_axes=(1,)), int_format(8, group_size=64, channel_axes=(1,)),
              int_format(4, group_size=32, channel_axes=(1,)),
              int_format(4, group_size=128, channel_axes=(1,)), int_format(4, channel_axes=(1,))]
HEAD_FORMATS = [int_format(8, channel_axes=(0,), group_axis=1),
                int_format(4, group_size=64, channel_axes=(0,), group_axis=1),
                int_format(4, group_size=128, channel_axes=(0,), group_axis=1)]


def _close(y, ref, what):
  err = float(jnp.max(jnp.abs(y - ref)))
  bound = 2e-5 * float(jnp.max(jnp.abs(ref))) + 1e-5  # f32 summation order only
  assert y.shape == ref.shape and err <= bound, (what, err, bound)


def _close_auto(y, ref, m, what):
  """`auto`: exact up to summation order on the kernel and at M = 1; without the kernel, M > 1
  takes the bf16 x bf16 -> f32 tiles (activations and tiles rounded to bf16: ~50 dB)."""
  if kernels.available() or m == 1:
    _close(y, ref, what)
  else:
    assert y.shape == ref.shape and float(qjax.sqnr_db(ref, y)) > 45.0, what


@functools.lru_cache(maxsize=None)
def _quantized(shape, fmt, key=0):
  return quantize(jax.random.normal(KEY[key], shape) / 16, fmt)


@pytest.mark.parametrize('m', [1, 5, 16])
def test_auto_path_equals_dequantize_at_decode_shapes(m):
  x = jax.random.normal(KEY[1], (m, 1, 256))
  for fmt in KN_FORMATS:
    q = _quantized((256, 130), fmt)  # 130: odd packed half length (65 bytes)
    ref = jnp.einsum('BTD,DF->BTF', x, q.dequantize())
    _close_auto(qeinsum('BTD,DF->BTF', x, q), ref, m, (fmt.name, m))


@pytest.mark.parametrize('m', [1, 16])
def test_auto_path_multi_axis_layouts(m):
  # o_proj 'BTNH,NHD->BTD' (contracted N, H) and q_proj 'BTD,DNH->BTNH' with odd H = 9.
  x = jax.random.normal(KEY[2], (m, 1, 4, 64))
  w = jax.random.normal(KEY[3], (4, 64, 96)) / 16
  q = quantize(w, int_format(4, group_size=32, group_axis=1, channel_axes=(2,)))
  ref = jnp.einsum('BTNH,NHD->BTD', x, q.dequantize())
  _close_auto(qeinsum('BTNH,NHD->BTD', x, q), ref, m, 'o_proj')
  w2 = jax.random.normal(KEY[4], (64, 4, 9)) / 16
  x2 = jax.random.normal(KEY[5], (1, m, 64))
  for fmt in [int_format(4, group_size=16, group_axis=0, channel_axes=(1, 2)),
              int_format(8, channel_axes=(1, 2))]:
    q2 = quantize(w2, fmt)
    ref2 = jnp.einsum('TBD,DNH->BTNH', x2, q2.dequantize())
    _close_auto(qeinsum('TBD,DNH->BTNH', x2, q2), ref2, m, fmt.name)


@pytest.mark.parametrize('m', [1, 4, 16])
def test_head_layout_paths_equal_dequantize(m):
  # The tied head 'BTD,VD->BTV': weight (V, D), contracted D last and packed. V = 5000 gives
  # two whole V blocks of 2048 and a remainder in the blocked path.
  x = jax.random.normal(KEY[1], (1, m, 256))
  for i, fmt in enumerate(HEAD_FORMATS):
    q = _quantized((5000, 256), fmt)
    ref = jnp.einsum('BTD,VD->BTV', x, q.dequantize())
    _close_auto(qeinsum('BTD,VD->BTV', x, q), ref, m, ('auto', fmt.name))
    if i == 0:  # zero points: never the kernel; V blocks by bit fields, f32 at M = 1
      qa = _quantized((5000, 256), int_format(4, group_size=64, channel_axes=(0,),
                                              group_axis=1, symmetric=False))
      ya, refa = qeinsum('BTD,VD->BTV', x, qa), jnp.einsum('BTD,VD->BTV', x, qa.dequantize())
      if m == 1:
        _close(ya, refa, 'asymmetric int4')
      else:
        assert float(qjax.sqnr_db(refa, ya)) > 45.0
    if m == 16 or (m == 4 and i != 1):
      continue  # the blocked path: each format once at M = 1 and once (bf16 blocks) at M = 4
    y = jax.jit(lambda x, q: qeinsum('BTD,VD->BTV', x, q, path='tiled'))(x, q)
    if m == 1:  # f32 blocks: exact up to summation order
      _close(y, ref, ('tiled', fmt.name))
    else:       # bf16 x bf16 -> f32 blocks, as the row tiles
      assert float(qjax.sqnr_db(ref, y)) > 45.0, fmt.name


def _temp_bytes(f, *args):
  return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.backend('cpu', reason="the XLA:CPU decode paths' temp memory")
def test_gemma_head_temp_memory_is_a_fraction_of_the_codes():
  # Gemma 3's tied head, 262144 x 640, compiled from abstract values (no 671 MB weight built).
  v, d = 262144, 640
  for fmt, ms in [(HEAD_FORMATS[2], [1, 8]), (HEAD_FORMATS[0], [16])]:
    small = quantize(jax.random.normal(KEY[2], (256, d)), fmt)
    g = small.scale.shape[1]
    q = small.rebuild([jax.ShapeDtypeStruct((v, small.data.shape[1]), small.data.dtype),
                       jax.ShapeDtypeStruct((v, g), small.scale.dtype)])
    qbytes = v * small.data.shape[1] + v * g * small.scale.dtype.itemsize
    for m in ms:
      x = jax.ShapeDtypeStruct((1, m, d), jnp.float32)
      temp = _temp_bytes(lambda x, q: qeinsum('BTD,VD->BTV', x, q), x, q)
      if kernels.available() or m == 1:
        assert temp <= 0.10 * qbytes, (fmt.name, m, temp, qbytes)
      else:  # V blocks in bf16: the stacked block outputs (M x V f32) dominate
        assert temp <= 0.10 * qbytes + 4 * m * v, (fmt.name, m, temp, qbytes)
    if fmt.bits == 8:
      continue
    blocked = _temp_bytes(lambda x, q: qeinsum('BTD,VD->BTV', x, q, path='tiled'),
                          jax.ShapeDtypeStruct((1, 1, d), jnp.float32), q)
    assert blocked <= 0.10 * qbytes, (fmt.name, blocked)
    dq = _temp_bytes(lambda x, q: qeinsum('BTD,VD->BTV', x, q, path='dequant'),
                     jax.ShapeDtypeStruct((1, 1, d), jnp.float32), q)
    assert dq >= 4 * v * d  # what the head cost before: a float copy per call


@pytest.mark.backend('cpu', reason="the XLA:CPU decode paths' temp memory")
def test_projection_temp_memory_is_a_fraction_of_the_codes():
  w = jax.random.normal(KEY[3], (2048, 2048))
  for fmt in [int_format(8, channel_axes=(1,)), int_format(4, group_size=128, channel_axes=(1,))]:
    q = quantize(w, fmt)
    for m in [1, 16]:
      x = jnp.ones((m, 2048))
      temp = _temp_bytes(lambda x, q: qjax.qdot(x, q), x, q)
      if kernels.available():  # the kernel: no float tile at all
        assert temp <= 0.10 * q.nbytes, (fmt.name, m, temp, q.nbytes)
      else:  # the XLA row tiles: a float tile of at most 1/8 of the weight, and its fields
        assert temp <= 4 * w.size / 6, (fmt.name, m, temp)


def test_integer_activations_are_rejected_with_their_dtype():
  q = quantize(jax.random.normal(KEY[0], (64, 32)), int_format(8, channel_axes=(1,)))
  for x in [jnp.ones((2, 64), jnp.int32), jnp.ones((2, 64), jnp.int8)]:
    with pytest.raises(ValueError, match=str(x.dtype)):
      qjax.qdot(x, q)
    with pytest.raises(ValueError, match=str(x.dtype)):
      qjax.qdot(x, jnp.ones((64, 32)))
  with pytest.raises(ValueError, match='int32'):
    qjax.qdot(jnp.ones((2, 64)), jnp.ones((64, 32), jnp.int32))


@pytest.mark.parametrize('m', [1, 16, 40])
def test_bf16_weights_accumulate_in_f32_without_converting_the_weight(m):
  w = (jax.random.normal(KEY[4], (256, 96)) / 16).astype(jnp.bfloat16)
  x = jax.random.normal(KEY[5], (m, 1, 256))
  ref = jnp.einsum('BTD,DF->BTF', x, w.astype(jnp.float32))
  y = float_einsum('BTD,DF->BTF', x, w, jnp.float32)
  assert y.dtype == jnp.float32 and y.shape == ref.shape
  if kernels.available() and m == 1:  # f32 activations on the kernel: exact weights
    _close(y, ref, m)
  else:  # bf16 activations
    assert float(qjax.sqnr_db(ref, y)) > 40.0
  wh = jnp.asarray(w.T)  # the head layout
  yh = float_einsum('BTD,VD->BTV', x, wh, jnp.float32)
  assert float(qjax.sqnr_db(jnp.einsum('BTD,VD->BTV', x, wh.astype(jnp.float32)), yh)) > 40.0


def test_w8a8_decode_accuracy_gate():
  # 'int8' (W8A8: activations quantized per token and group) is a different numerics from
  # weight-only: it must stay within 35 dB of the exact product at every decode shape.
  gate = jax.jit(lambda x, q: qjax.qdot(x, q, act_fmt=int_format(8)))
  for fmt in [int_format(8, channel_axes=(1,)), int_format(4, group_size=128, channel_axes=(1,))]:
    q = _quantized((256, 128), fmt, key=1)
    for m in [1, 16]:
      x = jax.random.normal(KEY[m % 6], (m, 256))
      ref = x @ q.dequantize()
      y = gate(x, q)
      assert float(qjax.sqnr_db(ref, y)) > 35.0, (fmt.name, m)
      assert not np.allclose(y, ref, rtol=1e-6, atol=1e-7)  # it is not weight-only math


@pytest.mark.backend('cpu', reason="the XLA:CPU blocked int8 head path")
def test_int8_activation_head_at_prefill_shapes_stays_in_blocks():
  # A W8A8 / W4A8 head with more rows than the kernel takes runs in V blocks on int8-quantized
  # activations (f32 dots): the int8 numerics (a float64 numpy reference) without the GiBs of
  # temporaries of a whole-operand integer dot.
  v, d, m = 16384, 256, 40  # 4 blocks of 2**20 weights
  w = jax.random.normal(KEY[0], (v, d)) / 8
  q = quantize(w, int_format(4, group_size=128, channel_axes=(0,), group_axis=1))
  x = jax.random.normal(KEY[1], (1, m, d))
  f = jax.jit(lambda x, q: qeinsum('BTD,VD->BTV', x, q, act_fmt=int_format(8)))
  y = np.asarray(f(x, q))[0]
  xg = np.asarray(x, np.float64)[0].reshape(m, 2, 128)
  amax = np.abs(xg).max(-1, keepdims=True)
  sx = np.where(amax == 0, 1.0, amax.astype(np.float32) / np.float32(127.0)).astype(np.float64)
  qx = np.clip(np.round((xg / sx).astype(np.float32)), -127, 127)
  c = np.asarray(q.codes(), np.float64).reshape(v, 2, 128)
  ref = np.einsum('mgk,vgk,mg,vg->mv', qx, c, sx[..., 0], np.asarray(q.scale, np.float64))
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  temp = f.lower(x, q).compile().memory_analysis().temp_size_in_bytes
  # the logits and about one f32 block (4 MiB), well under an f32 copy of the weight (16 MiB)
  assert temp < 4 * m * v + 1.5 * 4 * 2**20 < 4 * v * d, temp
