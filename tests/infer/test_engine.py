"""The engine: batched greedy outputs == each prompt alone, preemption, waste, bad input."""

import jax
import numpy as np
import pytest
from flax import nnx

from qjax.infer import Engine, EngineConfig, SamplingParams
from qjax.nn import Transformer, TransformerConfig, greedy_generate, with_kv_format

# A sliding-window layer (ring pages) and a global one.
CFG = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=48)
PROMPT_LENS, MAX_TOKENS = (3, 19, 9, 5), (6, 4, 7, 5)


def _prompts(lens=PROMPT_LENS, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(lens))
  return [np.asarray(jax.random.randint(k, (n,), 0, CFG.vocab_size)).tolist()
          for k, n in zip(keys, lens)]


def _alone(model, prompt, n):
  return np.asarray(greedy_generate(model, np.asarray([prompt]), n))[0, len(prompt):].tolist()


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


def test_batched_outputs_equal_greedy_generation_alone(model):
  """4 requests, 2 rows: requests join as others leave, prompts prefill in chunks of 8."""
  # A pool size no other test uses: its steps are compiled here (executables are shared
  # between engines of equal shapes, and compilations counts only this engine's).
  engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=31, chunk_size=8))
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
  outs = engine.generate(_prompts(), params)
  for prompt, n, out in zip(_prompts(), MAX_TOKENS, outs):
    assert out == _alone(model, prompt, n)
  st = engine.stats
  # Decodes (2 tokens); 10 (decodes beside a chunk) and 16 (two chunks at once).
  assert engine.buckets == ((2, 1, 0), (10, 8, 1), (16, 8, 2))
  assert 1 <= st.compilations <= len(engine.buckets) + 1  # + the decode block
  assert st.prefill_tokens == sum(PROMPT_LENS) and st.preemptions == 0
  assert st.decode_tokens == sum(MAX_TOKENS) - len(MAX_TOKENS)
  assert engine.allocator.num_free == 30  # every page returned
  assert st.paged_waste < st.contiguous_waste


def test_every_step_shape_is_a_compiled_bucket_and_half_chunks_stay_exact(model):
  """Chunks of 16: steps of 2 tokens (decodes), 10 (beside half a chunk), 18 (beside a chunk)
  and 32 (two chunks). After `compile_buckets` serving compiles nothing, and every bucket
  gives each prompt's tokens alone."""
  engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=33, chunk_size=16))
  assert engine.buckets == ((2, 1, 0), (10, 10, 1), (18, 16, 1), (32, 16, 2))
  compiled = engine.compile_buckets()
  assert 1 <= compiled <= 5  # the buckets and the decode block
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
  outs = engine.generate(_prompts(), params)
  assert outs == [_alone(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS)]
  assert engine.stats.compilations == compiled


def test_a_prefill_budget_keeps_every_step_in_the_one_chunk_bucket_and_outputs_exact(model):
  """3 rows, chunks of 8, a budget of 8 prompt tokens per step: the prompts of 19 and 9
  tokens never feed two chunks in one step, so no step takes the 19- or 24-token bucket,
  and every request still gets its tokens alone (as without a budget, which takes them)."""
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
  fed = {}
  for budget in (None, 8):
    engine = Engine(model, EngineConfig(max_batch=3, page_size=4, num_pages=31, chunk_size=8,
                                        prefill_budget=budget))
    schedule, plans = engine.scheduler.schedule, []
    engine.scheduler.schedule = (lambda schedule=schedule, plans=plans:
                                 plans.append(schedule()) or plans[-1])
    assert engine.generate(_prompts(), params) == [
        _alone(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS)]
    prompt_fed = [sum(n for seq, n in zip(pl.rows, pl.num_new) if seq is not None and n > 1)
                  for pl in plans]
    fed[budget] = (max(prompt_fed), max(sum(pl.num_new) for pl in plans))
    assert engine.stats.prefill_tokens == sum(PROMPT_LENS)
    assert engine.allocator.num_free == 30
  assert fed[None][0] > 8 and fed[None][1] > 3 + 8  # two chunks at once: 19 or 24 tokens
  assert fed[8][0] <= 8 and fed[8][1] <= 3 + 8  # always 3 or 11 tokens
  with pytest.raises(ValueError, match='prefill_budget=0 must be a positive integer'):
    EngineConfig(prefill_budget=0)


def test_swap_and_recompute_preemption_keep_outputs_with_a_quantized_cache(model):
  """A pool of 11 pages of 4 cannot hold two of these 24-position requests at once: both
  preemption modes give the tokens of each request alone (no preemption); swap restores the
  preempted pages (ring layer included) from host memory instead of recomputing them."""
  model = with_kv_format(model, 'int8')
  prompts = _prompts((10, 10, 10), seed=3)
  params = SamplingParams(temperature=0.0, max_tokens=14)
  alone = [_alone(model, prompt, 14) for prompt in prompts]
  stats = {}
  for mode in ('recompute', 'swap'):
    engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=12, chunk_size=8,
                                        preemption=mode))
    assert engine.cache.format == 'int8-ch012' and any(engine.cache.ring)
    assert engine.generate(prompts, params) == alone, mode
    assert engine.allocator.num_free == 11 and engine.ring_allocator.num_free == 8
    stats[mode] = engine.stats
  rec, swap = stats['recompute'], stats['swap']
  assert rec.preemptions > 0 and swap.preemptions > 0
  assert rec.swaps_out == 0 and swap.swaps_out == swap.swaps_in == swap.preemptions
  # Swap computes every prompt position once; recompute recomputes the preempted ones.
  assert swap.prefill_tokens == 30 < rec.prefill_tokens
  # An int8 page: 4 slots x 2 kv heads x (32 codes + one f32 scale), for k and for v.
  assert swap.swapped_bytes > 0 and swap.swapped_bytes % (2 * 4 * 2 * (32 + 4)) == 0
  with pytest.raises(ValueError, match="preemption='evict' is unknown"):
    EngineConfig(preemption='evict')


def test_streaming_yields_each_token_once_in_order(model):
  engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8))
  got = {}
  for rid, tok in engine.stream(_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=3)):
    got.setdefault(rid, []).append(tok)
  assert [got['0'], got['1']] == [engine.output('0'), engine.output('1')]
  assert all(len(v) == 3 for v in got.values())


def test_bad_requests_are_refused_and_others_unaffected(model):
  engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=12, chunk_size=8))
  ok = engine.add_request(_prompts()[0], SamplingParams(temperature=0.0, max_tokens=6))
  with pytest.raises(ValueError, match='prompt of 40 tokens \\+ max_tokens=16 = 56 exceeds '
                                       'the context of 48'):
    engine.add_request([1] * 40)
  with pytest.raises(ValueError, match='need 12 pages of 4, but a sequence can hold at most 11'):
    engine.add_request([1] * 38, SamplingParams(max_tokens=10))
  with pytest.raises(ValueError, match='the prompt is empty'):
    engine.add_request([])
  with pytest.raises(ValueError, match=r'token id 256 at index \(1,\) is outside the '
                                       r'vocabulary \[0, 256\); 2 id'):
    engine.add_request([3, 256, -1])
  with pytest.raises(ValueError, match='max_tokens=0 must be an int >= 1'):
    engine.add_request([3], SamplingParams(max_tokens=0))
  with pytest.raises(ValueError, match='num_pages=0 must be a positive integer'):
    EngineConfig(num_pages=0)
  for _ in engine.run():
    pass
  assert engine.output(ok) == _alone(model, _prompts()[0], 6)


@pytest.mark.plots
def test_engine_notebook_runs(run_notebook):
  text, outputs = run_notebook('engine.ipynb', QJAX_NB_SMALL='1')
  assert 'engine outputs == greedy_generate alone for 1 request(s)' in text
  assert 'prefix hits: [0, ' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)


def test_seeded_sampling_does_not_depend_on_the_batch_and_logprobs_are_returned(model):
  """A sampled request gives the same tokens alone and among others (per-request seeds)."""
  prompts = _prompts()
  hot = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=5, logprobs=True)
  cfg = EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8)
  alone = Engine(model, cfg)
  rid = alone.add_request(prompts[1], hot)
  for _ in alone.run():
    pass
  crowded = Engine(model, cfg)
  others = [SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.3)] * 2
  outs = crowded.generate([prompts[0], prompts[1], prompts[2]], [others[0], hot, others[1]])
  assert outs[1] == alone.output(rid)
  lp = alone.logprobs(rid)
  assert len(lp) == 5 and all(x <= 0 for x in lp)
  np.testing.assert_allclose(crowded.logprobs('1'), lp, rtol=1e-4, atol=1e-5)


def test_sharded_engine_gives_the_unsharded_tokens(model, eight_devices):
  """Weights and page pools (ring pool included) split over a 2x2x2 mesh by a layout's rules:
  the pools' page axis follows the cache-batch rule (8 ways under wg_xyz+mq_batch)."""
  from qjax import sharding
  mesh = sharding.make_mesh('2x2x2', eight_devices)
  # The streaming test's engine and requests: the unsharded steps are compiled once.
  cfg = EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8)
  prompts, params = _prompts()[:2], SamplingParams(temperature=0.0, max_tokens=3)
  want = Engine(model, cfg).generate(prompts, params)
  engine = Engine(model, cfg, mesh=mesh, layout='wg_xyz+mq_batch')
  assert engine.generate(prompts, params) == want
  for pool in engine.cache.k + engine.cache.v:  # still split after the steps
    assert pool.sharding.spec[0] == ('x', 'y', 'z') and len(pool.sharding.device_set) == 8
  assert engine.ring_allocator.num_pages == 16  # 1 + 2 rings of 4 pages, rounded up
  assert engine.stats.compilations <= len(engine.buckets) + 1  # + the decode block
  assert len(engine.buckets) == 3  # 2, 10 and 16 tokens
  with pytest.raises(ValueError, match='pool k\\[1\\] dim 0 \\(cache_batch\\) has 20 entries, '
                                       'which layout wg_xyz\\+mq_batch splits 8 ways'):
    Engine(model, EngineConfig(num_pages=20, page_size=4), mesh=mesh, layout='wg_xyz+mq_batch')
  with pytest.raises(ValueError, match='mesh= needs layout='):
    Engine(model, cfg, mesh=mesh)


class _ByteTokenizer:
  """Token id = one UTF-8 byte (the tiny model's vocabulary of 256)."""

  def encode(self, text):
    return list(text.encode('utf-8'))

  def decode(self, ids):
    return bytes(ids).decode('utf-8', errors='replace')


def test_stream_text_pieces_concatenate_to_the_decoded_output(model):
  tok = _ByteTokenizer()
  engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8),
                  tokenizer=tok)
  pieces = list(engine.stream_text('héllo', SamplingParams(temperature=0.0, max_tokens=6)))
  out = engine.output('0')
  assert len(out) == 6 and ''.join(pieces) == tok.decode(out)
  assert out == _alone(model, tok.encode('héllo'), 6)  # 6 prompt bytes: é is two
  with pytest.raises(ValueError, match='stream_text: build the engine with'):
    next(Engine(model).stream_text([1, 2]))


def test_stream_text_cuts_the_stop_string_as_its_docstring_says(model):
  tok = _ByteTokenizer()
  config = EngineConfig(max_batch=2, page_size=4, num_pages=32, chunk_size=8)
  full = tok.decode(_alone(model, tok.encode('hello'), 12))
  at = next(i for i in range(2, len(full) - 1) if '\ufffd' not in full[i:i + 2])
  stop = full[at:at + 2]  # two characters from the middle of the output
  engine = Engine(model, config, tokenizer=tok)
  params = SamplingParams(temperature=0.0, max_tokens=12, stop_strings=(stop,))
  pieces = list(engine.stream_text('hello', params))
  assert engine.finish_reason('0') == 'stop'
  assert ''.join(pieces) == full[:full.find(stop)] and stop not in ''.join(pieces)
