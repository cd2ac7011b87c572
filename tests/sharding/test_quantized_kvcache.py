"""The quantized KV cache: quantize on write, dequantize on read, one scale per token/head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding_testlib as lib
from qjax.core import dequantize, int_format, quantize
from qjax.nn import init_cache, kvcache


@pytest.mark.parametrize('fmt', ['int8', 'fp8', 'int4'])
def test_write_then_read_is_the_quantized_value(fmt):
  cfg = lib.config(1)
  cache = init_cache(cfg, batch=2, max_len=8, fmt=fmt)
  k = jax.random.normal(jax.random.key(0), (2, 3, 1, 16))
  v = jax.random.normal(jax.random.key(1), (2, 3, 1, 16))
  cache = kvcache.write(cache, 0, k, v)
  k_read, v_read, _ = kvcache.read(cache, 0)
  want_k = dequantize(quantize(k, kvcache.KV_FORMATS[fmt]))
  np.testing.assert_array_equal(k_read[:, :3], want_k)
  np.testing.assert_array_equal(k_read[:, 3:], 0.0)
  assert float(jnp.abs(v_read[:, :3] - v).max()) < {'int8': 0.02, 'fp8': 0.15, 'int4': 0.4}[fmt]
  # A later token never rescales earlier ones.
  later = kvcache.advance(cache, 3)
  later = kvcache.write(later, 0, 100.0 * k[:, :1], v[:, :1])
  np.testing.assert_array_equal(kvcache.read(later, 0)[0][:, :3], k_read[:, :3])


@pytest.mark.parametrize('fmt', [None, 'int8'])
def test_each_row_is_written_at_its_own_length(fmt):
  cfg = lib.config(1)
  cache = kvcache.advance(init_cache(cfg, batch=2, max_len=8, fmt=fmt), jnp.asarray([1, 4]))
  np.testing.assert_array_equal(kvcache.next_positions(cache, 2), [[1, 2], [4, 5]])
  k = jax.random.normal(jax.random.key(0), (2, 2, 1, 16))
  k_read = kvcache.read(kvcache.write(cache, 1, k, k), 1)[0]
  want = k if fmt is None else dequantize(quantize(k, kvcache.KV_FORMATS[fmt]))
  np.testing.assert_array_equal(k_read[0, 1:3], want[0])
  np.testing.assert_array_equal(k_read[1, 4:6], want[1])
  np.testing.assert_array_equal(k_read[0, 3:], 0.0)   # nothing else is written
  np.testing.assert_array_equal(k_read[1, :4], 0.0)
  np.testing.assert_array_equal(kvcache.read(cache, 0)[0], 0.0)  # nor another layer
  np.testing.assert_array_equal(kvcache.advance(cache, 2).length, [3, 6])


def test_format_is_recorded_and_bytes_shrink():
  cfg = lib.config(1)
  f32 = init_cache(cfg, 8, 22)
  int8 = init_cache(cfg, 8, 22, fmt='int8')
  assert (f32.format, int8.format) == ('float32', 'int8-ch012')
  assert init_cache(cfg, 8, 22, fmt='fp8').format == 'fp8e4m3-ch012'
  assert int8.qformat.bits == 8 and int8.qformat.kind == 'int'
  per_token_head = 16 * 1 + 4   # H int8 codes + one f32 scale
  lengths = 8 * 4               # one int32 length per row
  assert kvcache.nbytes(int8) == 2 * 2 * 8 * 22 * per_token_head + lengths
  assert kvcache.nbytes(f32) == 2 * 2 * 8 * 22 * 16 * 4 + lengths


def test_scales_that_span_tokens_are_rejected():
  cfg = lib.config(1)
  with pytest.raises(ValueError, match='scale per token and kv head'):
    init_cache(cfg, 2, 8, fmt=int_format(8, channel_axes=(2,)))
  with pytest.raises(ValueError, match='unknown'):
    init_cache(cfg, 2, 8, fmt='int3')
  with pytest.raises(ValueError, match='does not divide'):
    init_cache(cfg, 2, 8, fmt=int_format(8, channel_axes=(0, 1, 2), group_size=32,
                                         group_axis=3))


@pytest.mark.parametrize('fmt', ['int8', 'fp8'])
def test_model_with_a_quantized_cache_stays_close(fmt):
  model, toks = lib.model(1), lib.tokens()
  exact = lib.reference(model, toks, steps=4)
  approx = lib.reference(model, toks, steps=4, fmt=fmt)
  for a, b in zip(exact, approx):
    assert np.abs(a - b).max() < {'int8': 0.02, 'fp8': 0.2}[fmt] * np.abs(a).max()
