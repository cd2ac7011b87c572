"""Request traces, their replay (continuous / static batching), latency summaries, and the
side-by-side serving comparison on a tiny model."""

import numpy as np
import pytest
from flax import nnx

from qjax.infer import Engine, EngineConfig, SamplingParams
from qjax.pipeline import serving
from qjax.pipeline import trace as tr
from qjax.nn import Transformer, TransformerConfig

CFG = TransformerConfig.tiny(max_len=64, sliding_window=8, global_every=2)


def test_poisson_trace_matches_its_stated_distribution():
  system = [7, 8, 9]
  trace = tr.poisson_trace(num_requests=4000, rate=5.0, prompt_len=(2, 6), output_len=(1, 3),
                           system_prompt=system, shared_fraction=0.3, vocab_size=50, bos=1,
                           seed=1)
  gaps = np.diff([r.arrival for r in trace])
  assert trace[0].arrival == 0 and (gaps >= 0).all()
  # Exponential gaps: mean 1/rate, sd 1/rate; the mean of 3999 is within 4 sigma.
  assert abs(gaps.mean() - 0.2) < 4 * 0.2 / np.sqrt(len(gaps))
  assert abs(np.mean(gaps > 0.2) - np.exp(-1)) < 0.03  # P(gap > 1/rate) = 1/e
  shared = np.array([r.shared for r in trace])
  assert abs(shared.mean() - 0.3) < 4 * np.sqrt(0.3 * 0.7 / len(trace))
  for r in trace[:200]:
    own = len(r.prompt) - 1 - (3 if r.shared else 0)
    assert r.prompt[0] == 1 and 2 <= own <= 6 and 1 <= r.max_tokens <= 3
    assert (list(r.prompt[1:4]) == system) == r.shared or not r.shared
  assert {r.max_tokens for r in trace} == {1, 2, 3}
  tail = [r.max_tokens for r in tr.poisson_trace(
      num_requests=4000, rate=1.0, prompt_len=(1, 1), output_len=(1, 64), vocab_size=5,
      output_dist='loguniform', seed=2)]
  # P(length <= k) = log(k + 1) / log(65): P(1) = 0.166, P(<= 7) = 0.498; 4-sigma bounds.
  assert min(tail) == 1 and max(tail) <= 64
  assert abs(np.mean(np.array(tail) == 1) - np.log(2) / np.log(65)) < 4 * 0.0059
  assert abs(np.mean(np.array(tail) <= 7) - np.log(8) / np.log(65)) < 4 * 0.0079
  source = list(range(100, 140))
  windows = tr.poisson_trace(num_requests=5, rate=1.0, prompt_len=(4, 4), output_len=(1, 1),
                             token_source=source)
  for r in windows:  # consecutive corpus tokens
    assert np.all(np.diff(r.prompt) == 1) and r.prompt[0] >= 100


def test_bad_trace_parameters_raise():
  kw = dict(num_requests=2, prompt_len=(1, 2), output_len=(1, 2), vocab_size=10)
  with pytest.raises(ValueError, match='rate=0 must be > 0'):
    tr.poisson_trace(rate=0, **kw)
  with pytest.raises(ValueError, match='shared_fraction=1.5 must be in'):
    tr.poisson_trace(rate=1, shared_fraction=1.5, **kw)
  with pytest.raises(ValueError, match=r'prompt_len=\(3, 2\) must satisfy'):
    tr.poisson_trace(rate=1, **{**kw, 'prompt_len': (3, 2)})
  with pytest.raises(ValueError, match="output_dist='zipf' is unknown"):
    tr.poisson_trace(rate=1, output_dist='zipf', **kw)
  with pytest.raises(ValueError, match='exactly one of vocab_size'):
    tr.poisson_trace(rate=1, token_source=[1, 2, 3], **kw)


def test_summary_percentiles_and_throughput_are_exact_on_a_hand_made_replay():
  trace = [tr.TraceRequest('a', 0.0, (1,), 3, True), tr.TraceRequest('b', 1.0, (1,), 2, False)]
  times = {'a': [0.5, 0.7, 1.0], 'b': [1.2, 1.3]}
  s = tr.summarize(trace, times, busy_seconds=1.0)
  assert s['tokens'] == 5 and s['seconds'] == pytest.approx(1.3)
  assert s['tokens_per_s'] == pytest.approx(5 / 1.3) and s['tokens_per_busy_s'] == 5
  # TTFT [0.5, 0.2]; ITL [0.2, 0.3, 0.1] (numpy's linear interpolation).
  assert s['ttft_p50'] == pytest.approx(0.35) and s['ttft_p99'] == pytest.approx(0.497)
  assert s['itl_p50'] == pytest.approx(0.2) and s['itl_p90'] == pytest.approx(0.28)
  assert s['ttft_shared_mean'] == pytest.approx(0.5)
  assert s['ttft_unshared_mean'] == pytest.approx(0.2)
  with pytest.raises(RuntimeError, match=r"requests \['b'\] did not get all their tokens"):
    tr.summarize(trace, {'a': times['a'], 'b': [1.2]})


def test_page_bytes_and_same_bytes_capacity_follow_the_format_sizes():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  ecfg = EngineConfig(page_size=4, ring=False)
  # 2 layers x (k, v) x 4 slots x 2 kv heads x 32 features: f32 4 B; int8 1 B + one f32
  # scale per slot and head; int4 two codes per byte + the scale.
  assert serving.page_bytes(model, ecfg, None) == 2 * 2 * 4 * 2 * 32 * 4
  assert serving.page_bytes(model, ecfg, 'int8') == 2 * 2 * 4 * 2 * (32 + 4)
  assert serving.page_bytes(model, ecfg, 'int4') == 2 * 2 * 4 * 2 * (16 + 4)


def test_replays_continuous_static_and_prefix_caching_side_by_side():
  """Continuous batching gives the engine's tokens (== greedy alone, test_engine) and the same
  tokens with prefix caching (which computes fewer prefill tokens); static batching pads and
  runs every batch to its longest output, so it computes more for the same useful tokens.
  One T bucket (chunk_size=1): one compilation."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  trace = tr.poisson_trace(num_requests=6, rate=1000.0, prompt_len=(2, 9), output_len=(2, 6),
                           system_prompt=list(range(20, 36)), shared_fraction=0.6,
                           vocab_size=CFG.vocab_size, seed=2)
  ecfg = EngineConfig(max_batch=3, page_size=4, num_pages=1 + 3 * 8, chunk_size=1,
                      max_len=64, ring=False)
  rows = {r['variant']: r for r in serving.compare(model, trace, ecfg,
                                                   ('continuous', 'static', 'prefix'),
                                                   log=lambda r: None)}
  cont, static, prefix = rows['continuous'], rows['static'], rows['prefix']
  engine = Engine(model, ecfg)
  want = engine.generate([list(r.prompt) for r in trace],
                         [SamplingParams(temperature=0.0, max_tokens=r.max_tokens) for r in trace])
  assert [cont['outputs'][r.id] for r in trace] == want
  assert prefix['outputs'] == cont['outputs']
  assert prefix['prefix_hit_rate'] > 0 and prefix['prefill_tokens'] < cont['prefill_tokens']
  assert static['prefill_tokens'] > cont['prefill_tokens']  # left padding
  assert static['steps'] > cont['steps']  # every batch runs to its longest output
  # the paged pool wastes only partly filled pages, the contiguous layout max_len per request
  assert 0 <= cont['paged_waste'] < cont['contiguous_waste'] < 1
  for row in rows.values():
    assert row['tokens'] == sum(r.max_tokens for r in trace) and row['compilations'] == 0
    assert 0 <= row['ttft_p50'] <= row['ttft_p90'] <= row['ttft_p99']
    # A block of decode steps returns its tokens together: within it the gaps are 0.
    assert row['itl_p99'] > 0 and row['peak_running'] <= 3
  ratios = serving.ratios(list(rows.values()))
  assert ratios['outputs identical with prefix caching'] is True
  assert ratios['steps static / continuous'] == static['steps'] / cont['steps'] > 1
  # two traces served one after another: tokens and busy seconds add up
  assert serving.pooled_throughput([cont, static]) == pytest.approx(
      2 * cont['tokens'] / (cont['seconds'] + static['seconds']))
  with pytest.raises(ValueError, match=r"variants \['fast'\] are unknown"):
    serving.compare(model, trace, ecfg, ('fast',))
  with pytest.raises(ValueError, match='pass EngineConfig\\(ring=False\\)'):
    serving.compare(model, trace, EngineConfig(), ('continuous',))


def test_prefix_hit_ttft_counts_exactly_the_requests_that_hit():
  """Requests far apart: every system-prompt request but the first finds its pages cached,
  the first misses and requests without it never hit. The hit-TTFT column averages exactly
  those requests, in the prefix row and (the same requests) in the row without caching."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  trace = tr.poisson_trace(num_requests=6, rate=0.01, prompt_len=(2, 9), output_len=(2, 3),
                           system_prompt=list(range(20, 36)), shared_fraction=0.6,
                           vocab_size=CFG.vocab_size, seed=0)  # misses first
  shared = [r.id for r in trace if r.shared]
  assert len(shared) >= 3 and len(shared) < len(trace)
  ecfg = EngineConfig(max_batch=3, page_size=4, num_pages=1 + 3 * 8, chunk_size=1,
                      max_len=64, ring=False)
  rows = {r['variant']: r for r in serving.compare(model, trace, ecfg, ('continuous', 'prefix'),
                                                   log=lambda r: None)}
  cont, prefix = rows['continuous'], rows['prefix']
  hits = sorted(i for i, n in prefix['prefix_hits'].items() if n > 0)
  assert hits == sorted(shared[1:])
  assert all(prefix['prefix_hits'][i] == 16 for i in hits)  # the 4 system-prompt pages
  assert prefix['prefix_hit_requests'] == len(shared) - 1 and cont['prefix_hit_requests'] == 0
  for row in (cont, prefix):
    assert row['ttft_hits_of_prefix_row'] == pytest.approx(
        np.mean([row['ttft_by_request'][i] for i in hits]))
  assert prefix['ttft_hit_mean'] == pytest.approx(prefix['ttft_hits_of_prefix_row'])
  key = f'TTFT of prefix-hit requests ({len(hits)}), no prefix caching / prefix caching'
  assert serving.ratios(list(rows.values()))[key] == pytest.approx(
      cont['ttft_hits_of_prefix_row'] / prefix['ttft_hits_of_prefix_row'])
