"""RoPE golden properties and grouped-query attention against an independent MHA reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from qjax.nn import apply_rope, attend, attention_mask


def _pos(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


class RopeTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_rotation_preserves_norm_and_position_zero_is_identity(self):
    x = jax.random.normal(jax.random.key(0), (2, 7, 3, 16))
    rope = self.variant(lambda x, p: apply_rope(x, p, 10_000.0))
    y = rope(x, _pos(2, 7, start=5))
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(rope(x, jnp.zeros((2, 7), jnp.int32)), x, atol=0)

  def test_matches_complex_multiplication(self):
    h, base, pos = 8, 100.0, 3
    x = np.random.default_rng(0).normal(size=h).astype(np.float32)
    z = (x[:h // 2] + 1j * x[h // 2:]) * np.exp(1j * pos * base ** (-np.arange(0, h, 2) / h))
    y = apply_rope(jnp.asarray(x)[None, None, None], jnp.full((1, 1), pos), base)[0, 0, 0]
    np.testing.assert_allclose(y, np.concatenate([z.real, z.imag]), rtol=1e-5, atol=1e-6)

  def test_dot_product_depends_only_on_position_difference(self):
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, 1, 1, 32))
    k = jax.random.normal(kk, (1, 1, 1, 32))
    def score(m, n):
      rotate = lambda x, p: apply_rope(x, jnp.full((1, 1), p), 1e4)
      return jnp.sum(rotate(q, m) * rotate(k, n))
    np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)
    np.testing.assert_allclose(score(0, 5), score(20, 25), rtol=1e-4)
    assert abs(score(7, 3) - score(7, 4)) > 1e-3


def mha_reference(q_BTNH, k_BSNH, v_BSNH, window=None):
  """Plain multi-head causal attention, one head at a time, in numpy."""
  q, k, v = (np.asarray(a, np.float64) for a in (q_BTNH, k_BSNH, v_BSNH))
  b, t, n, _ = q.shape
  out = np.zeros_like(q)
  for i in range(n):
    s = np.einsum('bth,bsh->bts', q[:, :, i], k[:, :, i])
    qp, kp = np.arange(t)[:, None], np.arange(k.shape[1])[None]
    ok = (kp <= qp) & ((qp - kp < window) if window else True)
    s = np.where(ok, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[:, :, i] = np.einsum('bts,bsh->bth', p / p.sum(-1, keepdims=True), v[:, :, i])
  return out


class AttendTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(('mha', 4, None), ('mha_window', 4, 3), ('gqa', 2, None),
                                  ('mqa', 1, 2))
  def test_grouped_attention_equals_mha_with_repeated_kv(self, k_heads, window):
    b, t, n, h = 2, 6, 4, 8
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (b, t, n, h))
    k = jax.random.normal(kk, (b, t, k_heads, h))
    v = jax.random.normal(kv, (b, t, k_heads, h))
    fn = self.variant(lambda q, k, v: attend(q, k, v, _pos(b, t), _pos(b, t), window=window))
    rep = n // k_heads  # query head j uses kv head j // G
    ref = mha_reference(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), window)
    np.testing.assert_allclose(fn(q, k, v), ref, rtol=1e-5, atol=1e-5)

  def test_mask_is_causal_and_windowed(self):
    m = np.asarray(attention_mask(_pos(1, 5), _pos(1, 5), window=2)[0])
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                         [0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(m, expected)

  def test_softcap_bounds_logits(self):
    q = 100 * jnp.ones((1, 2, 1, 4))
    k = jnp.ones((1, 2, 1, 4)).at[:, 1].set(-1.0)
    v = jnp.arange(2.0).reshape(1, 2, 1, 1) * jnp.ones((1, 2, 1, 4))
    capped = attend(q, k, v, _pos(1, 2), _pos(1, 2), logit_softcap=1.0)
    # logits +-400 capped to +-1: the second query mixes both values, weight 1/(1+e^2).
    np.testing.assert_allclose(capped[0, 1, 0, 0], 1 / (1 + np.exp(2.0)), rtol=1e-5)

