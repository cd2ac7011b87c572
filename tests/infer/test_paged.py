"""The paged KV cache: paged decode == contiguous decode (every KV format, ragged rows, ring
pages for sliding-window layers), the page allocator, and overflow as an error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import (PageAllocator, check_step, init_paged_cache, ring_pages_needed, with_step)
from qjax.nn import Transformer, TransformerConfig, init_cache, with_kv_format

# Windows (ring layers), a global layer, softcaps: every path of the paged attention.
CFG = TransformerConfig.tiny(sliding_window=5, global_every=2, attn_logit_softcap=30.0,
                             final_logit_softcap=20.0, max_len=32)
P = 4


def _tokens(t, seed):
  return jax.random.randint(jax.random.key(seed), (1, t), 0, CFG.vocab_size)


def _contiguous_logits(model, fmt, seq_1T):
  """Logits of every position of one sequence prefilled alone into a contiguous cache."""
  logits, _ = model(seq_1T, cache=init_cache(CFG, 1, seq_1T.shape[1], fmt=fmt))
  return np.asarray(logits[0])


@pytest.mark.parametrize('fmt', [None, 'int8', 'int4', 'fp8'])
def test_paged_decode_equals_contiguous_decode_for_ragged_rows(fmt, paged_logits_step):
  """Row 0 prefills 11 tokens in chunks of 4 while row 1 (3 tokens) is already decoding;
  row 0's ring (2 pages of 4 for a window of 5) wraps around."""
  model = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(0)), fmt)
  step = paged_logits_step(model)

  seqs = [np.asarray(_tokens(15, 1)[0]), np.asarray(_tokens(8, 2)[0])]
  chunk = 4
  ring = ring_pages_needed(CFG.sliding_window, P, max_new=chunk)
  assert ring == 2
  cache = init_paged_cache(CFG, num_pages=12, page_size=P, batch=2, max_pages=4,
                           ring_pages=ring, num_ring_pages=1 + 2 * ring, fmt=fmt)
  assert cache.ring == (True, False)
  # Pages out of order and interleaved between the rows: the tables alone say where.
  table = np.array([[7, 2, 11, 5], [3, 9, 0, 0]])
  rings = np.arange(1, 1 + 2 * ring).reshape(2, ring)[::-1]
  got = [{}, {}]
  done = [0, 0]
  while done[0] < len(seqs[0]):
    new = [min(chunk, len(seqs[i]) - done[i]) for i in range(2)]
    tokens = np.zeros((2, chunk), np.int32)  # one padded shape: one compile
    for i in range(2):
      tokens[i, :new[i]] = seqs[i][done[i]:done[i] + new[i]]
    cache = with_step(cache, table, rings, done, new)
    logits, cache = step(jnp.asarray(tokens), cache)
    for i in range(2):
      if new[i]:
        got[i].update({done[i] + t: np.asarray(logits[i, t]) for t in range(new[i])})
      done[i] += new[i]
  np.testing.assert_array_equal(cache.length, [15, 8])
  for i in range(2):
    want = _contiguous_logits(model, fmt, jnp.asarray(seqs[i])[None])
    pos = sorted(got[i])
    np.testing.assert_allclose(np.stack([got[i][p] for p in pos]), want[pos], rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize('fmt', [None, 'int4'])
def test_packed_steps_over_blocks_of_several_pages_equal_contiguous_prefill(fmt, monkeypatch,
                                                                           paged_logits_step):
  """Packed steps (tokens (N, 1), each row's tokens one after another, attended together in
  that row) with key blocks of 2 pages: a page table of 9 pages (5 blocks, the last padded
  with the sink) and rings of 3 pages (2 blocks, the slots past the ring masked). Rows of
  15, 3 and 9 tokens feed chunks of 4 into one bucket of 12 tokens (row 1 idle once done,
  row 2's last token attending as a one-token row, padding tokens at the end, later steps
  with fewer multi-token rows than the 3 the layout holds); every position's logits equal
  the contiguous cache's."""
  from qjax.infer import paged
  monkeypatch.setattr(paged, 'KEYS_PER_BLOCK', 2 * P)
  model = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(0)), fmt)
  step = paged_logits_step(model)

  seqs = [np.asarray(_tokens(t, seed)[0]) for t, seed in ((15, 1), (3, 2), (9, 3))]
  chunk, n, ring = 4, 12, 3
  cache = init_paged_cache(CFG, num_pages=14, page_size=P, batch=3, max_pages=9,
                           ring_pages=ring, num_ring_pages=1 + 3 * ring, fmt=fmt)
  table = np.zeros((3, 9), np.int32)
  table[0, :4], table[1, :1], table[2, :3] = [13, 2, 7, 5], [11], [3, 9, 1]
  rings = np.arange(1, 1 + 3 * ring).reshape(3, ring)[::-1]
  got, done = [{}, {}, {}], [0, 0, 0]
  while done[0] < len(seqs[0]):
    new = [min(chunk, len(s) - d) for s, d in zip(seqs, done)]
    fed = np.concatenate([s[d:d + k] for s, d, k in zip(seqs, done, new)])
    tokens = np.zeros((n, 1), np.int32)
    tokens[:len(fed), 0] = fed
    seq_of = np.concatenate([np.repeat(np.arange(3), new), np.zeros(n - len(fed), int)])
    slot_of = np.concatenate([np.arange(k) for k in new] + [np.full(n - len(fed), chunk)])
    cache = with_step(cache, table, rings, done, new, seq_of=seq_of, slot_of=slot_of,
                      att_width=chunk, att_wide=3)
    logits, cache = step(jnp.asarray(tokens), cache)
    at = 0
    for i, k in enumerate(new):
      got[i].update({done[i] + t: np.asarray(logits[at + t, 0]) for t in range(k)})
      at, done[i] = at + k, done[i] + k
  np.testing.assert_array_equal(cache.length, [15, 3, 9])
  for i, s in enumerate(seqs):
    want = _contiguous_logits(model, fmt, jnp.asarray(s)[None])
    np.testing.assert_allclose(np.stack([got[i][t] for t in range(len(s))]), want, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())
  with pytest.raises(ValueError, match='a packed step needs the rows\' tokens one after '
                                       'another'):
    with_step(cache, table, rings, done, [1, 0, 1], seq_of=[2, 0, 0], slot_of=[0, 0, 4],
              att_width=4, att_wide=1)
  with pytest.raises(ValueError, match='at most att_wide = 1 rows of more than one token'):
    with_step(cache, table, rings, done, [2, 0, 2], seq_of=[0, 0, 2, 2],
              slot_of=[0, 1, 0, 1], att_width=4, att_wide=1)


def test_allocator_frees_and_reuses_pages_with_reference_counts():
  alloc = PageAllocator(5)
  assert alloc.num_free == 4
  a = alloc.alloc(3)
  assert a == [1, 2, 3] and 0 not in a and alloc.num_free == 1
  alloc.share([a[0]])
  alloc.free(a)  # page a[0] still held once
  assert alloc.num_free == 3 and alloc.refcount[a[0]] == 1
  alloc.free([a[0]])
  assert alloc.num_free == 4
  b = alloc.alloc(4)
  assert sorted(b) == [1, 2, 3, 4]  # every page reused, none lost
  with pytest.raises(ValueError, match='1 pages requested, 0 free of 4'):
    alloc.alloc(1)
  alloc.free(b[:1])
  with pytest.raises(ValueError, match=f'page {b[0]} is not held'):
    alloc.free(b[:1])


def test_writes_past_the_pages_or_the_context_are_errors_naming_the_sequence():
  check_step(['a', 'b'], [3, 8], [1, 1], [1, 3], page_size=4, max_len=32)  # fits
  with pytest.raises(ValueError, match='sequence b has 8 cached \\+ 1 new tokens, past its 2 '
                                       'allocated pages \\(8 slots\\)'):
    check_step(['a', 'b'], [3, 8], [1, 1], [1, 2], page_size=4, max_len=32)
  with pytest.raises(ValueError, match='sequence at row req7 has 30 cached \\+ 4 new tokens '
                                       'exceed the cache max_len=32'):
    check_step(['req7'], [30], [4], [9], page_size=4, max_len=32)


def test_bad_pool_shapes_raise():
  with pytest.raises(ValueError, match='num_pages=1 leaves no page besides the sink'):
    init_paged_cache(CFG, num_pages=1, page_size=4, batch=1, max_pages=2)
  with pytest.raises(ValueError, match='ring_pages=2 needs num_ring_pages >= 2'):
    init_paged_cache(CFG, num_pages=4, page_size=4, batch=1, max_pages=2, ring_pages=2)
  assert ring_pages_needed(512, 16, 64) == 36  # 575 slots -> 36 pages of 16


def test_quantized_pools_shard_codes_and_scales_by_the_layout_rules(eight_devices):
  """Under wg_xy+multihead, pages split over (x, y) and kv heads over z, for the int8 codes
  and their per-token-and-head scales alike; tables stay replicated."""
  from qjax import sharding
  from qjax.infer import shard_pools
  mesh = sharding.make_mesh('2x2x2', eight_devices)
  cache = init_paged_cache(CFG, num_pages=8, page_size=P, batch=2, max_pages=4, fmt='int8')
  cache = shard_pools(cache, sharding.layout_rules('wg_xy+multihead'), mesh)
  for leaf in jax.tree.leaves(cache.k + cache.v):
    assert leaf.sharding.spec == jax.sharding.PartitionSpec(('x', 'y'), None, 'z', None)
    assert leaf.addressable_shards[0].data.shape[:3] == (2, P, 1)
  assert cache.page_table.sharding.spec == jax.sharding.PartitionSpec()
