"""A paged KV cache (PagedAttention, Kwon et al. 2023): shared page pools and page tables.

Storage: per layer one pool k/v of shape (num_pages, Y, K, H) (Y = page_size), float or a
`QArray` in any KV format qjax has (`qjax.nn.kvcache.KV_FORMATS`: int8, int4, fp8, ...; the
pool's scales are per (page, slot, kv head), i.e. per token and head, so a page write never
changes what earlier tokens decode to). Row b of a step reads its pages through
`page_table[b]`: logical page j (positions j*Y .. j*Y+Y-1) is pool page `page_table[b, j]`.
A page table is (B, E): E entries (pool pages) per row.

Sliding-window layers (with `ring=True`) keep a ring of E pages per row instead
(`ring_table[b]`, from pools of their own): position p lives in ring page (p // Y) % E, so a
row holds only its last E*Y positions, which must cover the window plus one step's new
tokens (`ring_pages_needed`).

Page 0 of every pool is a sink: padded tokens (rows with fewer new tokens than the step's T,
or idle rows) write there, and unassigned table entries point there; both sit at positions
after every query of their row, so the causal mask hides them. The allocator never hands
page 0 out.

`PagedKVCache` is the device half (a frozen pytree, jittable; `Attention` writes to it and
attends over it through its `write`/`attend` methods, the protocol `qjax.nn.kvcache`
documents). `PageAllocator` is the host half: free pages, reference counts (prefix sharing).
`forward` runs a model against the cache; `shard_pools` splits the pools over a device mesh
by a layout's rules (`POOL_AXES`). The host side (`PageAllocator`, `check_step`, the swap
copies `read_pages` / `write_pages`) lives in `qjax.infer.page_host`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.core import QArray, QFormat, dequantize, quantize
from qjax.infer import paged_kernel
from qjax.nn import kvcache
from qjax.nn.attention import EMPTY_POSITION, online_attend
from qjax.nn import axes as ax
from qjax.nn.config import TransformerConfig

SINK_PAGE = 0
# Keys per online-softmax block of paged attention (whole pages, so a multiple of the page
# size when it divides): one page per block spends a CPU step in tiny per-page matmuls.
KEYS_PER_BLOCK = 256

# Logical axes of a pool (num_pages, Y, K, H). Pages are the cache's (batch x length) slots
# cut into pieces, so the page axis follows the cache batch rule; slots the cache length,
# K and H the cache's kv-head and head-dim rules (`qjax.nn.axes.KV_CACHE_AXES`).
POOL_AXES = (ax.CACHE_BATCH, ax.CACHE_LENGTH, ax.ACT_KV_HEADS, ax.HEAD_DIM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Page pools, per-row page tables and lengths of one step.

  Attributes:
    k: per layer, the key pool (num_pages, Y, K, H) (after RoPE), an array or a QArray.
    v: per layer, the value pool.
    page_table: int32 (B, E = max_pages): pool pages of each row, logical page order.
    ring_table: int32 (B, E = ring pages): ring pages of each row for ring layers ((B, 0)
      when none).
    length: int32 (B,): positions already cached per row (this step writes from there).
    num_new: int32 (B,): tokens row b writes this step (<= T; the rest of the row is padding).
    qformat: the QFormat quantized pools store (static), or None for float pools.
    page_size: Y (static).
    ring: per layer, whether it uses the ring table (static).
    seq_of: None (row b's tokens are row b of tokens_BT), or a packed step's tokens
      (tokens (M, 1), M >= sum(num_new)): int32 (M,), the row (sequence) of each token. The
      rows' tokens lie one after another in row order, padding tokens at the end; the tables,
      `length` and `num_new` are then per row, and attention regroups the tokens by row
      (`attend`).
    slot_of: int32 (M,): each token's place among its row's new tokens (a padding token:
      att_width, so it is never written).
    att_width: T of the (C, T) layout, the most tokens a row feeds in the step (static;
      with seq_of).
    att_wide: C, the most rows that feed more than one token (static; with seq_of).
  """

  k: tuple[Union[jax.Array, QArray], ...]
  v: tuple[Union[jax.Array, QArray], ...]
  page_table: jax.Array
  ring_table: jax.Array
  length: jax.Array
  num_new: jax.Array
  qformat: Optional[QFormat] = dataclasses.field(default=None, metadata=dict(static=True))
  page_size: int = dataclasses.field(default=16, metadata=dict(static=True))
  ring: tuple[bool, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  seq_of: Optional[jax.Array] = None
  slot_of: Optional[jax.Array] = None
  att_width: int = dataclasses.field(default=0, metadata=dict(static=True))
  att_wide: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def format(self) -> str:
    if self.qformat is None:
      return jnp.dtype(self.k[0].dtype).name
    return self.qformat.name

  @property
  def max_pages(self) -> int:
    return int(self.page_table.shape[1])

  def _valid_BT(self, positions_BT: jax.Array) -> jax.Array:
    """Whether each new token is real (not padding)."""
    if self.seq_of is not None:
      return (self.slot_of < self.num_new[self.seq_of])[:, None]
    return jnp.arange(positions_BT.shape[1])[None] < self.num_new[:, None]

  def positions(self, t: int) -> jax.Array:
    """positions_BT of this step's new tokens (T = t): `length[b] + 0..T-1` per row, or for
    a packed step each token's row length plus its slot."""
    if self.seq_of is not None:
      return (self.length[self.seq_of] + self.slot_of)[:, None]
    return self.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

  def _pages_BT(self, layer: int, positions_BT: jax.Array) -> jax.Array:
    """Pool page of every (row, new token); padding tokens go to the sink page."""
    logical_BT = positions_BT // self.page_size
    if self.ring[layer]:
      table, logical_BT = self.ring_table, logical_BT % self.ring_table.shape[1]
    else:
      table = self.page_table
      logical_BT = jnp.minimum(logical_BT, table.shape[1] - 1)
    if self.seq_of is not None:
      table = table[self.seq_of]  # each token's row's table
    pages_BT = jnp.take_along_axis(table, logical_BT, axis=1)
    return jnp.where(self._valid_BT(positions_BT), pages_BT, SINK_PAGE)

  def write(self, layer: int, k_BTKH: jax.Array, v_BTKH: jax.Array,
            positions_BT: jax.Array) -> 'PagedKVCache':
    """The cache with this step's keys/values of `layer` in their pages (padding to the sink).

    Args:
      layer: the layer.
      k_BTKH: new keys (after RoPE), T >= max(num_new) (a packed step: (M, 1)).
      v_BTKH: new values.
      positions_BT: their positions (`positions`).

    Returns:
      The updated cache (the other layers' pools are the same arrays).
    """
    pages_BT = self._pages_BT(layer, positions_BT)
    offsets_BT = jnp.where(self._valid_BT(positions_BT), positions_BT % self.page_size, 0)

    def put(pools, new):
      old = pools[layer]
      if isinstance(old, QArray):  # quantize per token and head, then scatter codes + scales
        new = quantize(new.astype(old.dtype), self.qformat)
        upd = jax.tree.map(lambda o, n: o.at[pages_BT, offsets_BT].set(n.astype(o.dtype)),
                           old, new)
      else:
        upd = old.at[pages_BT, offsets_BT].set(new.astype(old.dtype))
      return pools[:layer] + (upd,) + pools[layer + 1:]
    return dataclasses.replace(self, k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

  def attend(self, layer: int, q_BTNH: jax.Array, positions_BT: jax.Array, *,
             window: Optional[int] = None,
             logit_softcap: Optional[float] = None) -> jax.Array:
    """Attention of this step's queries over `layer`'s pages, in blocks of whole pages.

    Args:
      layer: the layer (its pages were written by `write` this step).
      q_BTNH: queries (scaled, after RoPE).
      positions_BT: their positions.
      window: sliding window, or None.
      logit_softcap: attention logit softcap, or None.

    Returns:
      out_BTNH; each block's pages are gathered and dequantized as it is reached. In a packed
      step (`seq_of`) the tokens are regrouped by row first, so a page is fetched once per
      row, not once per token: rows feeding one token attend as a (B, 1) layout, rows
      feeding more (at most `att_wide`) as a (C, T) = (att_wide, att_width) one, and the outputs are
      gathered back. The weights see only the packed tokens, and attention computes no
      chunk-wide row for a decode (such a row costs as much whatever tokens it holds).
      Where `paged_kernel.attention_form` picks the ragged kernel for the step's widest row
      (a TPU), every row, decodes and chunks, attends in that one kernel call instead.
    """
    table = self.ring_table if self.ring[layer] else self.page_table
    last_B = self.length + self.num_new - 1  # newest position each row holds
    if self.seq_of is None:
      return self._attend_rows(layer, q_BTNH, positions_BT, table, last_B, window=window,
                               logit_softcap=logit_softcap)
    attend_rows = functools.partial(self._attend_rows, layer, window=window,
                                    logit_softcap=logit_softcap)
    n, w, c, b = q_BTNH.shape[0], self.att_width, self.att_wide, table.shape[0]
    form = paged_kernel.attention_form(self.k[layer], w) if c else None
    if form is not None and form.kernel == 'ragged':  # every row in one kernel call
      return paged_kernel.attend_packed(
          form, self.k[layer], self.v[layer], q_BTNH, table, self.length, self.num_new,
          self.seq_of, self.slot_of, w, ring=self.ring[layer], window=window,
          logit_softcap=logit_softcap)
    q_MNH = jnp.concatenate([q_BTNH[:, 0], jnp.zeros_like(q_BTNH[:1, 0])])  # n: empty slot
    start_B = jnp.cumsum(self.num_new) - self.num_new  # row b's first token
    one_B = self.num_new == 1
    out_B1NH = attend_rows(q_MNH[jnp.where(one_B, start_B, n)][:, None],
                           jnp.where(one_B, self.length, -1)[:, None], table, last_B)
    seq_M = self.seq_of
    if not c:
      return jnp.take(out_B1NH, seq_M, axis=0)
    wide_C = jnp.nonzero(self.num_new > 1, size=c, fill_value=b)[0]  # b: an empty row
    pick = lambda x: jnp.concatenate([x, jnp.zeros_like(x[:1])])[wide_C]
    slot_T = jnp.arange(w, dtype=jnp.int32)
    new_CT = slot_T[None] < pick(self.num_new)[:, None]
    src_CT = jnp.where(new_CT, pick(start_B)[:, None] + slot_T[None], n)
    pos_CT = jnp.where(new_CT, pick(self.length)[:, None] + slot_T[None], -1)  # -1: no keys
    out_CTNH = attend_rows(q_MNH[src_CT], pos_CT, pick(table), pick(last_B))
    wide_at_B = jnp.cumsum(self.num_new > 1) - 1  # a row's place among the wide ones
    at_M = jnp.where(one_B[seq_M], seq_M, b + wide_at_B[seq_M] * w + self.slot_of)
    flat = jnp.concatenate([out_B1NH[:, 0], out_CTNH.reshape((c * w,) + out_CTNH.shape[2:])])
    return jnp.take(flat, at_M, axis=0, mode='clip')[:, None]

  def _attend_rows(self, layer, q_BTNH, positions_BT, table, last_B, *, window,
                   logit_softcap):
    """`attend` of rows that each read their own `table` row (ring or page table): the
    kernel `paged_kernel.attention_form` picks (the paged one for one query per row, the
    ragged one for more), else an online softmax over blocks of about KEYS_PER_BLOCK keys
    (whole pages)."""
    pool_k, pool_v, p = self.k[layer], self.v[layer], self.page_size
    form = paged_kernel.attention_form(pool_k, q_BTNH.shape[1])
    if form.name != 'scan':
      return paged_kernel.attend(form, pool_k, pool_v, q_BTNH, positions_BT, table, last_B,
                                 ring=self.ring[layer], window=window,
                                 logit_softcap=logit_softcap)
    b, width = table.shape
    e = max(1, min(width, KEYS_PER_BLOCK // p))  # E: table entries (pages) per key block
    nb = -(-width // e)
    table_JBE = jnp.pad(table, ((0, 0), (0, nb * e - width))).reshape(b, nb, e).swapaxes(0, 1)
    offsets_S = jnp.arange(e * p, dtype=jnp.int32)
    if self.ring[layer]:
      span = width * p

      def positions_of(j):  # the newest position p <= last with p % span == slot
        slot_S = j * e * p + offsets_S
        pos_BS = last_B[:, None] - (last_B[:, None] - slot_S[None]) % span
        return jnp.where((pos_BS >= 0) & (slot_S < span)[None], pos_BS, EMPTY_POSITION)
    else:  # padding pages past the table are the sink, at positions past every query
      positions_of = lambda j: (j * e * p + offsets_S)[None]

    def fetch(block):
      pages_BE, j = block
      k_BEYKH, v_BEYKH = pool_k[pages_BE], pool_v[pages_BE]
      if isinstance(k_BEYKH, QArray):
        k_BEYKH, v_BEYKH = dequantize(k_BEYKH), dequantize(v_BEYKH)
      merge = lambda x: x.reshape((b, e * p) + x.shape[3:])
      return merge(k_BEYKH), merge(v_BEYKH), positions_of(j)
    blocks = (table_JBE, jnp.arange(nb, dtype=jnp.int32))
    return online_attend(q_BTNH, blocks, fetch, positions_BT, window=window,
                         logit_softcap=logit_softcap)


def shard_pools(cache: PagedKVCache, rules, mesh) -> PagedKVCache:
  """`cache` with every pool placed on `mesh` as `rules` (a `qjax.sharding.Rules`) lay out
  `POOL_AXES`; tables and lengths replicated. Jitted steps then run SPMD over the mesh.

  Raises:
    ValueError when a split dim does not divide (naming the pool, the dim and the fix).
  """
  from qjax.sharding import leaf_mesh_axes, to_spec  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  def place(pool, what):
    per_leaf = leaf_mesh_axes(rules, POOL_AXES, pool, what)
    leaves = jax.tree.leaves(pool)
    for leaf, per_dim in zip(leaves, per_leaf):
      for dim, (n, mesh_axes) in enumerate(zip(leaf.shape, per_dim)):
        ways = int(np.prod([mesh.shape[a] for a in mesh_axes]))
        if n % ways:
          raise ValueError(
              f'shard_pools: {what} dim {dim} ({POOL_AXES[dim]}) has {n} entries, which '
              f'layout {rules} splits {ways} ways over mesh axes {mesh_axes}; use a multiple '
              f'of {ways} (num_pages, or kv heads) or another layout.')
    shardings = [NamedSharding(mesh, to_spec(d)) for d in per_leaf]
    return jax.tree.unflatten(jax.tree.structure(pool),
                              [jax.device_put(x, s) for x, s in zip(leaves, shardings)])
  rep_ = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
  return dataclasses.replace(
      cache, k=tuple(place(p, f'pool k[{i}]') for i, p in enumerate(cache.k)),
      v=tuple(place(p, f'pool v[{i}]') for i, p in enumerate(cache.v)),
      page_table=rep_(cache.page_table), ring_table=rep_(cache.ring_table),
      length=rep_(cache.length), num_new=rep_(cache.num_new))


def ring_pages_needed(window: int, page_size: int, max_new: int) -> int:
  """E such that a ring of E pages keeps every key a step of `max_new` tokens attends to.

  The oldest key a step's first query needs is `window + max_new - 1` positions before the
  newest one written, so E * page_size >= window + max_new - 1.
  """
  return -(-(window + max_new - 1) // page_size)


def init_paged_cache(config: TransformerConfig, *, num_pages: int, page_size: int,
                     batch: int, max_pages: int, ring_pages: int = 0, num_ring_pages: int = 0,
                     dtype=None, fmt: Union[None, str, QFormat] = None) -> PagedKVCache:
  """Empty pools and tables (every entry the sink page).

  Args:
    config: the model's config.
    num_pages: pages in each full-attention layer's pool (page 0 is the sink).
    page_size: Y, positions per page.
    batch: B, rows of a step.
    max_pages: pages a row's page table holds (its longest sequence is max_pages * Y).
    ring_pages: E of the ring table, ring pages per row for sliding-window layers; 0 keeps
      them on the page table like full layers (what prefix sharing needs: a ring
      overwrites its pages).
    num_ring_pages: pages in each ring layer's pool (with ring_pages > 0).
    dtype: storage dtype of float pools / the dtype quantized pools read back as.
    fmt: None (float), a name in `kvcache.KV_FORMATS`, or a QFormat (per token and head).

  Returns:
    A PagedKVCache with zero lengths.
  """
  for name, v in (('num_pages', num_pages), ('page_size', page_size), ('batch', batch),
                  ('max_pages', max_pages)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f'init_paged_cache: {name}={v!r} must be a positive integer.')
  if num_pages < 2:
    raise ValueError(f'init_paged_cache: num_pages={num_pages} leaves no page besides the '
                     'sink (page 0); use >= 2.')
  ring = tuple(ring_pages > 0 and config.is_local(i) for i in range(config.num_layers))
  if any(ring) and num_ring_pages < 2:
    raise ValueError(f'init_paged_cache: ring_pages={ring_pages} needs num_ring_pages >= 2 '
                     f'(the sink and the rings), got {num_ring_pages}.')
  dtype = jnp.dtype(dtype or config.dtype)
  fmt = kvcache.check_format(fmt, config.head_dim, 'init_paged_cache: fmt')

  def pool(layer):
    n = num_ring_pages if ring[layer] else num_pages
    zeros = jnp.zeros((n, page_size, config.num_kv_heads, config.head_dim), dtype)
    return zeros if fmt is None else quantize(zeros, fmt)
  layers = range(config.num_layers)
  return PagedKVCache(
      k=tuple(pool(i) for i in layers), v=tuple(pool(i) for i in layers),
      page_table=jnp.zeros((batch, max_pages), jnp.int32),
      ring_table=jnp.zeros((batch, ring_pages if any(ring) else 0), jnp.int32),
      length=jnp.zeros((batch,), jnp.int32), num_new=jnp.zeros((batch,), jnp.int32),
      qformat=fmt, page_size=page_size, ring=ring)


def with_step(cache: PagedKVCache, page_table, ring_table, length, num_new, *,
              seq_of=None, slot_of=None, att_width: int = 0,
              att_wide: int = 0) -> PagedKVCache:
  """The cache with this step's tables and lengths (host arrays), per row. Rows may change
  in number from step to step; a table's width may not. A packed step also gives `seq_of` /
  `slot_of` per token, `att_width` and `att_wide` (`PagedKVCache`); they are checked against
  the rows' `num_new` here, on the host.
  """
  rows = len(length)
  arr = lambda x, like: jnp.asarray(np.asarray(x, np.int32).reshape((rows,) + like.shape[1:]))
  packed = {}
  if seq_of is not None:
    seq_of, slot_of = np.asarray(seq_of, np.int32), np.asarray(slot_of, np.int32)
    num_new = np.asarray(num_new, np.int32)
    real = np.repeat(np.arange(rows), num_new)
    want_slot = np.concatenate([np.arange(k) for k in num_new] + [np.zeros(0, np.int32)])
    k = len(real)
    if (len(seq_of) < k or slot_of.shape != seq_of.shape or num_new.max() > att_width
        or not np.array_equal(seq_of[:k], real) or not np.array_equal(slot_of[:k], want_slot)
        or not np.all(slot_of[k:] == att_width) or np.sum(num_new > 1) > att_wide):
      raise ValueError(
          f'with_step: a packed step needs the rows\' tokens one after another (seq_of '
          f'{real.tolist()}, slot_of {want_slot.tolist()} for num_new {num_new.tolist()}), '
          f'then padding tokens with slot_of = att_width = {att_width} (>= every num_new), '
          f'and at most att_wide = {att_wide} rows of more than one token; got seq_of '
          f'{seq_of.tolist()}, slot_of {slot_of.tolist()}.')
    packed = dict(seq_of=jnp.asarray(seq_of), slot_of=jnp.asarray(slot_of))
  return dataclasses.replace(cache, page_table=arr(page_table, cache.page_table),
                             ring_table=arr(ring_table, cache.ring_table),
                             length=arr(length, cache.length), num_new=arr(num_new, cache.num_new),
                             seq_of=packed.get('seq_of'), slot_of=packed.get('slot_of'),
                             att_width=att_width if packed else 0,
                             att_wide=att_wide if packed else 0)


def forward(model: nnx.Module, tokens_BT: jax.Array, cache: PagedKVCache,
            num_new_B: Optional[jax.Array] = None) -> tuple[jax.Array, PagedKVCache]:
  """Run `model`'s phases against the paged cache: (x_BTD of the last block, cache).

  Row b's tokens sit at positions `length[b] + 0..T-1` (a packed step: `cache.positions`);
  only the first `num_new[b]` are written (`num_new_B` when given, else the cache's own).
  The returned cache has `length += num_new`: the cache forward of
  `qjax.infer.spec_round`, as `qjax.nn.kvcache.forward` is for a contiguous cache. Jit it
  with the model split (`nnx.split`), as the engine does; `model.logits` turns x into
  logits.
  """
  if num_new_B is not None:
    cache = dataclasses.replace(cache, num_new=jnp.asarray(num_new_B, jnp.int32))
  positions_BT = cache.positions(tokens_BT.shape[1])
  x_BTD, cache = model.run_layers(model.embed_tokens(tokens_BT), positions_BT, cache)
  return x_BTD, dataclasses.replace(cache, length=cache.length + cache.num_new)
