"""Ragged paged attention as one Mosaic (TPU) kernel: every row of a step, whatever its
number of queries, over its own pages, quantized or not.

A serving step mixes prompt chunks (several queries per row) and decodes (one query per
row). This kernel attends all of them in one `pallas_call`: rows x query blocks x pages,
each query block `block_q` consecutive queries of one row (a row with fewer queries leaves
the rest of its block empty, and a block with none skips its pages). Each step scores one
page of every kv head against the block's queries of every head, with FlashAttention's online
softmax in VMEM scratch, and the causal mask inside a chunk follows from each query's own
position, so a chunk's queries see each other's keys through the pages.

The pools are read as `qjax.infer.PagedKVCache` stores them (the layout of
`qjax.kernels.paged_attention`): (num_pages, Y, K, Hs) floats, int8 or fp8 codes, or packed
int4 bytes, with a scale per token and kv head (num_pages, Y, K, 1) that multiplies the page
in VMEM after its load, never a float copy of the pool. Sliding windows, rings of pages
(sliding-window layers) and logit softcaps mask and score as the decode kernel does (its
per-page update, `_online_step`, is shared).

Why not `jax.experimental.pallas.ops.tpu.ragged_paged_attention`: it reads one pool of keys
and values interleaved along the head axis (num_pages, Y, 2K, H) with one scalar scale for all
keys and one for all values, and has no ring of pages; qjax stores separate K and V pools with
a scale per token and head (what keeps a page write from changing earlier tokens' values), so
using it would need a re-laid and dequantized copy of every pool each step.

The block layout: a page (Y, K, Hs) is one 2-D tile (Y * K, Hs), row s * K + k (slot s, kv
head k); a query block is (K * Tq * G, Hs), row k * Tq * G + t * G + g (kv head k, query t of
the block, head g of the group). One dot scores every query against every key of the page;
a mask keeps each query's own kv head (K times the flops of per-head dots, for tiles without
strided slices, as in the decode kernel) and its visible positions. The head of each query
row and key column is given to the kernel as small int32 vectors (vector units have no
integer divide). Runs in Pallas interpret mode on any backend (`interpret=True`), which is
how the tests check it on CPU against a float64 reference.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qjax.kernels import paged_attention as pa

# The decode kernel's per-page pieces (dequantize, visibility, the scratch state and one
# online-softmax step into it), shared so both kernels score, mask and accumulate alike.
# pylint: disable=protected-access
_dequantized, _scratch_init, _scratch_step, _split_refs, _visible = (
    pa._dequantized, pa._scratch_init, pa._scratch_step, pa._split_refs, pa._visible)
# pylint: enable=protected-access
# Query rows (queries x heads) one block aims at: an MXU-sized tile of scores per page.
ROWS_PER_BLOCK = 256


def default_block_q(t: int, n: int) -> int:
  """Queries per block for T queries per row and N query heads (~ROWS_PER_BLOCK rows)."""
  return max(1, min(t, ROWS_PER_BLOCK // n))


def _block_pages(lo, hi, *, page_size, width, window, ring_span):
  """[first, end) of the table entries a block's queries (positions lo..hi) can see."""
  if ring_span:
    return 0, jnp.where(lo < 0, 0, width)
  # lax.div on non-negative operands (floor division lowers through `sign`).
  end = jnp.where(hi < 0, 0, jnp.minimum(jax.lax.div(jnp.maximum(hi, 0), page_size) + 1,
                                         width))
  first = 0 if window is None else jax.lax.div(jnp.maximum(lo - window + 1, 0), page_size)
  return jnp.minimum(first, end), end


def _kernel(table_ref, lo_ref, hi_ref, last_ref, pos_ref, head_ref, col_ref, key_ref, *refs,
            nq, nqb, scaled, cfg):
  """Rows x query blocks x pages; each step one page of every kv head against one block."""
  q_refs, (k_ref, ks_ref, v_ref, vs_ref), rest = _split_refs(refs, nq, scaled)
  out_refs, scratch = rest[:nq], rest[nq:]
  m_scr, l_scr, acc_scr = scratch[0], scratch[1], scratch[2:]
  b, qb, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  del table_ref  # the index maps chose the page blocks
  blk = b * nqb + qb
  lo, hi, last = lo_ref[blk], hi_ref[blk], last_ref[b]
  first, end = _block_pages(lo, hi, **cfg['range'])
  p, mask = cfg['page_size'], cfg['mask']

  @pl.when(j == 0)
  def _():
    _scratch_init(m_scr, l_scr, acc_scr)

  @pl.when((lo >= 0) & (j >= first) & (j < end))
  def _():
    q_parts = tuple(r[...].astype(jnp.float32) for r in q_refs)
    scale = lambda r: None if r is None else r[...]
    k_parts = _dequantized(k_ref[...], scale(ks_ref), cfg['int4'])
    v_parts = _dequantized(v_ref[...], scale(vs_ref), cfg['int4'])
    slot_1S = j * p + col_ref[1:2, :]
    ok_MS = (head_ref[...] == col_ref[0:1, :]) & _visible(slot_1S, pos_ref[...], last, **mask)
    # Masks select: a slot no query of the block sees adds 0, even if it holds a stale NaN.
    window = mask['window']
    seen_S1 = _visible(j * p + key_ref[...], hi, last, ring_span=mask['ring_span'],
                       window=None if window is None else hi - lo + window)
    _scratch_step((m_scr, l_scr, acc_scr), q_parts, k_parts, v_parts, ok_MS, seen_S1,
                  cfg['softcap'])

  @pl.when(j == cfg['range']['width'] - 1)
  def _():
    l_M1 = l_scr[...]
    inv_M1 = 1.0 / jnp.where(l_M1 > 0, l_M1, 1.0)  # a query that saw no key: 0
    for r, a in zip(out_refs, acc_scr):
      r[...] = (a[...] * inv_M1).astype(r.dtype)


def ragged_paged_attention(q_BTNH: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, q_pos_BT: jax.Array, last_B: jax.Array, *,
                           k_scales: Optional[jax.Array] = None,
                           v_scales: Optional[jax.Array] = None, int4: bool = False,
                           ring: bool = False, window: Optional[int] = None,
                           logit_softcap: Optional[float] = None,
                           block_q: Optional[int] = None,
                           interpret: bool = False) -> jax.Array:
  """Each row's queries attending over its pages, causally (queries already scaled).

  Args:
    q_BTNH: up to T queries per row; N a multiple of K.
    k_pages: the key pool (num_pages, Y, K, Hs): floats, int8 or fp8 codes, or (int4) bytes
      of two packed codes each (Hs = H / 2).
    v_pages: the value pool, stored like the keys.
    page_table: int32 (B, pages per row): the pool page of each row's logical page j (or
      ring page j when `ring`).
    q_pos_BT: each query's position (-1: no query there; its output is 0). A key at position
      p is visible to a query at q when p <= q (and q - p < window).
    last_B: each row's newest cached position (locates a ring's positions).
    k_scales: (num_pages, Y, K, 1) scales of quantized keys (code * scale), or None.
    v_scales: the same for values.
    int4: the pools hold packed int4 codes.
    ring: the table is a ring of E pages holding the row's last E * Y positions.
    window: sliding window, or None.
    logit_softcap: softcap of the attention logits, or None.
    block_q: queries per block (default `default_block_q`).
    interpret: run in Pallas interpret mode (any backend).

  Returns:
    out_BTNH in q's dtype.

  Raises:
    ValueError: shapes that do not fit each other, or scales given for one pool only.
  """
  b, t, n, h = q_BTNH.shape
  _, p, kh, hs = k_pages.shape
  if n % kh or hs != (h // 2 if int4 else h) or v_pages.shape != k_pages.shape:
    raise ValueError(f'ragged_paged_attention: queries {q_BTNH.shape} do not fit pools '
                     f'{k_pages.shape} / {v_pages.shape} (int4={int4}: H / 2 bytes per head).')
  if q_pos_BT.shape != (b, t) or last_B.shape != (b,) or page_table.shape[0] != b:
    raise ValueError(f'ragged_paged_attention: q_pos_BT {q_pos_BT.shape}, last_B '
                     f'{last_B.shape} and page_table {page_table.shape} must have the '
                     f'queries\' rows {b} (and q_pos_BT their {t} queries).')
  if (k_scales is None) != (v_scales is None):
    raise ValueError('ragged_paged_attention: give both k_scales and v_scales, or neither.')
  tq = default_block_q(t, n) if block_q is None else block_q
  if not isinstance(tq, int) or tq < 1:
    raise ValueError(f'ragged_paged_attention: block_q={block_q!r}; use a positive integer.')
  g, width = n // kh, page_table.shape[1]
  nqb = -(-t // tq)
  rows, cols = kh * tq * g, p * kh
  pad = nqb * tq - t
  q_BTNH = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0)))
  pos_BJT = jnp.pad(q_pos_BT.astype(jnp.int32), ((0, 0), (0, pad)),
                    constant_values=-1).reshape(b, nqb, tq)
  real = pos_BJT >= 0
  lo = jnp.where(real, pos_BJT, jnp.iinfo(jnp.int32).max).min(-1)
  lo = jnp.where(real.any(-1), lo, -1).reshape(-1)  # -1: an empty block
  hi = jnp.where(real, pos_BJT, -1).max(-1).reshape(-1)
  # (B, J * Tq, K * G, H) -> (B * J, K * Tq * G, H): a block's rows, kv head first.
  blocks = lambda x: x.reshape(b, nqb, tq, kh, g, x.shape[-1]).transpose(
      0, 1, 3, 2, 4, 5).reshape(b * nqb, rows, x.shape[-1])
  q_parts = (q_BTNH[..., 0::2], q_BTNH[..., 1::2]) if int4 else (q_BTNH,)
  q_parts = tuple(blocks(x) for x in q_parts)
  nq, hp = len(q_parts), q_parts[0].shape[-1]
  pos_rows = blocks(jnp.broadcast_to(pos_BJT[..., None, None, None], (b, nqb, tq, kh, g, 1)))
  head_M1 = (jnp.arange(rows, dtype=jnp.int32) // (tq * g))[:, None]
  col_S = jnp.arange(cols, dtype=jnp.int32)
  col_2S = jnp.stack([col_S % kh, col_S // kh])  # each key column's kv head and slot
  key_S1 = (col_S // kh)[:, None]
  scaled = k_scales is not None
  pools = (k_pages, k_scales, v_pages, v_scales) if scaled else (k_pages, v_pages)
  # A page (Y, K, Hs) seen as (Y * K, Hs): a free reshape, 2-D tiles in the kernel.
  pools = tuple(x.reshape(x.shape[0], cols, x.shape[-1]) for x in pools)
  span = width * p if ring else 0
  cfg = dict(range=dict(page_size=p, width=width, window=window, ring_span=span),
             mask=dict(window=window, ring_span=span), page_size=p, softcap=logit_softcap,
             int4=int4)

  def page_of(i, qb, j, table, lo, hi, last):
    del last
    blk = i * nqb + qb
    first, end = _block_pages(lo[blk], hi[blk], **cfg['range'])
    # Past the block's pages the index stays put, so Pallas copies no page.
    jj = jnp.clip(j, first, jnp.maximum(end - 1, first))
    return table[i * width + jnp.clip(jj, 0, width - 1)]
  sq, f32 = pl.squeezed, jnp.float32
  block = lambda last_dim: pl.BlockSpec((sq, rows, last_dim),
                                        lambda i, qb, j, *_: (i * nqb + qb, 0, 0))
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, qb, j, *_: (0,) * x.ndim)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4, grid=(b, nqb, width),
      in_specs=([block(1), whole(head_M1), whole(col_2S), whole(key_S1)] + [block(hp)] * nq
                + [pl.BlockSpec((sq, cols, x.shape[-1]),
                                lambda i, qb, j, *refs: (page_of(i, qb, j, *refs), 0, 0))
                   for x in pools]),
      out_specs=[block(hp)] * nq,
      scratch_shapes=([pltpu.VMEM((rows, 1), f32)] * 2 + [pltpu.VMEM((rows, hp), f32)] * nq))
  kernel = functools.partial(_kernel, nq=nq, nqb=nqb, scaled=scaled, cfg=cfg)
  outs = pl.pallas_call(
      kernel, grid_spec=grid_spec, interpret=interpret,
      out_shape=[jax.ShapeDtypeStruct((b * nqb, rows, hp), q_BTNH.dtype)] * nq,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      name='qjax_ragged_paged_attention_mosaic')(
          page_table.astype(jnp.int32).reshape(-1), lo, hi, last_B.astype(jnp.int32),
          pos_rows, head_M1, col_2S, key_S1, *q_parts, *pools)
  # (B * J, K * Tq * G, Hp) -> (B, J * Tq, N, Hp), the padding queries dropped.
  unblock = lambda x: x.reshape(b, nqb, kh, tq, g, hp).transpose(0, 1, 3, 2, 4, 5).reshape(
      b, nqb * tq, n, hp)[:, :t]
  parts = [unblock(o) for o in outs]
  return jnp.stack(parts, axis=-1).reshape(b, t, n, h) if int4 else parts[0]
