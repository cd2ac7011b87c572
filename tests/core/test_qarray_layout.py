"""The QArray layout: meaning-only tree structure, same-rank scales, indexing, reshape,
transpose, and the one validating constructor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax.core import QArray, QType, from_codes, int_format, fp8_format, quantize, dequantize


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape) * 2.0


def test_tree_structure_is_the_meaning_not_the_recipe():
  w = _x((64, 32))
  a = quantize(w, int_format(4, group_size=16, channel_axes=(1,)))
  b = quantize(w, int_format(4, group_size=16, channel_axes=(1,), calibration='mse'))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert not np.array_equal(a.scale, b.scale)  # mse really chose other scales
  mid = jax.tree.map(lambda u, v: u, a, b)  # would raise on differing treedefs
  np.testing.assert_array_equal(dequantize(mid), dequantize(a))
  # an average of two calibrations' scales is a valid QArray of the same format
  avg = jax.tree.map(lambda u, v: (u + v) / 2 if u.dtype == jnp.float32 else u, a, b)
  assert avg.scale.shape == a.scale.shape


@pytest.mark.parametrize('fmt,scale_shape', [
    (int_format(8), (1, 1)),
    (int_format(8, channel_axes=(1,)), (1, 32)),
    (int_format(4, group_size=16, channel_axes=(1,)), (4, 32)),
    (int_format(3, group_size=8, channel_axes=(0,), group_axis=1, symmetric=False), (64, 4)),
    (fp8_format('e4m3', channel_axes=(0,)), (64, 1)),
])
def test_scales_have_the_data_rank_and_tile_it(fmt, scale_shape):
  q = quantize(_x((64, 32)), fmt)
  assert q.scale.shape == scale_shape
  assert all(n % s == 0 for n, s in zip(q.shape, q.scale.shape))
  assert q.tile_shape == tuple(n // s for n, s in zip(q.shape, q.scale.shape))
  assert qjax.scale_shape(q.shape, fmt) == scale_shape


@pytest.mark.parametrize('fmt', [
    int_format(8, channel_axes=(0,)), int_format(4, group_size=8, channel_axes=(0,), group_axis=1),
    int_format(4, symmetric=False), int_format(2, channel_axes=(0,)),
    fp8_format('e5m2', channel_axes=(0,))])
def test_embedding_rows_equal_dequantize_then_index(fmt):
  emb = _x((50, 24))
  emb_q = quantize(emb, fmt)
  token_ids = jnp.asarray([[3, 7, 7, 49], [0, 1, 2, 3]])
  rows = emb_q[token_ids]
  assert isinstance(rows, QArray) and rows.shape == (2, 4, 24)
  np.testing.assert_array_equal(dequantize(rows), dequantize(emb_q)[token_ids])
  # and under jit, with traced ids
  got = jax.jit(lambda q, t: dequantize(q[t]))(emb_q, token_ids)
  np.testing.assert_array_equal(got, dequantize(emb_q)[token_ids])


@pytest.mark.parametrize('fmt', [
    int_format(8, channel_axes=(0, 1, 2)), int_format(4, channel_axes=(0, 1, 2)),
    int_format(4, channel_axes=(0, 1, 2), group_size=4, group_axis=3),
    fp8_format('e4m3', channel_axes=(0, 1, 2))])
def test_cache_pages_and_slots_equal_dequantize_then_index(fmt):
  page = _x((3, 16, 2, 8))  # B S K H, one scale per token and head
  cache_page_q = quantize(page, fmt)
  slots = jnp.asarray([0, 5, 5, 15])
  got = cache_page_q[:, slots]
  assert got.shape == (3, 4, 2, 8)
  np.testing.assert_array_equal(dequantize(got), dequantize(cache_page_q)[:, slots])
  np.testing.assert_array_equal(dequantize(cache_page_q[1:3, 4:12]),
                                dequantize(cache_page_q)[1:3, 4:12])
  np.testing.assert_array_equal(dequantize(cache_page_q[1]), dequantize(cache_page_q)[1])
  np.testing.assert_array_equal(dequantize(cache_page_q[..., None, :]),
                                dequantize(cache_page_q)[..., None, :])


def test_index_that_cuts_a_tile_or_packed_bytes_is_refused():
  q = quantize(_x((64, 32)), int_format(4, group_size=16, channel_axes=(1,)))
  np.testing.assert_array_equal(dequantize(q[16:48]), dequantize(q)[16:48])
  with pytest.raises(IndexError, match='cuts tiles of 16'):
    q[8:40]
  with pytest.raises(IndexError, match='packed'):
    q[:, 3]
  with pytest.raises(IndexError, match='byte groups'):
    q[:, 1:5]
  np.testing.assert_array_equal(dequantize(q[:, 4:10]), dequantize(q)[:, 4:10])
  one = q[5]  # a row of an int4 tensor: its group's scales
  np.testing.assert_array_equal(dequantize(one), dequantize(q)[5])


@pytest.mark.parametrize('fmt,old,new', [
    (int_format(4, group_size=16, channel_axes=(0, 2), group_axis=1), (4, 32, 8), (128, 8)),
    (int_format(8, channel_axes=(0,)), (6, 10), (2, 3, 10)),  # split a per-channel axis
    (int_format(8, group_size=4, channel_axes=(1,)), (16, 6), (4, 4, 6)),  # groups -> an axis
    (int_format(8), (6, 10), (60,)),  # per tensor: any reshape
    (int_format(8, channel_axes=(0, 1), group_size=5, group_axis=2), (2, 3, 10), (6, 10)),
])
def test_reshape_where_tiles_allow(fmt, old, new):
  q = quantize(_x(old), fmt)
  r = q.reshape(new)
  assert r.shape == new and r.scale.ndim == len(new)
  np.testing.assert_array_equal(dequantize(r), dequantize(q).reshape(new))


def test_reshape_that_cuts_tiles_is_refused():
  q = quantize(_x((8, 6)), int_format(8, channel_axes=(1,)))
  with pytest.raises(ValueError, match='cut|do not fit'):
    q.reshape(6, 8)
  q4 = quantize(_x((8, 6)), int_format(4))
  with pytest.raises(ValueError, match='packed along the last axis'):
    q4.reshape(48)


@pytest.mark.parametrize('fmt', [int_format(8, group_size=4, channel_axes=(1,)),
                                 fp8_format('e4m3', channel_axes=(0,))])
def test_transpose(fmt):
  q = quantize(_x((16, 6)), fmt)
  np.testing.assert_array_equal(dequantize(q.T), dequantize(q).T)
  q4 = quantize(_x((2, 16, 6)), int_format(4, channel_axes=(0,)))
  np.testing.assert_array_equal(dequantize(q4.transpose(1, 0, 2)),
                                dequantize(q4).transpose(1, 0, 2))
  with pytest.raises(ValueError, match='packed'):
    q4.transpose(0, 2, 1)


def test_constructor_checks_the_invariant():
  q = quantize(_x((8, 6)), int_format(8, channel_axes=(1,)))
  codes = q.codes()
  with pytest.raises(ValueError, match='does not tile'):
    from_codes(codes, jnp.ones((8, 4)), None, QType('int', 8))
  with pytest.raises(ValueError, match='not finite and positive'):
    from_codes(codes, q.scale.at[0, 2].set(jnp.nan), None, QType('int', 8))
  with pytest.raises(ValueError, match='not finite and positive'):
    from_codes(codes, jnp.zeros((1, 6)), None, QType('int', 8))
  with pytest.raises(ValueError, match='zero_point'):
    from_codes(codes, q.scale, jnp.zeros((1, 1)), QType('int', 8))
  with pytest.raises(ValueError, match='expected uint8'):
    QArray(codes, q.scale, None, QType('int', 4), 6)  # 4-bit codes must be packed
  with pytest.raises(ValueError, match='stored in 3'):
    QArray(jnp.zeros((8, 6), jnp.uint8), q.scale, None, QType('int', 4), 6)
  ok = from_codes(codes, q.scale, None, QType('int', 8))
  np.testing.assert_array_equal(dequantize(ok), dequantize(q))


def test_precomputed_range_must_have_the_scale_layout():
  x = _x((8, 6))
  fmt = int_format(8, channel_axes=(1,))
  lo, hi = qjax.compute_range(x, fmt)
  np.testing.assert_array_equal(dequantize(quantize(x, fmt, calibration=(lo, hi))),
                                dequantize(quantize(x, fmt)))
  with pytest.raises(ValueError, match=r'scale shape \(1, 6\)'):
    quantize(x, fmt, calibration=(lo[None], hi[None]))


def test_vmap_over_stacked_qarrays():
  xs = _x((3, 16, 8))
  fmt = int_format(4, group_size=4, channel_axes=(-1,), group_axis=-2)
  qs = jax.vmap(lambda x: quantize(x, fmt))(xs)
  assert qs.scale.shape == (3, 4, 8)
  got = jax.vmap(dequantize)(qs)
  np.testing.assert_array_equal(got, jnp.stack([dequantize(quantize(x, fmt)) for x in xs]))


def test_scaled_by_multiplies_the_tensor():
  q = quantize(_x((8, 6)), int_format(8, channel_axes=(1,)))
  f = jnp.arange(1.0, 7.0)
  np.testing.assert_allclose(dequantize(q.scaled_by(f)), dequantize(q) * f, rtol=1e-6)
  with pytest.raises(ValueError, match='constant on every tile'):
    q.scaled_by(jnp.ones((8, 1)))
