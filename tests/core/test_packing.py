"""Bit packing round trips and storage accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qjax
from qjax import int_format, quantize


@given(bits=st.sampled_from([2, 3, 4]), n=st.integers(1, 67), rows=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_pack_unpack_exact(bits, n, rows, seed):
  rng = np.random.default_rng(seed)
  c = rng.integers(-2**(bits - 1), 2**(bits - 1), size=(rows, n)).astype(np.int8)
  p = qjax.pack(jnp.asarray(c), bits)
  assert p.dtype == jnp.uint8 and p.shape == (rows, qjax.packed_length(n, bits))
  np.testing.assert_array_equal(qjax.unpack(p, bits, n), c)
  np.testing.assert_array_equal(jax.jit(qjax.unpack, static_argnums=(1, 2))(p, bits, n), c)


@pytest.mark.parametrize('bits', [2, 3, 4])
def test_unpack_fields_are_strided_codes(bits):
  per = {2: 4, 3: 8, 4: 2}[bits]
  c = np.random.default_rng(bits).integers(-2**(bits - 1), 2**(bits - 1), (3, 8 * per))
  fields = qjax.core.packing.unpack_fields(qjax.pack(jnp.asarray(c, jnp.int8), bits), bits)
  assert len(fields) == per
  for j, f in enumerate(fields):
    np.testing.assert_array_equal(f, c[:, j::per])


def test_packed_bytes_per_code():
  assert qjax.packed_length(128, 4) == 64
  assert qjax.packed_length(128, 2) == 32
  assert qjax.packed_length(128, 3) == 48   # 8 codes in 3 bytes
  assert qjax.packed_length(9, 3) == 6      # padded up to a whole 8-code group


def test_known_layout():
  # 4-bit: code 2i in the low nibble. [-1, 2] -> 0x2F; 2-bit [1,-1,0,-2] -> 0b10_00_11_01.
  np.testing.assert_array_equal(qjax.pack(jnp.array([-1, 2], jnp.int8), 4), [0x2F])
  np.testing.assert_array_equal(qjax.pack(jnp.array([1, -1, 0, -2], jnp.int8), 2), [0b10001101])


@pytest.mark.parametrize('bits', [1, 5, 8])
def test_pack_rejects_unpacked_widths(bits):
  with pytest.raises(ValueError, match='packed widths are 2, 3, 4'):
    qjax.pack(jnp.zeros((4,), jnp.int8), bits)


def test_nbytes_int4_g128_4096():
  w = jnp.zeros((4096, 4096), jnp.float32)
  fmt = int_format(4, group_size=128, channel_axes=(1,))
  q = quantize(w, fmt)
  assert q.nbytes == 8 * 2**20 + 512 * 2**10
  assert q.nbytes == sum(a.nbytes for a in jax.tree.leaves(q))
  est = qjax.estimate_nbytes(w.shape, fmt)['total']
  assert abs(q.nbytes - est) / est < 0.01


def test_nbytes_int8_per_channel_4096():
  w = jnp.zeros((4096, 4096), jnp.float32)
  q = quantize(w, int_format(8, channel_axes=(1,)))
  assert q.nbytes == 16 * 2**20 + 16 * 2**10


@pytest.mark.parametrize('bits,per_code', [(2, 0.25), (3, 0.375), (4, 0.5), (5, 1.0), (8, 1.0)])
def test_nbytes_equals_leaves_for_every_width(bits, per_code):
  w = jax.random.normal(jax.random.key(0), (256, 64))
  q = quantize(w, int_format(bits, group_size=32, channel_axes=(1,), symmetric=False))
  assert q.data.nbytes == 256 * 64 * per_code
  assert q.nbytes == sum(a.nbytes for a in jax.tree.leaves(q))
  assert q.nbytes == q.data.nbytes + 2 * (256 // 32) * 64 * 4  # f32 scales + zero points
