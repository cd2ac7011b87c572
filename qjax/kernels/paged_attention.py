"""Paged decode attention as a Pallas kernel: one query per row over its pages, quantized or not.

The cache is qjax's paged layout (`qjax.infer.PagedKVCache`): per layer a pool of pages
(num_pages, Y, K, H) read through a per-row table of pool pages. Stored codes stay codes: an
int8, fp8 or packed int4 page (two codes per byte along H, low nibble first) is read from the
pool as bytes and dequantized inside the kernel, never as a float copy of the cache. The
per-token scales (shape (num_pages, Y, K, 1)) multiply the page's values in registers / VMEM
after the load; int4's two nibbles per byte meet the even and odd query features, so no
nibble interleave runs in the kernel.

Each program handles one row's pages of one split (split-K: long rows are cut into
`pages_per_split` pieces that run in parallel) with FlashAttention's online softmax, and the
pieces are merged by their log-sum-exp afterwards. Only the pages a row's query can see are
visited (from its window's first page to its own page); a ring table (sliding-window layers)
holds E pages whose positions follow from the row's newest position.

Two schedules of one online-softmax step (`_online_step`), by backend:
* 'triton' (GPU): grid (B, K, splits), a loop over pages inside, each page of one kv head
  loaded from the pool by its table entry; products as broadcasts and sums (decode is
  bandwidth bound, and G query heads per kv head are too few rows for tensor-core tiles).
* 'mosaic' (TPU): grid (B, splits, pages), the table prefetched to scalar memory and the pool
  block of each step chosen by it (Pallas pipelines the page copies); a page of every kv
  head as one 2-D tile (Y * K, H) scored by one dot against all K * G queries, the mask
  keeping each query's own kv head; state in VMEM scratch.
Both run in Pallas interpret mode on any backend (`interpret=True`), which is how the tests
check them on CPU against a float64 reference. This module imports nothing else from qjax.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BACKENDS = ('triton', 'mosaic')
_BACKEND_MODULES = {'triton': 'jax.experimental.pallas.triton',
                    'mosaic': 'jax.experimental.pallas.tpu'}
_NEG = -1e30


@functools.cache
def backend_available(backend: str) -> bool:
  """Whether this jax ships the Pallas `backend` ('triton' or 'mosaic'). jax 0.12 deprecates
  the Triton backend, to be removed in a future jax in favour of Mosaic GPU; where it is gone,
  the paged attention choice keeps the XLA scan rather than failing at the import."""
  if backend not in _BACKEND_MODULES:
    raise ValueError(f'backend={backend!r} is unknown; use one of {BACKENDS}.')
  return importlib.util.find_spec(_BACKEND_MODULES[backend]) is not None


def _unpack_int4(b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Signed low and high nibbles of packed bytes, as float32 (codes 2i and 2i+1)."""
  b = b.astype(jnp.int32)
  lo = ((b & 0xF) ^ 8) - 8
  hi = (((b >> 4) & 0xF) ^ 8) - 8
  return lo.astype(jnp.float32), hi.astype(jnp.float32)


def _dequantized(page, scale, int4: bool) -> tuple[jax.Array, ...]:
  """A page block's values (rows, H) as float32 parts, times its per-row scales (rows, 1)."""
  parts = _unpack_int4(page) if int4 else (page.astype(jnp.float32),)
  return parts if scale is None else tuple(x * scale.astype(jnp.float32) for x in parts)


def _online_step(state, q_parts, k_parts, v_parts, ok_MS, *, softcap, use_dot):
  """One key block of the online softmax for M query rows over S keys.

  state: (m (M, 1), l (M, 1), acc parts (M, Hp)); q/k/v parts: (M, Hp), (S, Hp), (S, Hp)
  float32 (int4: even and odd features); ok_MS: which keys each query may see.
  """
  m_M1, l_M1, acc = state
  if use_dot:  # MXU / tensor-core tiles
    qk = lambda q, k: jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.float32)
    pv = lambda p, v: jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
  else:  # too few query rows for tiles: broadcasts and sums
    qk = lambda q, k: jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)
    pv = lambda p, v: jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
  s_MS = sum(qk(q, k) for q, k in zip(q_parts, k_parts))
  if softcap is not None:
    s_MS = softcap * jnp.tanh(s_MS / softcap)
  s_MS = jnp.where(ok_MS, s_MS, _NEG)
  m_new = jnp.maximum(m_M1, s_MS.max(axis=-1, keepdims=True))
  p_MS = jnp.where(ok_MS, jnp.exp(s_MS - m_new), 0.0)
  alpha = jnp.exp(m_M1 - m_new)
  l_M1 = alpha * l_M1 + p_MS.sum(axis=-1, keepdims=True)
  acc = tuple(alpha * a + pv(p_MS, v) for a, v in zip(acc, v_parts))
  return m_new, l_M1, acc


def _scratch_init(m_scr, l_scr, acc_scr) -> None:
  """An online softmax's running max, sum and accumulators in VMEM scratch, before any key."""
  m_scr[...] = jnp.full(m_scr.shape, _NEG, jnp.float32)
  l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
  for a in acc_scr:
    a[...] = jnp.zeros(a.shape, jnp.float32)


def _scratch_step(scratch, q_parts, k_parts, v_parts, ok_MS, seen_S1, softcap) -> None:
  """One page's keys into the scratch state (`_online_step`); values of slots no query sees
  are zeroed first, so a stale NaN there adds nothing."""
  m_scr, l_scr, acc_scr = scratch
  v_parts = tuple(jnp.where(seen_S1, v, 0.0) for v in v_parts)
  state = (m_scr[...], l_scr[...], tuple(a[...] for a in acc_scr))
  m_M1, l_M1, acc = _online_step(state, q_parts, k_parts, v_parts, ok_MS, softcap=softcap,
                                 use_dot=True)
  m_scr[...], l_scr[...] = m_M1, l_M1
  for a_scr, a in zip(acc_scr, acc):
    a_scr[...] = a


def _visible(slot, q_pos, last, *, window, ring_span):
  """Whether the keys in `slot` (slot j*Y + s of a row's table) are visible to its query."""
  if ring_span:  # the newest position p <= last with p = slot (mod span)
    base = last - jax.lax.rem(last, ring_span)  # a scalar remainder; vectors only add/select
    pos = base + slot
    pos = jnp.where(pos > last, pos - ring_span, pos)
    ok = (pos >= 0) & (pos <= q_pos)
  else:
    pos = slot
    ok = pos <= q_pos
  if window is not None:
    ok &= q_pos - pos < window
  return ok


def _div(x: jax.Array, d: int) -> jax.Array:
  """x // d for non-negative int32 x: a shift when d is a power of two (vector units have no
  integer divide)."""
  if d & (d - 1) == 0:
    return jax.lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))
  return jax.lax.div(x, jnp.int32(d))


def _page_range(q_pos, *, page_size, width, window, ring_span):
  """[first, end) of the table entries a row's query can see."""
  if ring_span:
    return 0, width
  # lax.div on non-negative operands: floor division would lower through `sign`, which
  # Mosaic lowers per TPU generation.
  end = jnp.where(q_pos < 0, 0, jnp.minimum(jax.lax.div(jnp.maximum(q_pos, 0), page_size) + 1,
                                            width))
  first = 0 if window is None else jax.lax.div(jnp.maximum(q_pos - window + 1, 0), page_size)
  return jnp.minimum(first, end), end


def _split_refs(refs, nq, scaled):
  """(q refs, (k, k scale, v, v scale), the rest); scales None for float pools."""
  q_refs, refs = refs[:nq], refs[nq:]
  if scaled:
    return q_refs, refs[:4], refs[4:]
  return q_refs, (refs[0], None, refs[1], None), refs[2:]


def _triton_kernel(table_ref, qpos_ref, last_ref, *refs, nq, pps, scaled, cfg):
  """Rows x kv heads x splits; a loop over one split's pages of one row and kv head."""
  q_refs, (k_ref, ks_ref, v_ref, vs_ref), rest = _split_refs(refs, nq, scaled)
  acc_refs, (m_ref, l_ref) = rest[:nq], rest[nq:]
  b, kv, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_pos, last = qpos_ref[b], last_ref[b]
  first, end = _page_range(q_pos, **cfg['range'])
  lo = jnp.maximum(first, split * pps)
  hi = jnp.minimum(end, split * pps + pps)
  q_parts = tuple(r[...].astype(jnp.float32) for r in q_refs)
  g, p = q_parts[0].shape[0], cfg['page_size']

  def body(j, state):
    page = table_ref[b, j]
    scale = lambda r: None if r is None else r[page, :, kv, :]
    k_parts = _dequantized(k_ref[page, :, kv, :], scale(ks_ref), cfg['int4'])
    v_parts = _dequantized(v_ref[page, :, kv, :], scale(vs_ref), cfg['int4'])
    slot_1Y = j * p + jax.lax.broadcasted_iota(jnp.int32, (1, p), 1)
    ok_GY = jnp.broadcast_to(_visible(slot_1Y, q_pos, last, **cfg['mask']), (g, p))
    # Masks select: a slot the query cannot see adds 0, even if it holds a stale NaN.
    slot_Y1 = j * p + jax.lax.broadcasted_iota(jnp.int32, (p, 1), 0)
    seen_Y1 = _visible(slot_Y1, q_pos, last, **cfg['mask'])
    v_parts = tuple(jnp.where(seen_Y1, v, 0.0) for v in v_parts)
    return _online_step(state, q_parts, k_parts, v_parts, ok_GY, softcap=cfg['softcap'],
                        use_dot=False)
  init = (jnp.full((g, 1), _NEG, jnp.float32), jnp.zeros((g, 1), jnp.float32),
          tuple(jnp.zeros(q.shape, jnp.float32) for q in q_parts))
  m_G1, l_G1, acc = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
  for r, a in zip(acc_refs, acc):
    r[...] = a
  m_ref[...] = m_G1
  l_ref[...] = l_G1


def _mosaic_kernel(table_ref, qpos_ref, last_ref, *refs, nq, pps, kh, scaled, cfg):
  """Rows x splits x pages; each step one page of every kv head, as 2-D tiles.

  The page block is the pool's (Y, K, H) page viewed as (Y * K, H) (row s * K + k: slot s,
  kv head k), the queries (K * G, H) (row k * G + g); one dot scores every query against
  every key of the page and the mask keeps the pairs of one kv head.
  """
  q_refs, (k_ref, ks_ref, v_ref, vs_ref), rest = _split_refs(refs, nq, scaled)
  acc_refs, (m_ref, l_ref), scratch = rest[:nq], rest[nq:nq + 2], rest[nq + 2:]
  m_scr, l_scr, acc_scr = scratch[0], scratch[1], scratch[2:]
  b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  del table_ref  # the index maps chose the page blocks
  q_pos, last = qpos_ref[b], last_ref[b]
  first, end = _page_range(q_pos, **cfg['range'])
  j = split * pps + step

  @pl.when(step == 0)
  def _():
    _scratch_init(m_scr, l_scr, acc_scr)

  @pl.when((j >= first) & (j < end))
  def _():
    q_parts = tuple(r[...].astype(jnp.float32) for r in q_refs)
    scale = lambda r: None if r is None else r[...]
    k_parts = _dequantized(k_ref[...], scale(ks_ref), cfg['int4'])
    v_parts = _dequantized(v_ref[...], scale(vs_ref), cfg['int4'])
    rows, cols = q_parts[0].shape[0], k_parts[0].shape[0]
    col_1S = jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    slot_1S = j * cfg['page_size'] + _div(col_1S, kh)
    head_M1 = _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), rows // kh)
    ok_MS = ((head_M1 == col_1S - _div(col_1S, kh) * kh)
             & _visible(slot_1S, q_pos, last, **cfg['mask']))
    # Masks select: a slot the query cannot see adds 0, even if it holds a stale NaN.
    slot_S1 = j * cfg['page_size'] + _div(jax.lax.broadcasted_iota(jnp.int32, (cols, 1), 0), kh)
    seen_S1 = _visible(slot_S1, q_pos, last, **cfg['mask'])
    _scratch_step((m_scr, l_scr, acc_scr), q_parts, k_parts, v_parts, ok_MS, seen_S1,
                  cfg['softcap'])

  @pl.when(step == pps - 1)
  def _():
    for r, a in zip(acc_refs, acc_scr):
      r[...] = a[...]
    m_ref[...] = m_scr[...]
    l_ref[...] = l_scr[...]

def paged_attention(q_BNH: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, q_pos_B: jax.Array, last_B: jax.Array, *,
                    k_scales: Optional[jax.Array] = None, v_scales: Optional[jax.Array] = None,
                    int4: bool = False, ring: bool = False, window: Optional[int] = None,
                    logit_softcap: Optional[float] = None,
                    pages_per_split: Optional[int] = None, backend: str = 'triton',
                    interpret: bool = False) -> jax.Array:
  """One query per row attending over its pages (queries already scaled).

  Args:
    q_BNH: the rows' queries; N a multiple of K.
    k_pages: the key pool (num_pages, Y, K, Hs): floats, int8 or fp8 codes, or (int4) bytes
      of two packed codes each (Hs = H / 2).
    v_pages: the value pool, stored like the keys.
    page_table: int32 (B, pages per row): the pool page of each row's logical page j (or
      ring page j when `ring`).
    q_pos_B: each query's position (-1: a row with nothing to attend to; its output is 0).
    last_B: each row's newest cached position (locates a ring's positions).
    k_scales: (num_pages, Y, K, 1) scales of quantized keys (code * scale), or None.
    v_scales: the same for values.
    int4: the pools hold packed int4 codes.
    ring: the table is a ring of E pages holding the row's last E * Y positions.
    window: sliding window (keys with q_pos - window < pos <= q_pos), or None.
    logit_softcap: softcap of the attention logits, or None.
    pages_per_split: pages one program visits (split-K); default ~1024 keys.
    backend: 'triton' (GPU) or 'mosaic' (TPU) schedule (module docstring).
    interpret: run in Pallas interpret mode (any backend).

  Returns:
    out_BNH in q's dtype.
  """
  if backend not in BACKENDS:
    raise ValueError(f'paged_attention: backend={backend!r} is unknown; use one of {BACKENDS}.')
  b, n, h = q_BNH.shape
  _, p, kh, hs = k_pages.shape
  if n % kh or hs != (h // 2 if int4 else h) or v_pages.shape != k_pages.shape:
    raise ValueError(f'paged_attention: queries {q_BNH.shape} do not fit pools {k_pages.shape} '
                     f'/ {v_pages.shape} (int4={int4}: H / 2 bytes per head).')
  if (k_scales is None) != (v_scales is None):
    raise ValueError('paged_attention: give both k_scales and v_scales, or neither.')
  width = page_table.shape[1]
  pps = max(1, min(width, pages_per_split or max(1, 1024 // p)))
  splits = -(-width // pps)
  g = n // kh
  gp = g if backend == 'mosaic' else pl.next_power_of_2(g)
  q_BKGH = q_BNH.reshape(b, kh, g, h)
  if gp != g:  # Triton blocks are powers of two: zero query heads, dropped after
    q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  q_parts = (q_BKGH[..., 0::2], q_BKGH[..., 1::2]) if int4 else (q_BKGH,)
  nq, hp = len(q_parts), q_parts[0].shape[-1]
  scaled = k_scales is not None
  pools = (k_pages, k_scales, v_pages, v_scales) if scaled else (k_pages, v_pages)
  span = width * p if ring else 0
  cfg = dict(range=dict(page_size=p, width=width, window=window, ring_span=span),
             mask=dict(window=window, ring_span=span), page_size=p, softcap=logit_softcap,
             int4=int4)
  f32, sq = jnp.float32, pl.squeezed
  ints = (page_table.astype(jnp.int32), q_pos_B.astype(jnp.int32), last_B.astype(jnp.int32))
  if backend == 'triton':
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    whole = pl.no_block_spec
    kernel = functools.partial(_triton_kernel, nq=nq, pps=pps, scaled=scaled, cfg=cfg)
    outs = pl.pallas_call(
        kernel, grid=(b, kh, splits), interpret=interpret,
        out_shape=([jax.ShapeDtypeStruct((b, splits, kh, gp, hp), f32)] * nq
                   + [jax.ShapeDtypeStruct((b, splits, kh, gp, 1), f32)] * 2),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        in_specs=([whole] * 3
                  + [pl.BlockSpec((sq, sq, gp, hp), lambda i, k, s: (i, k, 0, 0))] * nq
                  + [whole] * len(pools)),
        out_specs=([pl.BlockSpec((sq, sq, sq, gp, hp), lambda i, k, s: (i, s, k, 0, 0))] * nq
                   + [pl.BlockSpec((sq, sq, sq, gp, 1), lambda i, k, s: (i, s, k, 0, 0))] * 2),
        name='qjax_paged_attention_triton')(*ints, *q_parts, *pools)
  else:
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
    rows = kh * g

    def page_of(i, s, j, table, qpos, last):
      del last
      first, end = _page_range(qpos[i], **cfg['range'])
      jj = jnp.clip(s * pps + j, first, jnp.maximum(end - 1, first))
      return table[i * width + jnp.clip(jj, 0, width - 1)]
    # A page (Y, K, Hs) seen as (Y * K, Hs): a free reshape, 2-D tiles in the kernel.
    flat = lambda x: x.reshape(x.shape[0], p * kh, x.shape[-1])
    pools = tuple(flat(x) for x in pools)
    page_spec = lambda x: pl.BlockSpec((sq, p * kh, x.shape[-1]),
                                       lambda i, s, j, *refs: (page_of(i, s, j, *refs), 0, 0))
    kernel = functools.partial(_mosaic_kernel, nq=nq, pps=pps, kh=kh, scaled=scaled, cfg=cfg)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, splits, pps),
        in_specs=([pl.BlockSpec((sq, rows, hp), lambda i, s, j, *_: (i, 0, 0))] * nq
                  + [page_spec(x) for x in pools]),
        out_specs=([pl.BlockSpec((sq, sq, rows, hp), lambda i, s, j, *_: (i, s, 0, 0))] * nq
                   + [pl.BlockSpec((sq, sq, rows, 1), lambda i, s, j, *_: (i, s, 0, 0))] * 2),
        scratch_shapes=([pltpu.VMEM((rows, 1), f32)] * 2 + [pltpu.VMEM((rows, hp), f32)] * nq))
    outs = pl.pallas_call(
        kernel, grid_spec=grid_spec, interpret=interpret,
        out_shape=([jax.ShapeDtypeStruct((b, splits, rows, hp), f32)] * nq
                   + [jax.ShapeDtypeStruct((b, splits, rows, 1), f32)] * 2),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=('parallel', 'parallel', 'arbitrary')),
        name='qjax_paged_attention_mosaic')(ints[0].reshape(-1), ints[1], ints[2],
                                            *(q.reshape(b, rows, hp) for q in q_parts),
                                            *pools)
    outs = [o.reshape(b, splits, kh, g, o.shape[-1]) for o in outs]
  # Per split (axis 1): running max, normaliser and weighted sums. Merge the splits by their
  # log-sum-exp; a split (or row) that saw no key has l = 0.
  acc, m_split, l_split = outs[:nq], outs[nq], outs[nq + 1]
  w_split = jnp.exp(m_split - m_split.max(axis=1, keepdims=True))
  l_BKG1 = jnp.sum(w_split * l_split, axis=1)
  parts = [jnp.sum(w_split * a, axis=1) for a in acc]
  out_BKGH = jnp.stack(parts, axis=-1).reshape(parts[0].shape[:3] + (h,)) if int4 else parts[0]
  out_BKGH = out_BKGH / jnp.where(l_BKG1 > 0, l_BKG1, 1.0)
  return out_BKGH[:, :, :g].reshape(b, n, h).astype(q_BNH.dtype)
