"""Prefix caching: full pages of identical token prefixes shared between requests.

A page holding positions j*Y .. j*Y+Y-1 of a sequence is identified by the hash of every
token up to its end (a chain: hash(parent's hash, this page's Y tokens)), so two prompts
share page j exactly when their first (j+1)*Y tokens agree (the keys of position p depend
on tokens 0..p). The cache holds one reference to each page it knows (`PageAllocator`), so
a page stays valid after the sequence that wrote it finishes; `evict` drops the least
recently used pages that only the cache holds, when the allocator runs short.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from qjax.infer.page_host import PageAllocator


def block_hashes(tokens: Sequence[int], page_size: int,
                 known: Sequence[bytes] = ()) -> list[bytes]:
  """The chain hash of every full page of `tokens` (len(tokens) // page_size of them).

  `known`: the hashes of its first pages, computed before (a prefix of the answer); only
  the pages after them are hashed, so a sequence hashes each page once however many chunks
  its prompt is fed in.
  """
  out = list(known)
  parent = out[-1] if out else b''
  for j in range(len(out), len(tokens) // page_size):
    block = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64).tobytes()
    parent = hashlib.sha256(parent + block).digest()
    out.append(parent)
  return out


class PrefixCache:
  """Hash of a token prefix -> the page holding its last Y positions; LRU order.

  Attributes:
    allocator: the pool's allocator (the cache holds one count of every page it maps).
    page_size: Y.
    hits / queries: pages found / looked up by `match` (the hit rate's parts).
  """

  def __init__(self, allocator: PageAllocator, page_size: int):
    self.allocator = allocator
    self.page_size = page_size
    self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self.hits = 0
    self.queries = 0

  def __len__(self) -> int:
    return len(self._pages)

  def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
    """Pages of the longest cached prefix of `tokens` (at most `max_pages`), each shared
    (one more hold, the caller's; free them with the sequence)."""
    pages = []
    hashes = block_hashes(tokens[:max_pages * self.page_size], self.page_size)
    self.queries += len(hashes)
    for h in hashes:
      page = self._pages.get(h)
      if page is None:
        break
      self._pages.move_to_end(h)
      pages.append(page)
    self.hits += len(pages)
    self.allocator.share(pages)
    return pages

  def insert(self, tokens: Sequence[int], pages: Sequence[int],
             hashes: Sequence[bytes] = ()) -> list[bytes]:
    """Remember the full pages of a sequence whose first len(tokens) positions are cached.

    `hashes`: those of its first pages from an earlier call (only later pages are hashed).
    Returns the hashes of every full page of `tokens` (pass them to the next call)."""
    hashes = block_hashes(tokens, self.page_size, hashes)
    for h, page in zip(hashes, pages):
      if h in self._pages:
        self._pages.move_to_end(h)
        continue
      self._pages[h] = page
      self.allocator.share([page])
    return hashes

  def evict(self, num_pages: int) -> int:
    """Drop up to `num_pages` least recently used pages nobody else holds; returns how many."""
    freed = 0
    for h in list(self._pages):
      if freed == num_pages:
        break
      page = self._pages[h]
      if self.allocator.refcount[page] == 1:
        del self._pages[h]
        self.allocator.free([page])
        freed += 1
    return freed

  @property
  def evictable(self) -> int:
    """Pages `evict` could free now."""
    return sum(1 for p in self._pages.values() if self.allocator.refcount[p] == 1)
