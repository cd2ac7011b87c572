"""qjax.core.numerics: the scale layout (tiles), scales and zero points, codes, checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from qjax.core import (broadcast_scale, check_finite, first_of_tiles, int_format,
                       scale_and_zero_point, scale_shape, tile_shape, tiled)
from qjax.core import numerics


@pytest.mark.parametrize('fmt,want', [
    (int_format(8), (1, 1, 1)),                                          # per tensor
    (int_format(8, channel_axes=(1,)), (1, 6, 1)),                       # per channel
    (int_format(4, channel_axes=(-1,)), (1, 1, 8)),                      # negative axis
    (int_format(4, group_size=2, group_axis=0), (2, 1, 1)),              # groups of 2 on 4
    (int_format(4, group_size=4, group_axis=2, channel_axes=(1,)), (1, 6, 2)),
])
def test_scale_shape_has_the_data_rank_and_tiles_it(fmt, want):
  shape = (4, 6, 8)
  assert scale_shape(shape, fmt) == want
  tiles = tile_shape(shape, want)
  assert all(d == k * t for d, k, t in zip(shape, want, tiles))


def test_bad_layouts_name_the_shapes():
  with pytest.raises(ValueError, match=r'group_size=3 does not divide axis 0 of length 4'):
    scale_shape((4, 6), int_format(4, group_size=3))
  with pytest.raises(ValueError, match=r'scale shape \(3, 1\) does not tile data shape \(4, 6\)'):
    tile_shape((4, 6), (3, 1))
  with pytest.raises(ValueError, match=r'scale shape \(4,\) does not tile'):
    tile_shape((4, 6), (4,))  # rank differs
  with pytest.raises(ValueError, match='both the group axis and a channel axis'):
    scale_shape((4, 6), int_format(4, group_size=2, group_axis=0, channel_axes=(0,)))


def test_tiled_view_broadcast_and_first_of_tiles_are_inverse():
  x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6)
  s = jnp.asarray([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])      # tiles of (2, 2)
  assert tiled(x, s.shape).shape == (2, 2, 3, 2)
  full = broadcast_scale(s, x.shape)
  np.testing.assert_array_equal(full[:2, :2], 10.0)
  np.testing.assert_array_equal(full[2:, 4:], 60.0)
  np.testing.assert_array_equal(first_of_tiles(full, s.shape), s)
  # Reducing the within-tile axes of the tiled view gives one value per scale.
  per_tile = tiled(x, s.shape).max(axis=numerics.tile_axes(2))
  np.testing.assert_array_equal(per_tile, [[7, 9, 11], [19, 21, 23]])


def test_the_seeds_toy_scale_codes_and_error():
  # Seed 003: x = [-0.83, -0.31, 0.18, 0.62, 1.04], symmetric, qmax = 7.
  x = jnp.asarray([-0.83, -0.31, 0.18, 0.62, 1.04])
  fmt = int_format(4)
  scale, zp = scale_and_zero_point(x.min(), x.max(), fmt)
  assert zp is None and round(float(scale), 3) == 0.149
  codes = numerics.to_codes(x, scale, None, fmt)
  np.testing.assert_array_equal(codes, [-6, -2, 1, 4, 7])
  err = jnp.abs(numerics.from_codes(codes, scale, None) - x).max()
  assert round(float(err), 3) == 0.061


def test_asymmetric_zero_point_keeps_zero_exact_and_zero_groups_are_exact():
  fmt = int_format(4, symmetric=False)
  lo, hi = jnp.asarray([0.5, 0.0]), jnp.asarray([2.0, 0.0])      # a range above 0; an all-zero
  scale, zp = scale_and_zero_point(lo, hi, fmt)
  # lo is widened to 0 so that 0 is a code: 0 -> code zp -> 0 exactly.
  np.testing.assert_allclose(scale, [2.0 / 15, 1.0])
  np.testing.assert_array_equal(numerics.from_codes(zp, scale, zp), [0.0, 0.0])
  codes = numerics.to_codes(jnp.zeros(2), scale, zp, fmt)
  np.testing.assert_array_equal(numerics.from_codes(codes, scale, zp), [0.0, 0.0])


def test_check_finite_names_count_index_and_fix():
  x = np.zeros((3, 4), np.float32)
  x[1, 2], x[2, 0] = np.nan, np.inf
  with pytest.raises(ValueError, match=r'the weights holds 2 NaN/Inf values \(first at index '
                                       r'\(1, 2\)\); clip it'):
    check_finite(x, 'the weights', 'clip it')
  check_finite(np.ones(3), 'fine')  # no error
