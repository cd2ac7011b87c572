"""qjax.kernels.gpu_qmm_head (the tied head's layout on Triton; interpret mode here) against a
float64 numpy reference; its GPU lowering is compiled for a compile-only H200 in tests/aot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from qjax.kernels import gpu_qmm_head

RNG = np.random.default_rng(1)


@pytest.mark.parametrize('bits,m,n,k,group', [(4, 1, 256, 512, 128), (4, 3, 384, 256, 256),
                                              (8, 2, 256, 512, 64), (8, 17, 128, 256, 256),
                                              # K = 640 (Gemma 3's width): 5 groups, or
                                              # per channel in blocks of 128; 16 rows: no pad
                                              (4, 16, 256, 640, 128), (8, 8, 128, 640, 640)])
def test_matches_float64(bits, m, n, k, group):
  x = RNG.standard_normal((m, k)).astype(np.float32)
  qmax = 7 if bits == 4 else 127
  c = RNG.integers(-qmax, qmax + 1, (n, k)).astype(np.float32)
  s = (RNG.random((n, k // group)) + .5).astype(np.float32)
  ref = x.astype(np.float64) @ (c * np.repeat(s, group, axis=1)).T.astype(np.float64)
  w = jnp.asarray(c).astype(jnp.int8)
  if bits == 4:  # the bytes XLA stores s4 in: two a byte along K, low nibble first
    w = lax.bitcast_convert_type(jnp.asarray(c).astype(jnp.int4).reshape(n, k // 2, 2),
                                 jnp.uint8)
  y = gpu_qmm_head.qmm_nk(jnp.asarray(x), w, jnp.asarray(s), bits=bits, interpret=True)
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2e-6,
                             atol=2e-6 * np.abs(ref).max())


def test_refusals_name_the_reason():
  assert 'decode shapes' in gpu_qmm_head.refusal(65, 256, 256, 128, 4)
  assert 'power-of-two' in gpu_qmm_head.refusal(1, 100, 256, 128, 4)
  assert gpu_qmm_head.refusal(8, 128256, 2048, 128, 4) is None


def test_bf16_logits_are_the_f32_sums_rounded_once():
  x = jnp.asarray(RNG.standard_normal((3, 256)), jnp.bfloat16)
  w = jnp.asarray(RNG.integers(0, 256, (128, 128)), jnp.uint8)
  s = jnp.asarray(RNG.random((128, 2)) + .5, jnp.float32)
  y32 = gpu_qmm_head.qmm_nk(x, w, s, bits=4, interpret=True)
  y16 = gpu_qmm_head.qmm_nk(x, w, s, bits=4, interpret=True, out_dtype=jnp.bfloat16)
  assert y16.shape == (3, 128) and y16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(y16, y32.astype(jnp.bfloat16))


def test_cuda_lowering_writes_the_rows_asked_for(abstract_gpu):
  # Shapes only: under jax >= 0.12 the abstract GPU mesh admits no eager array.
  x = jax.ShapeDtypeStruct((3, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((128, 128), jnp.uint8)
  s = jax.ShapeDtypeStruct((128, 2), jnp.float32)
  f = functools.partial(gpu_qmm_head.qmm_nk, bits=4, interpret=False, platform='cuda')
  exported = jax.export.export(
      jax.jit(f), platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')])(
          x, w, s)
  assert 'xla.gpu.triton' in exported.mlir_module()
  assert exported.out_avals[0].shape == (3, 128)  # the masked write: no padding rows
