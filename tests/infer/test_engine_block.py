"""The engine's decode blocks: K steps per dispatch give the tokens, events and log-probs of
one step per dispatch; steady state compiles nothing and sends only changed row state."""

import jax
import numpy as np
import pytest
from flax import nnx

from qjax.infer import Engine, EngineConfig, SamplingParams
from qjax.nn import Transformer, TransformerConfig

CFG = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=48)


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(1))


def _prompts(lens, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(lens))
  return [np.asarray(jax.random.randint(k, (n,), 0, CFG.vocab_size)).tolist()
          for k, n in zip(keys, lens)]


def _serve(model, block, prompts, params, **cfg):
  cfg = dict(dict(max_batch=2, page_size=4, num_pages=40, chunk_size=8), **cfg)
  engine = Engine(model, EngineConfig(decode_block=block, **cfg))
  events = list(engine.stream(prompts, params))
  return engine, events


def test_blocks_give_the_events_of_single_steps(model):
  """4 requests on 2 rows (admissions wait for finishes), greedy and seeded sampling, a stop
  token, logprobs: the same events in the same order for K = 1, 3 and 8."""
  prompts = _prompts((3, 9, 5, 7))
  plain = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=40, chunk_size=8,
                                     decode_block=1))
  first = plain.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))[0]
  params = [SamplingParams(temperature=0.0, max_tokens=12, stop_tokens=(first[6],)),
            SamplingParams(temperature=0.8, top_k=30, seed=4, max_tokens=9, logprobs=True),
            SamplingParams(temperature=0.0, max_tokens=5, logprobs=True),
            SamplingParams(temperature=1.0, seed=9, max_tokens=10)]
  want_engine, want = _serve(model, 1, prompts, params)
  for k in (3, 8):
    engine, got = _serve(model, k, prompts, params)
    assert got == want
    for rid in ('1', '2'):
      np.testing.assert_allclose(engine.logprobs(rid), want_engine.logprobs(rid), atol=1e-5)
    assert engine.finish_reason('0') == 'stop' and len(engine.output('0')) == 7
    st, st1 = engine.stats, want_engine.stats
    assert st.decode_tokens == st1.decode_tokens and st.steps == st1.steps
    assert st.dispatches < st1.dispatches
    assert engine.allocator.num_free == 39


def test_steady_state_compiles_nothing_and_sends_only_a_grown_table(model):
  """Two requests decode 16 tokens in blocks of 4 on pages of 16: the first block sends the
  row state, the next run on the device's outputs, sending the page table when a page is
  added."""
  prompts = _prompts((5, 5), seed=1)
  params = SamplingParams(temperature=0.0, max_tokens=17)
  cfg = EngineConfig(max_batch=2, page_size=16, num_pages=9, chunk_size=8, decode_block=4)
  engine = Engine(model, cfg)
  compiled = engine.compile_buckets()
  want = _serve(model, 1, prompts, params, page_size=16, num_pages=9)[1]
  sent0, kept0 = engine.stats.arrays_sent, engine.stats.arrays_kept
  assert list(engine.stream(prompts, params)) == want
  st = engine.stats
  assert st.compilations == compiled  # none after the warm-up
  assert st.dispatches == 1 + 4  # the prefill step, then 16 decode steps in 4 blocks
  # Block 1 sends the 9 arrays of the rows' state; blocks 2-4 are queued behind the block
  # before them and run on its outputs: only the page table is given, sent once (block 3,
  # a page was added) and otherwise kept on the device.
  assert (st.arrays_sent - sent0, st.arrays_kept - kept0) == (10, 2)
  timing = st.timing()
  assert timing['steps'] == 17 and 0 < timing['host_share'] < 1
  assert st.host_s > 0 and st.wait_s > 0 and st.compile_s == 0  # compiled up front


def test_a_pool_without_pages_for_a_block_runs_single_steps(model):
  """Pages for K steps ahead are taken without preempting: a pool that cannot give them
  runs single steps, with the same tokens."""
  prompts = _prompts((4, 4), seed=2)
  params = SamplingParams(temperature=0.0, max_tokens=12)
  small = dict(page_size=4, num_pages=9)  # 8 pages: two rows of 15 positions need exactly 8
  want = _serve(model, 1, prompts, params, **small)[1]
  engine, got = _serve(model, 8, prompts, params, **small)
  assert got == want and engine.stats.preemptions == 0


def test_bad_decode_block_is_refused():
  with pytest.raises(ValueError, match='decode_block=0 must be a positive integer'):
    EngineConfig(decode_block=0)


def test_requests_added_while_a_block_is_queued(model):
  """A block queued behind another is read before anything is scheduled; a request added
  meanwhile, and a second batch on the same engine, get the tokens they get alone."""
  prompts = _prompts((4, 6, 5), seed=3)
  params = SamplingParams(temperature=0.0, max_tokens=14)
  want = _serve(model, 1, prompts, params)[0]
  # A free row (3 rows, 2 requests): queued blocks whatever the step costs.
  engine = Engine(model, EngineConfig(max_batch=3, page_size=4, num_pages=40, chunk_size=8,
                                      decode_block=4, admit_within_s=None))
  ids = [engine.add_request(p, params) for p in prompts[:2]]
  for _ in range(4):
    engine.step()
    if engine.policy.queued is not None:
      break
  assert engine.policy.queued is not None
  ids.append(engine.add_request(prompts[2], params))
  for _ in engine.run():
    pass
  assert [engine.output(i) for i in ids] == [want.output(str(i)) for i in range(3)]
  assert engine.generate(prompts[::-1], params) == [want.output(str(i)) for i in (2, 1, 0)]
  assert engine.allocator.num_free == 39


def test_a_free_row_bounds_the_time_a_dispatch_holds_the_engine(model):
  """With a free row and nothing waiting, a block (or a queued pair) runs only within
  `admit_within_s` of the estimated step time: at 0 every decode step is its own dispatch;
  with every row busy blocks run whatever the bound; the tokens never change."""
  prompts = _prompts((4, 6), seed=5)
  params = SamplingParams(temperature=0.0, max_tokens=13)
  want = _serve(model, 1, prompts, params)[1]
  for rows, bound, blocks in ((3, 0.0, False), (3, None, True), (2, 0.0, True)):
    engine, got = _serve(model, 4, prompts, params, max_batch=rows, admit_within_s=bound)
    st = engine.stats
    assert got == want
    assert (st.dispatches < st.steps) == blocks, (rows, bound, st.dispatches, st.steps)
    assert engine.policy.step_s is not None and engine.policy.step_s > 0


def test_may_hold_compares_steps_times_the_estimate_with_the_bound(model):
  engine = Engine(model, EngineConfig(max_batch=3, page_size=4, num_pages=40, chunk_size=8,
                                      decode_block=4, admit_within_s=0.05))
  engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
  engine.step()  # admitted: one row busy, two free, nothing waiting
  hold = engine.policy.may_hold
  engine.policy.step_s = None
  assert not hold(4)  # no estimate yet: single steps until one is timed
  engine.policy.step_s = 0.01
  assert hold(4) and hold(5) and not hold(6) and not hold(8)
  engine.add_request([4, 5], SamplingParams(temperature=0.0, max_tokens=2))
  assert hold(8)  # a request waits: a finish ends the block, so it may run


@pytest.mark.parametrize('bad', [-0.1, float('nan'), float('inf'), True, '0.05'])
def test_bad_admit_within_s_is_refused(bad):
  with pytest.raises(ValueError, match='admit_within_s='):
    EngineConfig(admit_within_s=bad)
