"""The ragged paged attention kernel (Pallas interpret mode) against float64: mixed steps of
rows with one and several queries, KV lengths off page boundaries, bf16 / int8 / fp8 / int4
pools, GQA, windows, rings and softcaps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.kernels import ragged_paged as rp
from paged_pools import pool_and_reference  # tests/kernels/paged_pools.py


def reference(q, k, v, table, q_pos, last, p, ring, window, softcap):
  """Every row's keys gathered from its table, positions from the layout, dense softmax per
  query (a query at -1, or one that sees no key, gives 0)."""
  b, t, n, h = q.shape
  kh, width = k.shape[2], table.shape[1]
  g = n // kh
  out = np.zeros((b, t, n, h))
  for i in range(b):
    keys = k[table[i]].reshape(width * p, kh, h)
    vals = v[table[i]].reshape(width * p, kh, h)
    slot = np.arange(width * p)
    pos = last[i] - (last[i] - slot) % (width * p) if ring else slot
    pos = np.where(pos >= 0, pos, 2 ** 30)
    for s in range(t):
      ok = pos <= q_pos[i, s]
      if window is not None:
        ok &= q_pos[i, s] - pos < window
      if q_pos[i, s] < 0 or not ok.any():
        continue
      for j in range(n):
        x = keys[:, j // g] @ np.asarray(q[i, s, j], np.float64)
        if softcap is not None:
          x = softcap * np.tanh(x / softcap)
        w = np.where(ok, np.exp(x - x[ok].max()), 0.0)
        out[i, s, j] = (w / w.sum()) @ vals[:, j // g]
  return out


CASES = [  # kind, page size, (N, K), ring, window, softcap, block_q
    ('bf16', 8, (4, 2), False, None, None, None),
    ('int8', 4, (6, 2), False, None, None, 2),  # G = 3, blocks of 2 queries
    ('fp8', 4, (4, 1), False, 7, 30.0, 3),
    ('int4', 8, (4, 2), False, None, None, None),
    ('int8', 4, (4, 2), True, 9, None, 2),  # a ring of pages
]


@pytest.mark.parametrize('kind,p,heads,ring,window,softcap,block_q', CASES)
def test_ragged_kernel_matches_float64_reference(kind, p, heads, ring, window, softcap,
                                                 block_q):
  """Four rows: a chunk of 5 queries ending mid-page, a decode, an idle row, a chunk of 3."""
  rng = np.random.default_rng(0)
  (n, kh), h, width, num_pages, b, t = heads, 16, 5, 24, 4, 5
  k, ks, k64 = pool_and_reference(kind, rng, num_pages, p, kh, h)
  v, vs, v64 = pool_and_reference(kind, rng, num_pages, p, kh, h)
  table = rng.permutation(np.arange(1, num_pages))[:b * width].reshape(b, width)
  counts = np.array([5, 1, 0, 3])
  if ring:  # the first row past one lap of its ring
    first = np.array([width * p + 2, 2 * p + 1, 0, 6])
  else:  # KV lengths off page boundaries, one chunk from position 0
    first = np.array([2 * p + 1, 3 * p - 2, 0, 0])
  q_pos = np.where(np.arange(t)[None] < counts[:, None], first[:, None] + np.arange(t), -1)
  last = np.maximum(first + counts - 1, 0)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)) * 0.3, jnp.float32)
  out = rp.ragged_paged_attention(
      q, k, v, jnp.asarray(table), jnp.asarray(q_pos), jnp.asarray(last), k_scales=ks,
      v_scales=vs, int4=kind == 'int4', ring=ring, window=window, logit_softcap=softcap,
      block_q=block_q, interpret=True)
  want = reference(np.asarray(q), k64, v64, table, q_pos, last, p, ring, window, softcap)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)


def test_bad_inputs_name_the_value_and_the_fix():
  q = jnp.zeros((2, 3, 4, 16))
  pool = jnp.zeros((5, 4, 2, 16))
  table, pos, last = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(2)
  with pytest.raises(ValueError, match='do not fit pools'):
    rp.ragged_paged_attention(q, pool, pool, table, pos, last, int4=True)
  with pytest.raises(ValueError, match='must have the queries'):
    rp.ragged_paged_attention(q, pool, pool, table, pos[:, :2], last)
  with pytest.raises(ValueError, match='both k_scales and v_scales'):
    rp.ragged_paged_attention(q, pool, pool, table, pos, last, k_scales=pool[..., :1])
  with pytest.raises(ValueError, match='block_q=0'):
    rp.ragged_paged_attention(q, pool, pool, table, pos, last, block_q=0)


def test_ragged_kernel_lowers_to_one_mosaic_call():
  """Lowered for a TPU on this CPU-only host: one Mosaic custom call (compiling it needs the
  compile-only toolchain: tests/aot)."""
  q = jax.ShapeDtypeStruct((2, 8, 4, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((9, 16, 2, 128), jnp.int8)
  scales = jax.ShapeDtypeStruct((9, 16, 2, 1), jnp.float32)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  run = lambda *a: rp.ragged_paged_attention(*a[:6], k_scales=a[6], v_scales=a[7])
  text = jax.export.export(jax.jit(run), platforms=['tpu'])(
      q, pool, pool, ints(2, 4), ints(2, 8), ints(2), scales, scales).mlir_module()
  assert text.count('tpu_custom_call') == 1
