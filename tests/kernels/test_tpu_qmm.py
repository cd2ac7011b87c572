"""qjax.kernels.tpu_qmm (Mosaic TPU kernel, run here in interpret mode) and tpu_gather,
against float64 numpy references; the blocking obeys the TPU (8, 128) rule."""

import jax.numpy as jnp
import numpy as np
import pytest

from qjax.kernels import tpu_gather, tpu_qmm

RNG = np.random.default_rng(0)
CODES = {'int8': (jnp.int8, 127), 'int4': (jnp.int4, 7), 'float8_e4m3fn': (jnp.float8_e4m3fn, 8)}


def _case(layout, m, d, f, group, dtype):
  jdt, qmax = CODES[dtype]
  x = RNG.standard_normal((m, d)).astype(np.float32)
  c = RNG.integers(-qmax, qmax + 1, (d, f)).astype(np.float32)
  c = np.asarray(jnp.asarray(c).astype(jdt).astype(jnp.float32))  # values the dtype holds
  s = (RNG.random((d // group, f)) + 0.5).astype(np.float32)
  ref = x.astype(np.float64) @ (c * np.repeat(s, group, axis=0)).astype(np.float64)
  codes = jnp.asarray(c).astype(jdt)
  if layout == 'nk':
    return x, codes.T, jnp.asarray(s).T, ref
  return x, codes, jnp.asarray(s), ref


@pytest.mark.parametrize('layout,m,d,f,group,dtype', [
    ('kn', 1, 256, 384, 32, 'int4'), ('kn', 3, 512, 256, 64, 'int4'),
    ('kn', 5, 1024, 256, 128, 'int4'), ('kn', 2, 512, 256, 512, 'int8'),
    ('kn', 20, 256, 128, 256, 'float8_e4m3fn'), ('kn', 300, 256, 128, 64, 'int8'),
    ('nk', 3, 512, 256, 128, 'int4'), ('nk', 1, 256, 384, 256, 'int8'),
    ('nk', 2, 256, 128, 256, 'float8_e4m3fn')])
def test_matches_float64(layout, m, d, f, group, dtype):
  x, codes, scales, ref = _case(layout, m, d, f, group, dtype)
  y = tpu_qmm.qmm(jnp.asarray(x), codes, scales, layout=layout, interpret=True)
  assert y.shape == (m, f) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2e-6,
                             atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize('group', [32, 64, 128])
def test_blocks_obey_the_tpu_rule(group):
  for device in ('TPU v5 lite', 'TPU v6 lite'):
    p, why = tpu_qmm.plan('kn', 1, 8192, 2048, group, tpu_qmm.blocks_for(device))
    assert p is not None, why
    # a scale block is 8 groups (or all of them) by a multiple of 128 columns
    assert (p.bd // group) % 8 == 0 or p.bd == p.d
    assert p.bf % 128 == 0 and p.d % p.bd == 0 and p.f % p.bf == 0
  assert tpu_qmm.fits('kn', 1, 256, 520, 64) is not None        # F = 520: no 128 block
  assert tpu_qmm.fits('kn', 1, 256, 200, 64) is None            # F = 200: one whole block
  assert tpu_qmm.fits('nk', 1, 256, 256, 64) is not None        # head groups are 128 lanes


def test_bad_operands_name_the_fix():
  x = jnp.ones((2, 256))
  with pytest.raises(ValueError, match='codes of dtype uint8'):
    tpu_qmm.qmm(x, jnp.ones((256, 128), jnp.uint8), jnp.ones((1, 128)), interpret=True)
  with pytest.raises(ValueError, match='contract 128'):
    tpu_qmm.qmm(x, jnp.ones((128, 128), jnp.int8), jnp.ones((1, 128)), interpret=True)


def test_gather_rows_matches_indexing():
  for dtype in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4):
    t = jnp.asarray(RNG.integers(-7, 8, (200, 256))).astype(dtype)
    ids = jnp.array([0, 199, 64, 65, 7])
    y = tpu_gather.gather_rows(t, ids, interpret=True)
    np.testing.assert_array_equal(y, np.asarray(t[ids].astype(jnp.float32)))
    assert tpu_gather.row_tile(dtype) * (4 if dtype == jnp.int4 else
                                         8 * jnp.dtype(dtype).itemsize) == 256
