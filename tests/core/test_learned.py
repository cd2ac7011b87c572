"""Learned quantization parameters (LSQ, PACT): golden values and the conversion contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.core import (compute_range, conversion_range, init_learned, int_format,
                       learned_qparams, learned_range, pact_clip, quantize)

ASYM4 = int_format(4, symmetric=False)  # codes -8..7


def test_learned_range_and_qparams_golden():
  lo, hi = learned_range(jnp.float32(0.5), jnp.float32(3.4), ASYM4)  # z rounds to 3
  assert (float(lo), float(hi)) == (-5.5, 2.0)  # (-8 - 3) * 0.5, (7 - 3) * 0.5
  s, z = learned_qparams(jnp.float32(0.5), jnp.float32(3.4), ASYM4)
  assert (float(s), float(z)) == (0.5, 3.0)
  s, z = learned_qparams(jnp.float32(0.1), None, int_format(4))
  np.testing.assert_allclose(float(s), 0.1, rtol=1e-6)
  assert z is None
  s, _ = learned_qparams(jnp.float32(-1.0), None, int_format(4))  # kept positive
  assert float(s) > 0


@pytest.mark.parametrize('raw,want', [(0.3, 0.25), (0.4, 0.5), (3.0, 4.0)])
def test_pow2_scales_round_in_log2(raw, want):
  s, _ = learned_qparams(jnp.float32(raw), None, int_format(4, pow2_scale=True))
  assert float(s) == want


def test_pact_clip_gradient_counts_the_clipped_inputs():
  x = jnp.array([-3.0, -1.0, 0.5, 2.0, 4.0])
  np.testing.assert_array_equal(pact_clip(x, 1.5), [-1.5, -1.0, 0.5, 1.5, 1.5])
  assert float(jax.grad(lambda a: pact_clip(x, a).sum())(1.5)) == 2 - 1  # above a, below -a


@pytest.mark.parametrize('fmt', [int_format(4, group_size=16, channel_axes=(1,)),
                                 int_format(3, symmetric=False, channel_axes=(1,)),
                                 int_format(4, pow2_scale=True, channel_axes=(1,))],
                         ids=lambda f: f.name)
def test_quantize_stores_exactly_the_learned_scales(fmt):
  """conversion_range: the range `quantize` turns back into `learned_qparams`' scales."""
  w = jax.random.normal(jax.random.key(0), (32, 6))
  scale, zp = init_learned(w, fmt)
  scale = scale * jnp.linspace(0.7, 1.3, scale.size).reshape(scale.shape)  # "trained"
  s, z = learned_qparams(scale, zp, fmt)
  q = quantize(w, fmt, conversion_range(scale, zp, fmt))
  np.testing.assert_array_equal(q.scale, s)
  if z is not None:
    np.testing.assert_array_equal(q.zero_point, z)


def test_init_learned_starts_from_a_qarray_or_a_range():
  fmt = int_format(4, pow2_scale=True, channel_axes=(1,))
  w = jax.random.normal(jax.random.key(2), (16, 4))
  q = quantize(w, fmt, 'mse')
  np.testing.assert_array_equal(learned_qparams(*init_learned(w, fmt, q), fmt)[0], q.scale)
  lo, hi = compute_range(w, fmt)
  with pytest.raises(ValueError, match=r'has shape .*, expected'):
    init_learned(w, fmt, (lo[..., :1], hi[..., :1]))
