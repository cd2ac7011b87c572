"""The paged decode attention kernel (both schedules, Pallas interpret mode) against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.kernels import paged_attention as pa
from paged_pools import pool_and_reference  # tests/kernels/paged_pools.py


def reference(q, k, v, table, q_pos, last, p, ring, window, softcap):
  """Every row's keys gathered from its table, positions from the layout, dense softmax."""
  b, n, h = q.shape
  kh, g = k.shape[2], n // k.shape[2]
  out = np.zeros((b, n, h))
  width = table.shape[1]
  for i in range(b):
    keys = k[table[i]].reshape(width * p, kh, h)
    vals = v[table[i]].reshape(width * p, kh, h)
    slot = np.arange(width * p)
    if ring:
      pos = last[i] - (last[i] - slot) % (width * p)
      pos = np.where(pos >= 0, pos, 2 ** 30)
    else:
      pos = slot
    ok = pos <= q_pos[i]
    if window is not None:
      ok &= q_pos[i] - pos < window
    for j in range(n):
      s = keys[:, j // g] @ np.asarray(q[i, j], np.float64)
      if softcap is not None:
        s = softcap * np.tanh(s / softcap)
      if not ok.any():
        continue
      w = np.where(ok, np.exp(s - s[ok].max()), 0.0)
      out[i, j] = (w / w.sum()) @ vals[:, j // g]
  return out


CASES = [  # kind, page size, (N, K), ring, window, softcap, pages per split
    ('float', 8, (4, 2), False, None, None, None),
    ('int8', 4, (4, 1), False, 9, None, 2),
    ('int4', 8, (8, 2), False, None, 30.0, 1),
    ('fp8', 16, (2, 2), False, None, None, None),
    ('int8', 4, (6, 2), True, 11, None, 2),  # a ring of pages, G = 3 (padded for Triton)
]


@pytest.mark.parametrize('backend', pa.BACKENDS)
@pytest.mark.parametrize('kind,p,heads,ring,window,softcap,pps', CASES)
def test_kernel_matches_float64_reference(backend, kind, p, heads, ring, window, softcap, pps):
  rng = np.random.default_rng(0)
  (n, kh), h, width, num_pages, b = heads, 16, 5, 24, 3
  k, ks, k64 = pool_and_reference(kind, rng, num_pages, p, kh, h)
  v, vs, v64 = pool_and_reference(kind, rng, num_pages, p, kh, h)
  table = rng.permutation(np.arange(1, num_pages))[:b * width].reshape(b, width)
  if ring:  # rows past one lap, inside the first lap, and an idle row (nothing to see)
    last, q_pos = np.array([width * p + 7, 5, 30]), np.array([width * p + 7, 5, -1])
  else:  # ragged rows: a page boundary, mid-page, the first key
    last = q_pos = np.array([2 * p - 1, width * p - 3, 0])
  q = jnp.asarray(rng.standard_normal((b, n, h)) * 0.3, jnp.float32)
  out = pa.paged_attention(q, k, v, jnp.asarray(table), jnp.asarray(q_pos), jnp.asarray(last),
                           k_scales=ks, v_scales=vs, int4=kind == 'int4', ring=ring,
                           window=window, logit_softcap=softcap, pages_per_split=pps,
                           backend=backend, interpret=True)
  want = reference(np.asarray(q), k64, v64, table, q_pos, last, p, ring, window, softcap)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize('backend,platform,target', [('triton', 'cuda', 'triton'),
                                                     ('mosaic', 'tpu', 'tpu_custom_call')])
@pytest.mark.parametrize('kind', ['int8', 'int4'])
def test_kernel_lowers_for_its_accelerator(backend, platform, target, kind, abstract_gpu):
  """Pallas lowers each schedule to Triton / Mosaic on a CPU-only install (no compile)."""
  hs = 32 if kind == 'int4' else 64
  dt = jnp.uint8 if kind == 'int4' else jnp.int8
  pool = jax.ShapeDtypeStruct((64, 16, 8, hs), dt)
  scales = jax.ShapeDtypeStruct((64, 16, 8, 1), jnp.float32)
  rows = jax.ShapeDtypeStruct((4,), jnp.int32)
  f = lambda q, k, v, t, qp, la, ks, vs: pa.paged_attention(
      q, k, v, t, qp, la, k_scales=ks, v_scales=vs, int4=kind == 'int4', window=100,
      logit_softcap=50.0, pages_per_split=4, backend=backend)
  args = (jax.ShapeDtypeStruct((4, 32, 64), jnp.bfloat16), pool, pool,
          jax.ShapeDtypeStruct((4, 8), jnp.int32), rows, rows, scales, scales)
  unchecked = [jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')]
  text = jax.export.export(jax.jit(f), platforms=[platform],
                           disabled_checks=unchecked)(*args).mlir_module()
  assert target in text


def test_bad_backend_and_shapes_are_refused():
  q, pool = jnp.zeros((1, 4, 16)), jnp.zeros((4, 8, 2, 16))
  ints = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="backend='cuda' is unknown"):
    pa.paged_attention(q, pool, pool, *ints, backend='cuda')
  with pytest.raises(ValueError, match='do not fit pools'):
    pa.paged_attention(q, pool, pool, *ints, int4=True)
