"""One request's failure ends that request only: a request whose activations turn NaN ends
with 'error', and its batch-mates and the requests after it get `greedy_generate`'s tokens
(attention masks select, so a slot a request cannot see never reaches its output)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from qjax.infer import (Engine, EngineConfig, GenerationError, SamplingParams,
                        SpeculativeEngine)
from qjax.nn import Transformer, TransformerConfig, greedy_generate
from qjax.nn.attention import attend, attend_blockwise

# An untied model whose embedding row BAD is NaN: a prompt holding BAD turns NaN, while the
# head (a separate table) stays finite, so healthy requests never see NaN of their own.
CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=32, tie_embeddings=False)
BAD = 7
MODEL = Transformer(CFG, rngs=nnx.Rngs(0))
_w = MODEL.embed.w
_w.set_value(_w.get_value().at[BAD].set(jnp.nan))
MAX_TOKENS = 6


def _draft():
  """The target with head row BAD set to 1.5 times the row of a token the target often
  picks: the draft proposes the NaN token where the target picks that one."""
  draft = nnx.clone(MODEL)
  first = _greedy(tuple(range(8, 16)), MAX_TOKENS)[0]
  head = draft.lm_head.w
  w = head.get_value()
  head.set_value(w.at[BAD].set(1.5 * w[first]) if w.shape[0] == CFG.vocab_size else
                 w.at[:, BAD].set(1.5 * w[:, first]))
  return draft


@functools.lru_cache(maxsize=None)
def _greedy(prompt: tuple, n: int) -> list:
  out = greedy_generate(MODEL, np.asarray([prompt], np.int32), n)
  return np.asarray(out)[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def _speculative_draft():
  return _draft()


def _healthy(seed: int, length: int) -> tuple:
  rng = np.random.default_rng(seed)
  return tuple(int(t) for t in rng.choice([v for v in range(CFG.vocab_size) if v != BAD],
                                          length))


def _serve(engine, requests):
  """Runs (prompt, max_tokens, arrives_after_steps) requests; returns their ids."""
  ids, steps = {}, 0
  pending = sorted(enumerate(requests), key=lambda r: r[1][2])
  while pending or engine.scheduler.has_work:
    while pending and pending[0][1][2] <= steps:
      i, (prompt, n, _) = pending.pop(0)
      ids[i] = engine.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=n))
    engine.step()
    steps += 1
    assert steps < 400, 'the engine did not finish'
  return [ids[i] for i in range(len(requests))]


def _check(engine, requests, ids):
  for (prompt, n, _), rid in zip(requests, ids):
    if BAD in prompt:
      assert engine.finish_reason(rid) == 'error', (prompt, engine.output(rid))
      assert engine.output(rid) == []
    else:
      assert engine.finish_reason(rid) == 'length', (prompt, engine.error(rid))
      assert engine.output(rid) == _greedy(tuple(prompt), n), prompt
  held = len(engine.prefix_cache) if engine.prefix_cache is not None else 0
  assert engine.allocator.num_free == engine.config.num_pages - 1 - held


def _engine(kind, **config):
  config = EngineConfig(**config, max_len=CFG.max_len, admit_within_s=None)
  if kind == 'speculative':
    return SpeculativeEngine(MODEL, _speculative_draft(), config, gamma=2)
  return Engine(MODEL, config)


VARIANTS = {
    'max_batch=2': dict(max_batch=2),
    'max_batch=4': dict(max_batch=4),
    'decode_block=1': dict(max_batch=2, decode_block=1),
    'prefix_caching': dict(max_batch=3, prefix_caching=True),
    'swap': dict(max_batch=2, preemption='swap'),
    'max_batch=1': dict(max_batch=1),
}


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_a_nan_request_ends_alone(variant):
  # A NaN request between two healthy ones, a NaN one joining while they decode, then two
  # healthy requests after it on pages it freed (its NaN keys and values may be left there).
  a, b, c = _healthy(0, 5), _healthy(1, 3), _healthy(2, 2)
  bad = (3, BAD, 8, 9, 10, 11, 12, 13)
  requests = [(a, MAX_TOKENS, 0), (bad, MAX_TOKENS, 0), (b, MAX_TOKENS, 0),
              (bad[:3], MAX_TOKENS, 3), (c, MAX_TOKENS, 12), (a[:2], MAX_TOKENS, 14)]
  engine = _engine('engine', page_size=4, num_pages=24, chunk_size=8, **VARIANTS[variant])
  _check(engine, requests, _serve(engine, requests))


@pytest.mark.parametrize('prefix_caching', [False, True])
def test_a_nan_request_leaves_no_poison_in_the_page_pool(prefix_caching):
  # One row: the NaN request fills two pages with NaN; the next request gets them back and
  # attends over their slots past its length, which the mask must select away.
  engine = _engine('engine', max_batch=1, page_size=4, num_pages=4, chunk_size=8,
                   prefix_caching=prefix_caching)
  requests = [((BAD,) + _healthy(3, 7), 2, 0), (_healthy(4, 2), MAX_TOKENS, 0)]
  _check(engine, requests, _serve(engine, requests))


def test_the_speculative_engine_goes_on_when_the_draft_proposes_a_nan_token():
  # The draft proposes BAD where the target would pick another token: the target's logits
  # after that proposal are NaN, but the target rejects it, so the request goes on.
  engine = _engine('speculative', max_batch=2, page_size=4, num_pages=24, chunk_size=8)
  prompt = _healthy(93, 8)  # the draft proposes BAD as its third token
  requests = [(prompt, MAX_TOKENS, 0), ((BAD,) + prompt, MAX_TOKENS, 0)]
  _check(engine, requests, _serve(engine, requests))
  assert engine.spec_stats.rounds > 0


_prompt = st.tuples(st.integers(0, 2 ** 16), st.integers(1, 12), st.booleans(),
                    st.integers(1, MAX_TOKENS), st.integers(0, 6))


# The engine's decode blocks (decode_block > 1) with both preemption modes and prefix caching,
# always (the generated mixes draw blocks only with the speculative engine, which has none);
# 2 fixed mixes and 12 drawn ones.
@example(mix=[(1, 5, False, 6, 0), (2, 4, True, 6, 1), (3, 3, False, 5, 2)], page_size=4,
         spare_pages=0, max_batch=2, chunk_size=8, prefix_caching=True, preemption='swap',
         decode_block=4, kind='engine')
@example(mix=[(4, 2, True, 3, 0), (5, 6, False, 6, 0), (6, 2, False, 6, 3)], page_size=2,
         spare_pages=1, max_batch=3, chunk_size=2, prefix_caching=False,
         preemption='recompute', decode_block=4, kind='engine')
@settings(max_examples=12, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate])
@given(mix=st.lists(_prompt, min_size=2, max_size=4), page_size=st.sampled_from([2, 4]),
       spare_pages=st.integers(0, 3), max_batch=st.integers(1, 3),
       chunk_size=st.sampled_from([2, 8]), prefix_caching=st.booleans(),
       preemption=st.sampled_from(['recompute', 'swap']), decode_block=st.sampled_from([1, 4]),
       kind=st.sampled_from(['engine', 'speculative']))
def test_every_mix_with_nan_requests_gives_healthy_requests_greedy_outputs(
    mix, page_size, spare_pages, max_batch, chunk_size, prefix_caching, preemption,
    decode_block, kind):
  requests = []
  for seed, length, bad, n, arrives in mix:
    prompt = _healthy(seed, length)
    if bad:  # BAD somewhere in the prompt
      at = seed % length
      prompt = prompt[:at] + (BAD,) + prompt[at + 1:]
    requests.append((prompt, n, arrives))
  largest = max(-(-(len(p) + n - 1) // page_size) for p, n, _ in requests)
  if kind == 'speculative':
    preemption = 'recompute'
  engine = _engine(kind, max_batch=max_batch, page_size=page_size,
                   num_pages=largest + 1 + spare_pages + (2 if kind == 'speculative' else 0),
                   chunk_size=chunk_size, prefix_caching=prefix_caching,
                   preemption=preemption, decode_block=decode_block)
  _check(engine, requests, _serve(engine, requests))


@pytest.mark.parametrize('blockwise', [False, True])
def test_a_masked_nan_value_never_reaches_the_output(blockwise):
  # Slot 3 is after the query (masked) and holds NaN: the output is that of slots 0..2.
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 2, 4)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 4, 1, 4)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, 4, 1, 4)), jnp.float32)
  fn = functools.partial(attend_blockwise, block_size=2) if blockwise else attend
  pos_q, pos_k = jnp.asarray([[2]]), jnp.arange(4)[None]
  want = fn(q, k[:, :3], v[:, :3], pos_q, pos_k[:, :3])
  got = fn(q, k.at[0, 3].set(jnp.nan), v.at[0, 3].set(jnp.nan), pos_q, pos_k)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_generate_raises_naming_the_failed_prompt_and_keeps_every_output():
  engine = _engine('engine', max_batch=2, page_size=4, num_pages=24, chunk_size=8)
  a = _healthy(5, 4)
  with pytest.raises(GenerationError, match=r'1 of 2 prompts failed \(prompt indices \[1\]\); '
                                            r'prompt 1: request 1: the logits') as info:
    engine.generate([list(a), [1, BAD, 2]], SamplingParams(temperature=0, max_tokens=4))
  err = info.value
  assert err.outputs == [_greedy(a, 4), []]
  assert err.finish_reasons == ['length', 'error'] and err.errors[0] is None
  assert err.request_ids == ['0', '1'] and 'not finite' in err.errors[1]
  assert isinstance(err, FloatingPointError)


def test_cancel_ends_a_request_and_frees_its_pages():
  engine = _engine('engine', max_batch=1, page_size=4, num_pages=24, chunk_size=8)
  running = engine.add_request(list(_healthy(6, 5)), SamplingParams(temperature=0, max_tokens=20))
  waiting = engine.add_request(list(_healthy(7, 5)), SamplingParams(temperature=0, max_tokens=3))
  engine.step()
  engine.step()
  assert engine.cancel(running) and engine.finish_reason(running) == 'cancelled'
  assert len(engine.output(running)) >= 1
  assert not engine.cancel(running)  # already finished
  for _ in engine.run():
    pass
  assert engine.output(waiting) == _greedy(_healthy(7, 5), 3)
  assert engine.allocator.num_free == engine.config.num_pages - 1
  assert engine.cancel(engine.add_request([1, 2])) and not engine.scheduler.has_work


def test_cancel_while_a_decode_block_is_queued_on_the_device():
  engine = _engine('engine', max_batch=2, page_size=4, num_pages=40, chunk_size=8,
                   decode_block=2)
  keep, drop = _healthy(8, 3), _healthy(9, 3)
  ids = [engine.add_request(list(p), SamplingParams(temperature=0, max_tokens=16))
         for p in (keep, drop)]
  while engine.policy.queued is None:
    engine.step()
    assert engine.scheduler.has_work, 'no block was queued'
  engine.cancel(ids[1])
  for _ in engine.run():
    pass
  assert engine.output(ids[0]) == _greedy(keep, 16)
  assert engine.output(ids[1]) == _greedy(drop, 16)[:len(engine.output(ids[1]))]
  assert engine.allocator.num_free == engine.config.num_pages - 1


def test_an_abandoned_stream_does_not_run_in_the_next_generate():
  engine = _engine('engine', max_batch=2, page_size=4, num_pages=24, chunk_size=8)
  events = engine.stream([list(_healthy(10, 4))], SamplingParams(temperature=0, max_tokens=20))
  next(events)
  del events  # abandoned after one token
  before = engine.stats.steps
  out = engine.generate([list(_healthy(11, 3))], SamplingParams(temperature=0, max_tokens=2))
  assert out == [_greedy(_healthy(11, 3), 2)]
  assert engine.finish_reason('0') == 'cancelled'
  assert engine.stats.steps - before <= 2  # only its own steps


@pytest.mark.parametrize('backend', ['triton', 'mosaic'])
@pytest.mark.parametrize('ring', [False, True])
def test_the_paged_kernel_selects_too(backend, ring):
  # Row 0 sits at position 5 of pages [1, 2] (P = 4): slots 6 and 7 hold a stale NaN.
  from qjax.kernels import paged_attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(3, 4, 1, 8)), jnp.float32) for _ in range(2))
  call = functools.partial(paged_attention.paged_attention, page_table=jnp.asarray([[1, 2]]),
                           q_pos_B=jnp.asarray([5]), last_B=jnp.asarray([5]), ring=ring,
                           backend=backend, interpret=True)
  want = call(q, k, v)
  got = call(q, k.at[2, 2:].set(jnp.nan), v.at[2, 2:].set(jnp.nan))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
  assert np.isnan(np.asarray(call(q, k, v.at[2, 1].set(jnp.nan)))).all()  # a slot it sees
