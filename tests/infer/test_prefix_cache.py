"""Prefix caching: chain hashes, shared pages with reference counts, LRU eviction, and an
engine whose cached prefixes skip prefill with identical outputs."""

import jax
import numpy as np
from flax import nnx

from qjax.infer import (Engine, EngineConfig, PageAllocator, PrefixCache, SamplingParams,
                        block_hashes)
from qjax.nn import Transformer, TransformerConfig


def test_block_hashes_identify_whole_prefixes():
  a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
  assert len(a) == 2  # the partial last page is not hashed
  assert block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[0] == a[0]
  assert block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[1] != a[1]
  assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # page 1 depends on page 0


def test_each_page_is_hashed_once_however_many_chunks_feed_it(monkeypatch):
  """A 64-token prompt fed in chunks of 8 on pages of 4: 16 pages hashed once each when
  inserted (re-hashing the prefix every chunk would be 2 + 4 + ... + 16 = 72)."""
  from qjax.infer import Scheduler, SequenceState, prefix_cache
  calls = []
  real = prefix_cache.hashlib.sha256
  monkeypatch.setattr(prefix_cache.hashlib, 'sha256', lambda b: calls.append(1) or real(b))
  alloc = PageAllocator(40)
  s = Scheduler(max_batch=1, chunk_size=8, page_size=4, max_pages=20, max_len=80,
                allocator=alloc, prefix_cache=PrefixCache(alloc, 4))
  seq = SequenceState('a', list(range(100, 164)), 2)
  s.add(seq)
  while not seq.output:
    s.complete(s.schedule(), [7], lambda q: False)
  matched = 15  # admission looks up the prompt's pages but the last position's
  assert len(calls) == matched + 16
  assert seq.page_hashes == block_hashes(seq.prompt, 4)
  assert block_hashes(seq.prompt, 4, seq.page_hashes[:5]) == seq.page_hashes


def test_match_shares_pages_and_eviction_is_lru_of_unheld_pages():
  alloc = PageAllocator(8)
  cache = PrefixCache(alloc, 2)
  pages = alloc.alloc(3)
  cache.insert([1, 2, 3, 4, 5, 6], pages)
  alloc.free(pages)  # the sequence finished; the cache still holds them
  assert alloc.num_free == 4 and cache.evictable == 3
  hit = cache.match([1, 2, 3, 4, 9, 9], max_pages=3)
  assert hit == pages[:2] and alloc.refcount[pages[0]] == 2
  assert cache.evict(3) == 1  # only the unshared third page can go
  assert alloc.num_free == 5 and len(cache) == 2
  alloc.free(hit)
  assert cache.evict(5) == 2 and alloc.num_free == 7 and len(cache) == 0


def test_cached_prefix_skips_prefill_with_identical_outputs():
  cfg = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=48)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  system = np.asarray(jax.random.randint(jax.random.key(5), (13,), 0, 256)).tolist()
  prompts = [system + [7, 8], system + [9], system + [10, 11, 12]]
  params = SamplingParams(temperature=0.0, max_tokens=4)
  outs, stats = [], []
  for caching in (False, True):
    engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8,
                                        prefix_caching=caching))
    first = engine.generate(prompts[:1], params)  # fills the cache
    outs.append(first + engine.generate(prompts[1:], params))
    stats.append(engine.stats)
  assert outs[0] == outs[1]  # (tests/infer/test_engine.py: misses == greedy_generate alone)
  # The 3 full pages (12 tokens) of the system prompt are computed once, not three times.
  assert stats[1].prefix_hit_tokens == 2 * 12
  assert stats[0].prefill_tokens - stats[1].prefill_tokens == 2 * 12
