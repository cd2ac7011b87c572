"""The host side of the paged KV cache (`qjax.infer.paged`): the page allocator, the check at
the step boundary, and the copies of a sequence's pages to host memory and back.

`PageAllocator` keeps free pages and reference counts (prefix sharing); `check_step` makes
an overflowing write an error naming the sequence; `read_pages` / `write_pages` copy pages
out and in (swap preemption), each one compiled shape whatever the number of pages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer.paged import SINK_PAGE, PagedKVCache
from qjax.nn import kvcache


@jax.jit
def _gather_pages(cache: PagedKVCache, pages_E: jax.Array, ring_E: jax.Array):
  pick = lambda layer, pool: jax.tree.map(
      lambda x: x[ring_E if cache.ring[layer] else pages_E], pool)
  return (tuple(pick(i, pool) for i, pool in enumerate(cache.k)),
          tuple(pick(i, pool) for i, pool in enumerate(cache.v)))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_pages(cache: PagedKVCache, pages_E: jax.Array, ring_E: jax.Array, k, v):
  def put(layer, pool, data):
    idx = ring_E if cache.ring[layer] else pages_E
    return jax.tree.map(lambda x, d: x.at[idx].set(d), pool, data)
  return dataclasses.replace(
      cache, k=tuple(put(i, pool, d) for i, (pool, d) in enumerate(zip(cache.k, k))),
      v=tuple(put(i, pool, d) for i, (pool, d) in enumerate(zip(cache.v, v))))


def _padded_pages(cache: PagedKVCache, pages: Sequence[int], ring_pages: Sequence[int]):
  """Page ids padded to fixed lengths with the sink page (one compilation of each copy)."""
  if len(pages) > cache.max_pages:
    raise ValueError(f'paged KV cache: {len(pages)} pages exceed a page table of '
                     f'{cache.max_pages}.')
  num_ring = cache.ring_table.shape[1]
  if any(cache.ring) and len(ring_pages) != num_ring:
    raise ValueError(f'paged KV cache: a ring of {len(ring_pages)} pages; the ring layers '
                     f'hold {num_ring} per sequence.')
  pages_E = np.full(cache.max_pages, SINK_PAGE, np.int32)
  pages_E[:len(pages)] = pages
  ring_E = np.full(max(num_ring, 1), SINK_PAGE, np.int32)
  ring_E[:len(ring_pages)] = ring_pages
  return jnp.asarray(pages_E), jnp.asarray(ring_E)


def read_pages(cache: PagedKVCache, pages: Sequence[int], ring_pages: Sequence[int] = ()):
  """A host (numpy) copy of `pages` of every full layer and `ring_pages` of every ring layer.

  Args:
    cache: the device cache.
    pages: page-table pages, logical order (at most `max_pages`).
    ring_pages: the sequence's ring (all E of them), when the cache has ring layers.

  Returns:
    (host, nbytes): the copy (pass it to `write_pages`) and the bytes of the copied pages
    (the sink-page padding that keeps one compiled shape is not counted).
  """
  k, v = jax.device_get(_gather_pages(cache, *_padded_pages(cache, pages, ring_pages)))
  nbytes = 0
  for layer, pool in enumerate(cache.k + cache.v):
    n = len(ring_pages) if cache.ring[layer % len(cache.ring)] else len(pages)
    nbytes += n * sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(pool))
  return (k, v), nbytes


def write_pages(cache: PagedKVCache, pages: Sequence[int], ring_pages: Sequence[int],
                host) -> PagedKVCache:
  """`cache` with `read_pages`' copy written into `pages` / `ring_pages` (fresh pages may
  differ from the ones it was read from; their number must be at least the copied ones)."""
  k, v = host
  return _scatter_pages(cache, *_padded_pages(cache, pages, ring_pages), k, v)


def check_step(names: Sequence[str], lengths: Sequence[int], num_new: Sequence[int],
               pages_held: Sequence[int], page_size: int, max_len: int) -> None:
  """Host check at the step boundary: every row's write fits its pages and the context.

  Args:
    names: a name per row (the request id), for the message.
    lengths: positions each row has cached.
    num_new: tokens each row writes this step.
    pages_held: pages each row's page table has assigned.
    page_size: Y.
    max_len: the model's (or the engine's) longest sequence.

  Raises:
    ValueError naming the sequence, its length and the limit it would pass.
  """
  for name, length, new, held in zip(names, lengths, num_new, pages_held):
    if length + new > max_len:
      raise ValueError(kvcache.overflow_message(name, length, new, max_len, 'paged KV cache'))
    if length + new > held * page_size:
      raise ValueError(f'paged KV cache: sequence {name} has {length} cached + {new} new '
                       f'tokens, past its {held} allocated pages ({held * page_size} slots); '
                       'allocate pages (PageAllocator.alloc) before the step.')


class PageAllocator:
  """Free pages of one pool and a reference count per page (host side).

  Page 0 is the sink and never handed out. A page shared by several sequences (a cached
  prefix) has a count above 1 and returns to the free list when the last holder frees it.
  """

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f'PageAllocator: num_pages={num_pages} must be >= 2 (page 0 is the '
                       'sink).')
    self.num_pages = num_pages
    self.refcount = np.zeros(num_pages, np.int64)
    self._free = list(range(num_pages - 1, SINK_PAGE, -1))  # pop() hands out 1, 2, ...

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def alloc(self, n: int) -> list[int]:
    """`n` fresh pages (count 1 each); raises when fewer are free (check `num_free` first)."""
    if n > len(self._free):
      raise ValueError(f'PageAllocator: {n} pages requested, {len(self._free)} free of '
                       f'{self.num_pages - 1}; free pages or build a larger pool.')
    pages = [self._free.pop() for _ in range(n)]
    self.refcount[pages] = 1
    return pages

  def share(self, pages: Sequence[int]) -> None:
    """One more holder of each of `pages`."""
    for p in pages:
      if self.refcount[p] < 1:
        raise ValueError(f'PageAllocator: page {p} is free; only held pages can be shared.')
      self.refcount[p] += 1

  def free(self, pages: Sequence[int]) -> None:
    """Drop one hold of each of `pages`; a page nobody holds returns to the free list."""
    for p in pages:
      if p == SINK_PAGE or self.refcount[p] < 1:
        raise ValueError(f'PageAllocator: page {p} is not held (double free?).')
      self.refcount[p] -= 1
      if self.refcount[p] == 0:
        self._free.append(p)
