"""Formats, quantize/dequantize, QArray pytree behaviour and the seed's golden numbers."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qjax
from qjax import QFormat, int_format, fp8_format, quantize, dequantize

TOY = jnp.array([-0.83, -0.31, 0.18, 0.62, 1.04])


# ---- the seed's toy quantiser (chapter 33), exactly ---------------------------------------
class ToyTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_toy_vector(self):
    q = self.variant(lambda x: quantize(x, int_format(4)))(TOY)
    assert round(float(q.scale.ravel()[0]), 3) == 0.149
    np.testing.assert_array_equal(np.asarray(q.codes()), [-6, -2, 1, 4, 7])
    err = float(qjax.max_abs_error(TOY, dequantize(q)))
    assert round(err, 3) == 0.061
    np.testing.assert_allclose(dequantize(q), [-0.891, -0.297, 0.149, 0.594, 1.04], atol=5e-4)

  def test_two_rows(self):
    w = jnp.array([[.02, .04, .08, 1.1], [.01, .03, .06, .09]])
    g = quantize(w, int_format(4)).scale
    rows = quantize(w, int_format(4, channel_axes=(0,))).scale
    assert g.size == 1 and round(float(g.ravel()[0]), 3) == 0.157
    assert [round(float(v), 3) for v in np.asarray(rows).ravel()] == [0.157, 0.013]

  def test_seed_memory_table(self):
    # 7e9 parameters at 16 / 8 / 4 bits: 13.04 / 6.52 / 3.26 GiB (codes only).
    for bits, gib in [(8, 6.52), (4, 3.26)]:
      est = qjax.estimate_nbytes((7_000_000_000,), int_format(bits))
      assert round(est['codes'] / 2**30, 2) == gib


# ---- formats -----------------------------------------------------------------------------
def test_format_is_hashable_and_frozen():
  a, b = int_format(4, group_size=128, channel_axes=(1,)), int_format(4, group_size=128,
                                                                       channel_axes=[1])
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.bits = 8
  assert a.name == 'int4-g128-ch1'


@pytest.mark.parametrize('bits', [1, 7, 9, 16])
def test_bad_bit_width(bits):
  with pytest.raises(ValueError, match=f'bits={bits}.*use one of'):
    int_format(bits)


def test_bad_inputs_are_named():
  w = jnp.ones((100, 8))
  with pytest.raises(ValueError, match='group_size=32 does not divide axis 0 of length 100'):
    quantize(w, int_format(4, group_size=32))
  with pytest.raises(ValueError, match='axis 2 is out of range'):
    quantize(w, int_format(8, channel_axes=(2,)))
  with pytest.raises(ValueError, match='not a floating dtype'):
    QFormat(bits=8, scale_dtype='int32')
  bad = w.at[3, 4].set(jnp.nan)
  with pytest.raises(ValueError, match=r'NaN/Inf.*index \(3, 4\)'):
    quantize(bad, int_format(8))
  with pytest.raises(ValueError, match='NaN/Inf'):
    quantize(w.at[0, 0].set(jnp.inf), int_format(8))
  with pytest.raises(ValueError, match='expected a floating tensor'):
    quantize(jnp.ones((4, 4), jnp.int32), int_format(8))
  with pytest.raises(ValueError, match='has no zero point'):
    fp8_format('e4m3', symmetric=False)


@pytest.mark.parametrize('fmt', [int_format(4), int_format(4, symmetric=False),
                                 int_format(8, group_size=8), fp8_format('e4m3')])
def test_all_zero_group_gives_zeros_not_nan(fmt):
  x = jnp.concatenate([jnp.zeros((8, 4)), jnp.ones((8, 4))], axis=0)
  q = quantize(x, fmt.replace(channel_axes=(1,)) if fmt.group_size else fmt)
  assert np.isfinite(np.asarray(q.scale, np.float32)).all()
  np.testing.assert_array_equal(dequantize(quantize(jnp.zeros((8, 4)), fmt)), 0.0)


# ---- round-trip properties (hypothesis) -----------------------------------------------------
GRANULARITIES = [dict(), dict(channel_axes=(1,)), dict(channel_axes=(0,)),
                 dict(group_size=8), dict(group_size=8, channel_axes=(1,))]


@given(bits=st.sampled_from([2, 3, 4, 5, 6, 8]), sym=st.booleans(),
       gran=st.sampled_from(GRANULARITIES), seed=st.integers(0, 2**16),
       scale_dtype=st.sampled_from(['float32', 'bfloat16']))
def test_roundtrip_error_at_most_half_a_step(bits, sym, gran, seed, scale_dtype):
  x = jax.random.normal(jax.random.key(seed), (16, 12)) * 3.0
  fmt = int_format(bits, symmetric=sym, scale_dtype=scale_dtype, **gran)
  q = quantize(x, fmt)
  s = np.asarray(qjax.broadcast_scale(q.scale, x.shape), np.float32)  # one per element
  z = 0.0 if q.zero_point is None else np.asarray(
      qjax.broadcast_scale(q.zero_point, x.shape), np.float32)
  xv = np.asarray(x)
  err = np.abs(xv - np.asarray(dequantize(q)))
  inside = (xv >= (fmt.qmin - z) * s) & (xv <= (fmt.qmax - z) * s)
  assert (err <= s * (0.5 + 1e-5) + 1e-7)[inside].all()
  if sym and scale_dtype == 'float32':
    assert (err <= s * (0.5 + 1e-5) + 1e-7).all()  # absmax: nothing is clipped (to 1 ulp)
  # Every value lies within one step of the grid's ends (asymmetric zero points round).
  assert (err <= s * (1.0 + fmt.qmax * 2**-7) + 1e-6).all()


@given(bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(), seed=st.integers(0, 2**16))
def test_quantize_is_idempotent(bits, sym, seed):
  x = jax.random.normal(jax.random.key(seed), (8, 16))
  fmt = int_format(bits, symmetric=sym, channel_axes=(1,))
  # Symmetric absmax recalibrates to the same grid; an asymmetric grid's ends need not be
  # attained by any code, so there the representable values are re-quantized on their grid.
  rng = None if sym else qjax.compute_range(x, fmt)
  q1 = quantize(x, fmt, calibration=rng)
  q2 = quantize(dequantize(q1), fmt, calibration=rng)
  np.testing.assert_array_equal(q1.codes(), q2.codes())
  np.testing.assert_allclose(dequantize(q1), dequantize(q2), rtol=1e-6)  # scale: 1 ulp


# ---- fp8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize('kind,dt,fmax', [('e4m3', ml_dtypes.float8_e4m3fn, 448.0),
                                          ('e5m2', ml_dtypes.float8_e5m2, 57344.0)])
def test_fp8_limits_and_rounding_match_ml_dtypes(kind, dt, fmax):
  fmt = fp8_format(kind)
  assert fmt.qmax == fmax
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)) * 100, jnp.float32)
  q = quantize(x, fmt)
  s = np.float32(np.asarray(q.scale).ravel()[0])
  assert np.isclose(s, np.abs(np.asarray(x)).max() / fmax)
  expected = (np.asarray(x) / s).astype(dt)  # ml_dtypes: round to nearest even
  np.testing.assert_array_equal(np.asarray(q.codes()).astype(np.float32),
                                expected.astype(np.float32))
  # Saturation instead of NaN for values beyond the clip range (e4m3fn has no inf).
  q = quantize(x, fmt, calibration=(jnp.full((1, 1), -1.0), jnp.full((1, 1), 1.0)))
  assert np.isfinite(np.asarray(q.codes(), np.float32)).all()
  assert np.abs(np.asarray(q.codes(), np.float32)).max() == fmax


def test_fp8_round_half_to_even():
  # 1 + 2^-4 lies halfway between e4m3 neighbours 1.0 and 1.125: ties go to the even 1.0.
  fmt = fp8_format('e4m3')
  x = jnp.array([1.0 + 2**-4, 1.0 + 3 * 2**-4, 448.0])
  q = quantize(x, fmt, calibration=(jnp.array([-448.0]), jnp.array([448.0])))
  np.testing.assert_array_equal(np.asarray(q.codes(), np.float32), [1.0, 1.25, 448.0])


# ---- pytree behaviour ----------------------------------------------------------------------
def test_qarray_through_jit_vmap_and_tree():
  w = jax.random.normal(jax.random.key(0), (3, 64, 32))
  fmt = int_format(4, group_size=16, channel_axes=(-1,), symmetric=False)
  qs = jax.vmap(lambda x: quantize(x, fmt))(w)
  assert qs.data.shape == (3, 64, 16)
  deq = jax.vmap(dequantize)(qs)
  np.testing.assert_array_equal(deq[1], dequantize(quantize(w[1], fmt)))
  q = jax.jit(lambda x: quantize(x, fmt))(w[0])
  leaves, tree = jax.tree.flatten(q)
  assert len(leaves) == 3
  q2 = jax.tree.unflatten(tree, leaves)
  np.testing.assert_array_equal(dequantize(q2), jax.jit(dequantize)(q))
  assert jax.tree.map(lambda a: a * 0, q).shape == (64, 32)


def test_dequantize_dtype():
  x = jnp.ones((8, 8), jnp.bfloat16)
  q = quantize(x, int_format(8))
  assert dequantize(q).dtype == jnp.bfloat16 and dequantize(q, jnp.float32).dtype == jnp.float32
