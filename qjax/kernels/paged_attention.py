"""Paged decode attention as a Pallas kernel: one query per row over its pages, quantized or not.

The cache is qjax's paged layout (`qjax.infer.PagedKVCache`): per layer a pool of pages
(num_pages, P, K, H) read through a per-row table of pool pages. Stored codes stay codes: an
int8, fp8 or packed int4 page (two codes per byte along H, low nibble first) is read from the
pool as bytes and dequantized inside the kernel, never as a float copy of the cache. The
per-token scales (shape (num_pages, P, K, 1)) are applied to the logits and to the softmax
weights, which is the same math as scaling the keys and values.

Each program handles one row's pages of one split (split-K: long rows are cut into
`pages_per_split` pieces that run in parallel) with FlashAttention's online softmax, and the
pieces are merged by their log-sum-exp afterwards. Only the pages a row's query can see are
visited (from its window's first page to its own page); a ring table (sliding-window layers)
holds R pages whose positions follow from the row's newest position.

Two schedules of the same per-page math (`_page_update`), by backend:
* 'triton' (GPU): grid (B, K, splits), a loop over pages inside, each page loaded from the
  pool by its table entry; products as broadcasts and sums (decode is bandwidth bound and G
  query heads per kv head are too few rows for tensor-core tiles).
* 'mosaic' (TPU): grid (B, splits, pages), the table prefetched to scalar memory and the pool
  block of each step chosen by it (Pallas pipelines the page copies); state in VMEM scratch;
  products as dots.
Both run in Pallas interpret mode on any backend (`interpret=True`), which is how the tests
check them on CPU against a float64 reference. This module imports nothing else from qjax.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BACKENDS = ('triton', 'mosaic')
# Past every real position: a slot that holds nothing.
_EMPTY = 2 ** 30
_NEG = -1e30


def _unpack_int4(b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Signed low and high nibbles of packed bytes, as float32 (codes 2i and 2i+1)."""
  b = b.astype(jnp.int32)
  lo = ((b & 0xF) ^ 8) - 8
  hi = (((b >> 4) & 0xF) ^ 8) - 8
  return lo.astype(jnp.float32), hi.astype(jnp.float32)


def _parts(x: jax.Array, int4: bool) -> tuple[jax.Array, ...]:
  """A page's values along H as float32 parts: (x,), or (even codes, odd codes) for int4."""
  return _unpack_int4(x) if int4 else (x.astype(jnp.float32),)


def _page_update(state, q_parts, k_page, k_scale, v_page, v_scale, pos_P, q_pos, *,
                 window, softcap, int4, use_dot):
  """One page of the online softmax for one kv head: state (m_G, l_G, acc parts (G, Hp)).

  q_parts: (G, Hp) query parts matching the page's parts; k_page/v_page: (P, Hs) codes or
  floats; k_scale/v_scale: (P,) or None; pos_P: (P,) key positions.
  """
  m_G, l_G, acc = state
  if use_dot:
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)
  else:
    dot = lambda a, b: jnp.sum(a[:, None, :] * b[None, :, :], axis=-1)
  s_GP = sum(dot(q, k) for q, k in zip(q_parts, _parts(k_page, int4)))
  if k_scale is not None:
    s_GP = s_GP * k_scale.astype(jnp.float32)[None, :]
  if softcap is not None:
    s_GP = softcap * jnp.tanh(s_GP / softcap)
  ok_P = pos_P <= q_pos
  if window is not None:
    ok_P &= q_pos - pos_P < window
  ok_GP = jnp.broadcast_to(ok_P[None, :], s_GP.shape)
  s_GP = jnp.where(ok_GP, s_GP, _NEG)
  m_new = jnp.maximum(m_G, s_GP.max(axis=-1))
  p_GP = jnp.where(ok_GP, jnp.exp(s_GP - m_new[:, None]), 0.0)
  alpha = jnp.exp(m_G - m_new)
  l_G = alpha * l_G + p_GP.sum(axis=-1)
  if v_scale is not None:
    p_GP = p_GP * v_scale.astype(jnp.float32)[None, :]
  if use_dot:
    pv = lambda v: jax.lax.dot_general(p_GP, v, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
  else:
    pv = lambda v: jnp.sum(p_GP[:, :, None] * v[None, :, :], axis=1)
  acc = tuple(alpha[:, None] * a + pv(v) for a, v in zip(acc, _parts(v_page, int4)))
  return m_new, l_G, acc


def _positions(j, last, *, page_size, ring_span):
  """Key positions (P,) of logical page j (block table), or of ring page j (ring_span > 0)."""
  slot_P = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (page_size,), 0)
  if not ring_span:
    return slot_P
  back_P = jax.lax.rem(last - slot_P, ring_span)  # the newest p <= last with p = slot (mod span)
  pos_P = last - jnp.where(back_P < 0, back_P + ring_span, back_P)
  return jnp.where(pos_P >= 0, pos_P, _EMPTY)


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
  q_refs, (k_ref, ks_ref, v_ref, vs_ref), rest = _split_refs(refs, nq, scaled)
  acc_refs, (m_ref, l_ref) = rest[:nq], rest[nq:]
  b, kv, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_pos, last = qpos_ref[b], last_ref[b]
  first, end = _page_range(q_pos, **cfg['range'])
  lo = jnp.maximum(first, split * pps)
  hi = jnp.minimum(end, split * pps + pps)
  q_parts = tuple(r[...].astype(jnp.float32) for r in q_refs)
  g = q_parts[0].shape[0]

  def body(j, state):
    page = table_ref[b, j]
    ks = None if ks_ref is None else ks_ref[page, :, kv, 0]
    vs = None if vs_ref is None else vs_ref[page, :, kv, 0]
    pos_P = _positions(j, last, **cfg['pos'])
    return _page_update(state, q_parts, k_ref[page, :, kv, :], ks, v_ref[page, :, kv, :], vs,
                        pos_P, q_pos, use_dot=False, **cfg['math'])
  init = (jnp.full((g,), _NEG, jnp.float32), jnp.zeros((g,), jnp.float32),
          tuple(jnp.zeros(q.shape, jnp.float32) for q in q_parts))
  m_G, l_G, acc = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
  for r, a in zip(acc_refs, acc):
    r[...] = a
  m_ref[...] = m_G
  l_ref[...] = l_G


def _mosaic_kernel(table_ref, qpos_ref, last_ref, *refs, nq, pps, kh, width, scaled, cfg):
  q_refs, (k_ref, ks_ref, v_ref, vs_ref), rest = _split_refs(refs, nq, scaled)
  acc_refs, (m_ref, l_ref), scratch = rest[:nq], rest[nq:nq + 2], rest[nq + 2:]
  m_scr, l_scr, acc_scr = scratch[0], scratch[1], scratch[2:]
  b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  del table_ref, width  # the pool blocks were chosen by the index maps
  q_pos, last = qpos_ref[b], last_ref[b]
  first, end = _page_range(q_pos, **cfg['range'])
  j = split * pps + step

  @pl.when(step == 0)
  def _():
    m_scr[...] = jnp.full(m_scr.shape, _NEG, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    for a in acc_scr:
      a[...] = jnp.zeros(a.shape, jnp.float32)

  @pl.when((j >= first) & (j < end))
  def _():
    pos_P = _positions(j, last, **cfg['pos'])
    for h in range(kh):
      q_parts = tuple(r[h].astype(jnp.float32) for r in q_refs)
      ks = None if ks_ref is None else ks_ref[:, h, 0]
      vs = None if vs_ref is None else vs_ref[:, h, 0]
      state = (m_scr[h], l_scr[h], tuple(a[h] for a in acc_scr))
      m_G, l_G, acc = _page_update(state, q_parts, k_ref[:, h, :], ks, v_ref[:, h, :], vs,
                                   pos_P, q_pos, use_dot=True, **cfg['math'])
      m_scr[h], l_scr[h] = m_G, l_G
      for a_scr, a in zip(acc_scr, acc):
        a_scr[h] = a

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
    k_pages: the key pool (num_pages, P, K, Hs): floats, int8 or fp8 codes, or (int4) bytes
      of two packed codes each (Hs = H / 2).
    v_pages: the value pool, stored like the keys.
    page_table: int32 (B, pages per row): the pool page of each row's logical page j (or
      ring page j when `ring`).
    q_pos_B: each query's position (-1: a row with nothing to attend to; its output is 0).
    last_B: each row's newest cached position (locates a ring's positions).
    k_scales: (num_pages, P, K, 1) scales of quantized keys (code * scale), or None.
    v_scales: the same for values.
    int4: the pools hold packed int4 codes.
    ring: the table is a ring of R pages holding the row's last R * P positions.
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
             pos=dict(page_size=p, ring_span=span),
             math=dict(window=window, softcap=logit_softcap, int4=int4))
  f32 = jnp.float32
  out_shape = ([jax.ShapeDtypeStruct((b, splits, kh, gp, hp), f32)] * nq
               + [jax.ShapeDtypeStruct((b, splits, kh, gp), f32)] * 2)
  sq = pl.squeezed
  ints = (page_table.astype(jnp.int32), q_pos_B.astype(jnp.int32), last_B.astype(jnp.int32))
  if backend == 'triton':
    whole = pl.no_block_spec
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    kernel = functools.partial(_triton_kernel, nq=nq, pps=pps, scaled=scaled, cfg=cfg)
    outs = pl.pallas_call(
        kernel, grid=(b, kh, splits), out_shape=out_shape, interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        in_specs=([whole] * 3
                  + [pl.BlockSpec((sq, sq, gp, hp), lambda i, k, s: (i, k, 0, 0))] * nq
                  + [whole] * len(pools)),
        out_specs=([pl.BlockSpec((sq, sq, sq, gp, hp), lambda i, k, s: (i, s, k, 0, 0))] * nq
                   + [pl.BlockSpec((sq, sq, sq, gp), lambda i, k, s: (i, s, k, 0))] * 2),
        name='qjax_paged_attention_triton')(*ints, *q_parts, *pools)
  else:
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

    def page_of(i, s, j, table, qpos, last):
      del last
      first, end = _page_range(qpos[i], **cfg['range'])
      jj = jnp.clip(s * pps + j, first, jnp.maximum(end - 1, first))
      return table[i * width + jnp.clip(jj, 0, width - 1)]
    page_spec = lambda last_dim: pl.BlockSpec(
        (sq, p, kh, last_dim), lambda i, s, j, *refs: (page_of(i, s, j, *refs), 0, 0, 0))
    pool_specs = [page_spec(hs), page_spec(1), page_spec(hs), page_spec(1)]
    if not scaled:
      pool_specs = pool_specs[::2]
    kernel = functools.partial(_mosaic_kernel, nq=nq, pps=pps, kh=kh, width=width,
                               scaled=scaled, cfg=cfg)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, splits, pps),
        in_specs=([pl.BlockSpec((sq, kh, gp, hp), lambda i, s, j, *_: (i, 0, 0, 0))] * nq
                  + pool_specs),
        out_specs=([pl.BlockSpec((sq, sq, kh, gp, hp), lambda i, s, j, *_: (i, s, 0, 0, 0))]
                   * nq + [pl.BlockSpec((sq, sq, kh, gp), lambda i, s, j, *_: (i, s, 0, 0))] * 2),
        scratch_shapes=([pltpu.VMEM((kh, gp), f32)] * 2 + [pltpu.VMEM((kh, gp, hp), f32)] * nq))
    outs = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=('parallel', 'parallel', 'arbitrary')),
        name='qjax_paged_attention_mosaic')(ints[0].reshape(-1), ints[1], ints[2], *q_parts,
                                            *pools)
  # Per split (axis 1): running max, normaliser and weighted sums. Merge the splits by their
  # log-sum-exp; a split (or row) that saw no key has l = 0.
  acc, m_split, l_split = outs[:nq], outs[nq], outs[nq + 1]
  w_split = jnp.exp(m_split - m_split.max(axis=1, keepdims=True))
  l_BKG = jnp.sum(w_split * l_split, axis=1)
  parts = [jnp.sum(w_split[..., None] * a, axis=1) for a in acc]
  out_BKGH = jnp.stack(parts, axis=-1).reshape(b, kh, gp, h) if int4 else parts[0]
  out_BKGH = out_BKGH / jnp.where(l_BKG > 0, l_BKG, 1.0)[..., None]
  return out_BKGH[:, :, :g].reshape(b, n, h).astype(q_BNH.dtype)
