"""The Pallas weight-only int8 / int4 kernel (interpret mode on CPU, compiled on a device)
against the float64 quantize-dequantize reference, through `qjax.kernels.pallas_qmm.qmm` and
`qeinsum(path='pallas')`; its GPU lowering is checked with `jax.export` without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import int_format, qeinsum, quantize
from qjax.core import layouts, pallas_path
from qjax.kernels import pallas_qmm

K = jax.random.split(jax.random.key(7), 4)
W_DF = jax.random.normal(K[0], (256, 128)) / 16


def _ref64(x, q):
  c = np.asarray(q.codes(), np.float64)
  s = np.asarray(qjax.broadcast_scale(q.scale.astype(jnp.float32), q.shape), np.float64)
  return np.asarray(x, np.float64).reshape(-1, q.shape[0]) @ (c * s).reshape(q.shape[0], -1)


@pytest.mark.parametrize('fmt', [int_format(8, channel_axes=(1,)),
                                 int_format(8, group_size=64, channel_axes=(1,)),
                                 int_format(4, channel_axes=(1,)),
                                 int_format(4, group_size=32, channel_axes=(1,)),
                                 int_format(4, group_size=128)],
                         ids=lambda f: f.name)
def test_matches_float64_reference_at_decode_rows(fmt):
  q = quantize(W_DF, fmt)
  for m in (1, 64, 200):  # decode rows, and prefill rows in blocks (the last one padded)
    x = jax.random.normal(K[1], (m, 256))
    y = qjax.qdot(x, q, path='pallas')
    assert y.shape == (m, 128) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _ref64(x, q), rtol=1e-5, atol=1e-5)


def test_bf16_activations_and_small_blocks():
  q = quantize(W_DF, int_format(4, group_size=64, channel_axes=(1,)))
  x = jax.random.normal(K[1], (3, 256))
  ref = _ref64(x.astype(jnp.bfloat16).astype(jnp.float32), q)
  y = pallas_qmm.qmm(x.astype(jnp.bfloat16), q.data, q.scale, bits=4, block_f=32)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)  # codes exact in bf16, f32 sums


def test_heads_and_the_flattened_contraction():
  """q_proj 'BTD,DNH->BTNH' and o_proj 'BTNH,NHD->BTD' with groups of 32 over N*H (H = 16)."""
  x_btd = jax.random.normal(K[2], (2, 1, 64))
  q = quantize(jax.random.normal(K[3], (64, 4, 16)),
               int_format(4, group_size=32, channel_axes=(1, 2)))
  np.testing.assert_allclose(qeinsum('BTD,DNH->BTNH', x_btd, q, path='pallas'),
                             jnp.einsum('BTD,DNH->BTNH', x_btd, q.dequantize()),
                             rtol=1e-5, atol=1e-5)
  x_btnh = jax.random.normal(K[2], (2, 1, 4, 16))
  q = quantize(jax.random.normal(K[3], (4, 16, 64)),
               int_format(4, group_size=32, group_axis=1, channel_axes=(2,)))
  assert q.tile_shape == (2, 16, 1)  # groups of 32 cover two heads of 16
  np.testing.assert_allclose(qeinsum('BTNH,NHD->BTD', x_btnh, q, path='pallas'),
                             jnp.einsum('BTNH,NHD->BTD', x_btnh, q.dequantize()),
                             rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_raises_or_takes_the_auto_path():
  x = jnp.ones((2, 256))
  asym = quantize(W_DF, int_format(4, channel_axes=(1,), symmetric=False))
  head = quantize(W_DF.T, int_format(8, channel_axes=(0,)))
  q8 = quantize(W_DF, int_format(8, channel_axes=(1,)))
  for spec, xx, w, match in [('BD,DF->BF', x, asym, 'not symmetric int8 / int4'),
                             ('BD,VD->BV', x, head, r'not x \(M, K\) @ w')]:
    with pytest.raises(ValueError, match=match):
      pallas_path.pallas_einsum(*spec.replace('->', ',').split(','), xx, w, jnp.float32)
    # qeinsum(path='pallas') gives them to the weight-only 'auto' path instead.
    np.testing.assert_allclose(qeinsum(spec, xx, w, path='pallas'),
                               qeinsum(spec, xx, w, path='dequant'), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match='bits=3 has no kernel'):
    pallas_qmm.qmm(x, q8.data, q8.scale, bits=3)


def test_native_int4_codes_are_the_packed_bytes():
  # XLA stores s4 two a byte, low nibble first: qjax's packing, so native codes reach the
  # kernel by a bitcast and give the packed layout's result.
  packed = quantize(W_DF, int_format(4, group_size=64, channel_axes=(1,)))
  native = layouts.to_layout(packed, 'native')
  x = jax.random.normal(jax.random.key(5), (3, 256))
  y = qeinsum('BD,DF->BF', x, native, path='pallas_gpu')
  np.testing.assert_array_equal(y, qeinsum('BD,DF->BF', x, packed, path='pallas_gpu'))
  np.testing.assert_allclose(y, x @ packed.dequantize(), rtol=1e-5, atol=1e-5)


def test_groups_wider_than_a_block_and_the_output_dtype():
  # groups of 256 rows walk K in blocks of 128 (two blocks per scale row); bf16 out of the
  # kernel is its f32 sums rounded once
  w = jax.random.normal(K[2], (512, 256)) / 16
  q = quantize(w, int_format(4, group_size=256, channel_axes=(1,)))
  x = jax.random.normal(K[1], (130, 512)).astype(jnp.bfloat16)
  ref = _ref64(x.astype(jnp.float32), q)
  y = pallas_qmm.qmm(x, q.data, q.scale, bits=4, out_dtype=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and y.shape == (130, 256)
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-2, atol=1e-2)
  y32 = pallas_qmm.qmm(x, q.data, q.scale, bits=4)
  np.testing.assert_array_equal(y, y32.astype(jnp.bfloat16))


@pytest.mark.parametrize('bits,rows', [(8, 16), (4, 16), (4, 512)])
def test_lowers_to_triton_for_a_gpu_without_one(bits, rows, abstract_gpu):
  """The kernel's GPU lowering (Pallas -> Triton IR in an XLA custom call), checked by
  `jax.export` for platform 'cuda' on any machine; PTX compilation happens on the device."""
  x = jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 256 if bits == 8 else 128), jnp.int8 if bits == 8 else jnp.uint8)
  s = jax.ShapeDtypeStruct((2, 256), jnp.float32)
  f = functools.partial(pallas_qmm.qmm, bits=bits, interpret=False, platform='cuda')
  exported = jax.export.export(
      jax.jit(f), platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')])(
          x, w, s)
  assert 'xla.gpu.triton' in exported.mlir_module()
  assert exported.out_avals[0].shape == (rows, 256)
