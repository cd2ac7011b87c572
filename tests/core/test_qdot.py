"""Quantized matmul paths, against float and against an independent integer reference."""

import chex
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import fp8_format, int_format, qdot, qeinsum, quantize
from qjax.core import tiled_path

K = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(K[0], (4, 8, 256))
W = jax.random.normal(K[1], (256, 128)) / 16


class QdotTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_w8a8_matches_float_and_numpy_int32_reference(self):
    q = quantize(W, int_format(8, channel_axes=(1,)))
    y = self.variant(lambda x, q: qdot(x, q, act_fmt=int_format(8), path='int8'))(X, q)
    assert float(qjax.sqnr_db(X @ W, y)) >= 30.0
    # Independent reference: numpy int32 product of the same integer codes.
    x = np.asarray(X, np.float32).reshape(-1, 256)
    xs = np.abs(x).max(1, keepdims=True) / 127.0
    xq = np.clip(np.round(x / xs), -127, 127).astype(np.int32)
    acc = xq @ np.asarray(q.codes(), np.int32)
    ref = acc.astype(np.float32) * xs * np.asarray(q.scale, np.float32)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 128), ref, rtol=1e-5, atol=1e-6)
    # and the integer accumulator itself is exact: int32 == int64 numpy
    acc_jax = jnp.einsum('md,df->mf', jnp.asarray(xq, jnp.int8), q.codes(),
                         preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(acc_jax, xq.astype(np.int64) @ np.asarray(q.codes(), np.int64))

  @chex.variants(with_jit=True, without_jit=True)
  def test_weight_only_paths_agree_with_dequantize(self):
    for fmt in [int_format(4, group_size=32, channel_axes=(1,)),
                int_format(4, group_size=32, channel_axes=(1,), symmetric=False),
                int_format(3, group_size=64, channel_axes=(1,)), int_format(8)]:
      q = quantize(W, fmt)
      ref = X @ q.dequantize()
      exact = self.variant(lambda x, q: qdot(x, q, path='dequant'))(X, q)
      np.testing.assert_allclose(exact, ref, rtol=1e-5, atol=1e-5)
      fast = self.variant(lambda x, q: qdot(x, q, path='int8'))(X, q)
      # int8 per-token-group activations: ~40 dB on Gaussian data.
      assert float(qjax.sqnr_db(ref, fast)) > 35.0, fmt.name

  def test_fp8_x_fp8(self):
    q = quantize(W, fp8_format('e4m3', channel_axes=(1,)))
    y = qdot(X, q, act_fmt=fp8_format('e4m3'))
    assert float(qjax.sqnr_db(X @ W, y)) > 25.0
    with pytest.raises(ValueError, match='mix integer and float'):
      qdot(X, q, act_fmt=int_format(8))

  def test_batch_one_padding_path(self):
    q = quantize(W, int_format(4, group_size=128, channel_axes=(1,)))
    x1 = X[:1, :1]
    y = qdot(x1, q, path='int8')
    assert y.shape == (1, 1, 128)
    np.testing.assert_allclose(y, qdot(X, q, path='int8')[:1, :1], rtol=1e-5, atol=1e-6)

  def test_einsum_with_multi_axis_contraction(self):
    w = jax.random.normal(K[2], (4, 64, 32))          # NHD output projection
    x = jax.random.normal(K[3], (2, 3, 4, 64))
    for fmt in [int_format(8, channel_axes=(2,)),
                int_format(4, group_size=32, group_axis=1, channel_axes=(2,))]:
      q = quantize(w, fmt)
      ref = jnp.einsum('BTNH,NHD->BTD', x, q.dequantize())
      y = qeinsum('BTNH,NHD->BTD', x, q, path='int8')
      assert float(qjax.sqnr_db(ref, y)) > 35.0

  def test_scale_along_contraction_falls_back_exactly(self):
    q = quantize(W, int_format(8, channel_axes=(0,)))  # per *input* channel
    np.testing.assert_allclose(qdot(X, q, path='int8'), X @ q.dequantize(), rtol=1e-5, atol=1e-5)

  def test_auto_path_choice_is_documented(self):
    f4 = int_format(4, group_size=128)
    assert qjax.choose_path(f4, None, 'cpu') == 'tiled'
    assert qjax.choose_path(fp8_format(), None, 'cpu') == 'tiled'
    assert qjax.choose_path(int_format(8), int_format(8), 'cpu') == 'int8'
    assert qjax.choose_path(f4, None, 'gpu', layout='native') == 'native'  # GPU/TPU default
    assert qjax.choose_path(f4, None, 'gpu', layout='packed') == 'dequant'
    assert qjax.choose_path(f4, int_format(8), 'tpu') == 'int8'
    assert qjax.choose_path(fp8_format(), fp8_format(), 'gpu') == 'fp8'

  def test_bad_path_and_spec(self):
    q = quantize(W, int_format(8))
    with pytest.raises(ValueError, match="path='int4' is unknown"):
      qdot(X, q, path='int4')
    with pytest.raises(ValueError, match='ellipsis'):
      qeinsum('...D,DF->...F', X, q)
    with pytest.raises(ValueError, match='rank'):
      qeinsum('BD,DF->BF', X, q)
    with pytest.raises(ValueError, match="cannot multiply int8"):
      qdot(X, q, path='fp8')

  def test_no_float_copy_of_the_weight_in_int8_path(self):
    w = jax.random.normal(K[1], (1024, 1024))
    q = quantize(w, int_format(4, group_size=128, channel_axes=(1,)))
    x = jax.random.normal(K[0], (8, 1024))
    f32_copy = 1024 * 1024 * 4
    temp = jax.jit(lambda x, q: qdot(x, q, path='int8')).lower(x, q).compile() \
        .memory_analysis().temp_size_in_bytes
    assert temp < f32_copy / 2, temp
    if jax.default_backend() == 'cpu':  # the documented reason 'dequant' is not the CPU default
      temp_dq = jax.jit(lambda x, q: qdot(x, q, path='dequant')).lower(x, q).compile() \
          .memory_analysis().temp_size_in_bytes
      assert temp_dq >= f32_copy


class TiledPathTest(chex.TestCase):
  """The CPU path: a loop over row tiles of the weight (see the qdot module docstring)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_tiled_matches_dequantize_for_every_layout(self):
    w = jax.random.normal(K[1], (256, 130)) / 16   # 130: padded 2-, 3- and 4-bit last axis
    for fmt in [int_format(4, group_size=32, channel_axes=(1,)),
                int_format(4, group_size=32, channel_axes=(1,), symmetric=False),
                int_format(3, group_size=64, channel_axes=(1,)),
                int_format(2, group_size=64, channel_axes=(1,), symmetric=False),
                int_format(8), int_format(8, channel_axes=(1,), symmetric=False),
                int_format(8, channel_axes=(0,)), fp8_format(channel_axes=(1,))]:
      q = quantize(w, fmt)
      for x in [X, X[:1, :1]]:  # M = 32 (bf16 tiles where the CPU has bf16 dots) and M = 1
        ref = x @ q.dequantize()
        y = self.variant(lambda x, q: qdot(x, q, path='tiled'))(x, q)
        assert y.shape == ref.shape
        assert float(qjax.sqnr_db(ref, y)) > (45.0 if x.size > 256 else 100.0), fmt.name

  def test_tiled_einsum_layouts(self):
    x = jax.random.normal(K[3], (2, 3, 4, 64))
    w = jax.random.normal(K[2], (4, 64, 32))
    for fmt in [int_format(4, group_size=32, group_axis=1, channel_axes=(2,)),
                int_format(8, channel_axes=(0, 2))]:
      q = quantize(w, fmt)
      ref = jnp.einsum('BTNH,NHD->BTD', x, q.dequantize())
      y = qeinsum('BTNH,NHD->BTD', x, q, path='tiled')
      assert float(qjax.sqnr_db(ref, y)) > 45.0
    w2 = jax.random.normal(K[2], (64, 4, 18))   # 'BTD,DNH->BTNH', packed H of odd half length
    q = quantize(w2, int_format(4, group_size=16, group_axis=0, channel_axes=(1, 2)))
    x2 = jax.random.normal(K[3], (3, 2, 64))
    ref = jnp.einsum('TBD,DNH->BNTH', x2, q.dequantize())
    for path in ['tiled', 'int8']:
      y = qeinsum('TBD,DNH->BNTH', x2, q, path=path)
      assert y.shape == ref.shape and float(qjax.sqnr_db(ref, y)) > 35.0, path

@pytest.mark.parametrize('m', [1, 3])
def test_w8a8_accumulator_exact_across_tiles(m):
  # K = 4096 with worst-case codes: the int32 sum exceeds 2**24, so per-tile f32 partials
  # must be carried in int32 to stay exact.
  k = 4096
  x = jnp.ones((m, k))
  q = quantize(jnp.ones((k, 16)), int_format(8, channel_axes=(1,)))
  y = qdot(x, q, act_fmt=int_format(8), path='int8')
  np.testing.assert_array_equal(np.asarray(q.codes(), np.int64).sum(0), np.full(16, 127 * k))
  np.testing.assert_allclose(y, np.full((m, 16), float(k)), rtol=1e-6)
  xr = np.asarray(jax.random.normal(K[0], (m, k)), np.float32)
  wr = jax.random.normal(K[1], (k, 64))
  q = quantize(wr, int_format(8, channel_axes=(1,)))
  xs = np.abs(xr).max(1, keepdims=True) / 127.0
  xq = np.clip(np.round(xr / xs), -127, 127).astype(np.int64)
  acc = xq @ np.asarray(q.codes(), np.int64)
  ref = acc.astype(np.float32) * xs * np.asarray(q.scale, np.float32)
  y = jax.jit(lambda x, q: qdot(x, q, act_fmt=int_format(8)))(jnp.asarray(xr), q)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.backend('cpu', reason="XLA:CPU's row-tiled and kernel paths")
def test_default_cpu_paths_make_no_float_copy():
  w = jax.random.normal(K[1], (1024, 1024))
  f32_copy = 1024 * 1024 * 4
  for fmt, act in [(int_format(4, group_size=128, channel_axes=(1,)), None),
                   (int_format(8, channel_axes=(1,)), None),
                   (int_format(8, channel_axes=(1,)), int_format(8))]:
    q = quantize(w, fmt)
    for m in [1, 8, 64]:
      x = jax.random.normal(K[0], (m, 1024))
      temp = jax.jit(lambda x, q, act=act: qdot(x, q, act_fmt=act)).lower(x, q).compile() \
          .memory_analysis().temp_size_in_bytes
      assert temp < f32_copy / 2, (fmt.name, m, temp)


@pytest.mark.backend('cpu', reason="the XLA:CPU row-tiled path's tile plan")
def test_prefill_tiles_stay_below_a_float_copy_of_the_weight():
  # At prefill a tile takes M weight rows (its partial product is amortised over M rows of
  # activations), still never the whole weight: 512 of 2048 rows here.
  w = jax.random.normal(K[1], (2048, 1024))
  f32_copy = 2048 * 1024 * 4
  x = jax.random.normal(K[0], (512, 2048))
  for fmt in [int_format(4, group_size=128, channel_axes=(1,)), int_format(8, channel_axes=(1,))]:
    q = quantize(w, fmt)
    plan = tiled_path.plan_tiles('my', 'yz', 'mz', x.shape, q, None)
    assert plan.kt == 512, plan
    f = jax.jit(lambda x, q: qdot(x, q))
    compiled = f.lower(x, q).compile()
    # No buffer holds the whole weight in a float dtype, in either orientation...
    whole = [l for l in compiled.as_text().splitlines()
             if re.search(r'(f32|bf16|f16)\[(2048,1024|1024,2048)\]', l)]
    assert not whole, (fmt.name, whole[:3])
    # ...and the temp memory (the activation tile, the float weight tile of 512 rows and the
    # unpacking temps, which XLA:CPU sizes differently per ISA: 0.94-1.01x of a weight copy
    # on an AVX-512 EPYC, less on AVX2) stays below a float copy of the weight added to them.
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1.25 * f32_copy, (fmt.name, temp)
    # The tiles multiply in `tile_dtype`: f32, or bf16 where the CPU has bf16 dot instructions
    # (AVX-512 BF16, AMX), whose rounding (2**-8 relative) bounds the error by the output's scale.
    want = np.asarray(x, np.float64) @ np.asarray(q.dequantize(), np.float64)
    if tiled_path.tile_dtype(x.shape[0]) == jnp.float32:
      np.testing.assert_allclose(f(x, q), want, rtol=2e-2, atol=2e-2)
    else:
      assert np.abs(np.asarray(f(x, q)) - want).max() <= 2**-8 * np.abs(want).max()


def test_w8a8_with_one_group_spanning_the_contraction():
  # group size == the whole contracted axis (e.g. o_proj g32 with H=32): one group, so the
  # scales are constant along K; this used to crash the tiled int8 path.
  w = jax.random.normal(K[2], (4, 32, 48))
  x = jax.random.normal(K[3], (2, 3, 4, 32))
  q = quantize(w, int_format(4, group_size=32, group_axis=1, channel_axes=(2,)))
  y = qeinsum('BTNH,NHD->BTD', x, q, act_fmt=int_format(8))
  ref = jnp.einsum('BTNH,NHD->BTD', x, q.dequantize())
  assert float(qjax.sqnr_db(ref, y)) > 35.0
