"""The straight-through estimator: forward equals quantize-dequantize, gradients as specified."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import fake_quant, int_format, fp8_format


@pytest.mark.parametrize('fmt', [int_format(4), int_format(3, group_size=8, channel_axes=(1,)),
                                 int_format(8, symmetric=False, channel_axes=(0,)),
                                 int_format(4, pow2_scale=True, channel_axes=(1,)),
                                 fp8_format('e4m3', channel_axes=(1,))])
@pytest.mark.backend(
    'cpu',
    reason=(
        'XLA:CPU runs these ops unfused; XLA:GPU fuses the jitted form (FMA contraction),'
        ' so a rounding tie can land one code apart'))
def test_forward_is_bit_identical_to_quantize_dequantize(fmt):
  x = jax.random.normal(jax.random.key(0), (16, 24))
  np.testing.assert_array_equal(fake_quant(x, fmt), qjax.dequantize(qjax.quantize(x, fmt)))
  np.testing.assert_array_equal(jax.jit(fake_quant, static_argnums=1)(x, fmt),
                                qjax.dequantize(qjax.quantize(x, fmt)))


@pytest.mark.backend(
    'cpu',
    reason=(
    "values exactly on the clipping boundary: XLA:GPU's fused scale arithmetic can "
            'put them one ulp outside'))
def test_ste_gradient_identity_inside_zero_outside():
  fmt = int_format(4)
  rng = (jnp.array([-1.0]), jnp.array([1.0]))
  x = jnp.array([-3.0, -1.0, -0.5, 0.0, 0.33, 1.0, 1.2])
  g = jax.grad(lambda x: jnp.sum(fake_quant(x, fmt, calibration=rng) * jnp.arange(7.0)))(x)
  np.testing.assert_array_equal(g, [0, 1, 2, 3, 4, 5, 0])


def test_lsq_scale_gradient_matches_formula_and_finite_differences():
  fmt = int_format(4)
  x = jnp.array([-1.3, -0.42, 0.05, 0.31, 0.74, 2.0])
  s = jnp.array([0.11])
  g = jax.grad(lambda s: jnp.sum(fake_quant(x, fmt, scale=s)))(s)
  v = np.asarray(x) / 0.11
  formula = np.where(v < -7, -7, np.where(v > 7, 7, np.round(v) - v)).sum()
  np.testing.assert_allclose(float(g[0]), formula, rtol=1e-5)
  # Finite differences of LSQ's surrogate (rounding offsets round(v) - v frozen at s0, clip
  # kept): x_hat(s) = s * (x/s + c) inside the range, s * clip bound outside.
  v0 = np.asarray(x, np.float64) / 0.11
  c = np.round(v0) - v0
  inside = np.abs(v0) <= 7

  def surrogate(s):
    x64 = np.asarray(x, np.float64)
    return np.where(inside, s * (x64 / s + c), s * np.clip(v0, -7, 7)).sum()

  eps = 1e-6
  fd = (surrogate(0.11 + eps) - surrogate(0.11 - eps)) / (2 * eps)
  np.testing.assert_allclose(float(g[0]), fd, rtol=1e-4)
