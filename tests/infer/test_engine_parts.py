"""The engine's parts alone: the input builder, the booking, the draw, the request side (on a
scheduler without a model), the runner with a policy of its own, and the speculative engine
as the same engine with another policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import (Engine, EngineStats, PageAllocator, SamplingBatch, SamplingParams,
                        Scheduler, SequenceState, SpeculativeEngine, engine_inputs,
                        init_paged_cache)
from qjax.infer.engine_booking import Booking, book
from qjax.infer.engine_programs import draw
from qjax.infer.engine_requests import Requests
from qjax.infer.engine_runner import Runner
from qjax.infer.engine_state import StepPlan
from qjax.nn import Transformer, TransformerConfig, greedy_generate
from qjax.nn.model_split import StaticGraphdef
from qjax.nn.validate import NON_FINITE

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _seq(rid, prompt, output=(), cached=0, pages=(), row=None, params=GREEDY):
  seq = SequenceState(rid, list(prompt), params.max_tokens, params, output=list(output),
                      num_cached=cached, pages=list(pages))
  seq.row = row
  return seq


def _scheduler(num_pages=16):
  return Scheduler(max_batch=2, chunk_size=4, page_size=4, max_pages=4, max_len=16,
                   allocator=PageAllocator(num_pages))


def test_build_packs_a_decode_beside_a_prompt_chunk():
  """Row 0 decodes its last token, row 1 feeds 3 prompt tokens: packed one after another into
  the smallest bucket, the rest padding (slot W)."""
  stop = SamplingParams(temperature=0.0, max_tokens=4, stop_tokens=(5, 6, 7))
  decode = _seq('a', [1, 2], output=[9], cached=2, pages=[3], row=0, params=stop)
  prompt = _seq('b', [4, 5, 6], pages=[7], row=1)
  buckets = engine_inputs.buckets(2, 4)
  assert buckets == ((2, 1, 0), (6, 4, 1), (8, 4, 2))
  x = engine_inputs.build([decode, prompt], [1, 3], max_pages=4, ring_width=0,
                          buckets_nwc=buckets, chunk_size=4)
  assert x.bucket == (6, 4, 1)
  assert x.tokens_M1[:, 0].tolist() == [9, 4, 5, 6, 0, 0]
  assert x.seq_of_M.tolist()[:4] == [0, 1, 1, 1] and x.slot_of_M.tolist() == [0, 0, 1, 2, 4, 4]
  assert x.last_B.tolist() == [0, 3]
  assert x.table_BE.tolist() == [[3, 0, 0, 0], [7, 0, 0, 0]]
  assert x.length_B.tolist() == [2, 0] and x.num_new_B.tolist() == [1, 3]
  assert x.tok_B.tolist() == [9, 6] and x.position_B.tolist() == [1, 0]
  assert x.stop_BZ.tolist() == [[5, 6, 7, -1], [-1, -1, -1, -1]]  # 3 stops: 4 columns
  assert x.params == [stop, GREEDY] and x.live_B.tolist() == [True, True]
  assert x.seen_BV is None


def test_build_leaves_idle_rows_as_padding_and_marks_seen_tokens_for_a_penalty():
  pen = SamplingParams(temperature=0.0, repetition_penalty=1.3)
  seq = _seq('a', [1, 2], output=[3], cached=2, pages=[1], row=1, params=pen)
  x = engine_inputs.build([None, seq], [0, 1], max_pages=2, ring_width=1, vocab=6)
  assert x.live_B.tolist() == [False, True] and x.params[0].temperature == 0
  assert x.seen_BV.tolist() == [[False] * 6, [False, True, True, True, False, False]]
  assert x.tokens_M1 is None  # not packed


def test_build_refuses_a_chunk_past_chunk_size():
  seq = _seq('a', range(8), pages=[1, 2], row=0)
  with pytest.raises(RuntimeError, match='feeds 8 tokens in one step, past chunk_size=4'):
    engine_inputs.build([seq], [8], max_pages=2, ring_width=0,
                        buckets_nwc=engine_inputs.buckets(1, 4), chunk_size=4)


def test_resident_sends_an_array_only_when_its_value_changes():
  res = engine_inputs.Resident()
  a = res.put('x', np.arange(3))
  assert res.put('x', np.arange(3)) is a and (res.sent, res.kept) == (1, 1)
  res.put('x', np.arange(1, 4))
  assert (res.sent, res.kept) == (2, 1)


def test_book_walks_results_in_step_order_and_ends_requests():
  """Two decoding rows, three results each: events come column by column; row 0 stops at
  its stop token (its later result is never read), row 1 fails at a non-finite one."""
  sched = _scheduler()
  stop = SamplingParams(temperature=0.0, max_tokens=8, stop_tokens=(42,))
  a = _seq('a', [1], output=[2], cached=1, pages=sched.allocator.alloc(1), row=0, params=stop)
  b = _seq('b', [1], output=[2], cached=1, pages=sched.allocator.alloc(1), row=1,
           params=SamplingParams(temperature=0.0, max_tokens=8))
  sched.running += [a, b]
  tok_BW = np.array([[10, 42, 11], [20, 21, NON_FINITE]])
  finished = lambda s: 'stop' if s.output[-1] in s.params.stop_tokens else None

  def done(seq):
    seq.finish_reason = finished(seq)
    return seq.finish_reason is not None

  events, cols = book(sched, [a, b], [1, 1], tok_BW, [3, 3], done)
  assert cols == 3
  assert events == [('a', 10), ('b', 20), ('a', 42), ('b', 21)]
  assert (a.finish_reason, b.finish_reason) == ('stop', 'error')
  assert a.num_cached == 3 and not sched.running
  assert sched.allocator.num_free == 15  # both released


def test_book_of_a_plain_step_caches_a_prompt_chunk_without_drawing():
  sched = _scheduler()
  seq = _seq('a', range(6), pages=sched.allocator.alloc(2), row=0)
  sched.running.append(seq)
  events, _ = book(sched, [seq], [4], np.array([[7]]), [1], lambda s: False)
  assert events == [] and seq.num_cached == 4 and seq.output == []
  events, _ = book(sched, [seq], [2], np.array([[7]]), [1], lambda s: False)
  assert events == [('a', 7)] and seq.output == [7]


def test_draw_greedy_rows_take_the_argmax_and_their_log_probability():
  logits_BV = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [jnp.nan, 0.0, 0.0]])
  params = SamplingBatch.stack([SamplingParams(temperature=0.0)] * 3)
  tok_B, lp_B = draw(logits_BV, params, jnp.zeros(3, jnp.int32))
  assert tok_B.tolist() == [1, 0, NON_FINITE]
  want = jax.nn.log_softmax(logits_BV[:2], axis=-1)[jnp.arange(2), tok_B[:2]]
  np.testing.assert_allclose(lp_B[:2], want, rtol=1e-5)
  mixed = SamplingBatch.stack([SamplingParams(temperature=0.0),
                               SamplingParams(temperature=1.0, seed=3),
                               SamplingParams(temperature=0.0)])
  assert draw(logits_BV, mixed, jnp.zeros(3, jnp.int32))[0][0] == 1  # greedy row, sampled path


def _requests(sched, token=7):
  """The request side over a scheduler whose every step draws `token` (no model)."""
  def finished(seq):
    seq.finish_reason = 'length' if len(seq.output) >= seq.max_tokens else None
    return seq.finish_reason is not None

  def step():
    plan = sched.schedule()
    return sched.complete(plan, [token] * len(plan.rows), finished)
  return Requests(sched, vocab_size=16, tokenizer=None, step=step,
                  busy=lambda: sched.has_work, settle=lambda: None)


def test_requests_queue_generate_and_cancel_on_a_scheduler_alone():
  sched = _scheduler()
  req = _requests(sched)
  assert req.generate([[1, 2], [3]], SamplingParams(temperature=0.0, max_tokens=3)) == [
      [7, 7, 7], [7, 7, 7]]
  rid = req.add_request([4, 5], SamplingParams(temperature=0.0, max_tokens=5))
  assert req.cancel(rid) and req.finish_reason(rid) == 'cancelled' and not req.cancel(rid)
  with pytest.raises(ValueError, match='token id 16 at index'):
    req.add_request([16])
  with pytest.raises(KeyError, match="no request with id 'x'"):
    req.output('x')
  assert sched.allocator.num_free == 15


def test_a_speculative_engine_is_the_engine_with_another_policy():
  assert SpeculativeEngine.step is Engine.step
  assert '_speculate' not in vars(SpeculativeEngine) and 'step' not in vars(SpeculativeEngine)


def test_step_plan_rows_are_sequence_states():
  plan = StepPlan([None, _seq('a', [1])], [0, 1])
  assert isinstance(plan.rows[1], SequenceState)


class _PlainSteps:
  """A decode policy that runs every plan as one packed step (the runner's whole interface)."""
  programs, queued = (), None

  def __init__(self, runner):
    self.runner, self.buckets = runner, []

  def run(self, plan):
    return self.runner.plain(plan)

  def drain(self, queue=True):
    raise AssertionError('nothing is ever queued')

  def feed(self, x):
    self.buckets.append(x.bucket)

  def timed(self, started, steps):
    pass

  def compile(self, params):
    pass

  def check(self, seq):
    pass


def test_a_runner_alone_with_a_plain_policy_gives_greedy_generation():
  """The runner, a scheduler and a booking, no `Engine`: packed steps of a 6-token prompt in
  chunks of 4 beside another request, then decodes, give each prompt's greedy tokens."""
  cfg = TransformerConfig.tiny(max_len=32)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  sched = Scheduler(max_batch=2, chunk_size=4, page_size=4, max_pages=8, max_len=32,
                    allocator=PageAllocator(20))
  stats = EngineStats()
  cache = init_paged_cache(cfg, num_pages=20, page_size=4, batch=2, max_pages=8)
  booking = Booking(sched, stats, None, page_size=4, max_len=32, ring_layers=cache.ring,
                    ring_span=0)
  graphdef, state = nnx.split(model)
  runner = Runner(StaticGraphdef(graphdef), state, cache, sched, booking, stats,
                  buckets=engine_inputs.buckets(2, 4), chunk_size=4, page_size=4, max_len=32,
                  max_pages=8, vocab=cfg.vocab_size)
  policy = _PlainSteps(runner)
  runner.use(policy)
  seqs = [SequenceState(str(i), prompt, 5, SamplingParams(temperature=0.0, max_tokens=5))
          for i, prompt in enumerate(([1, 2, 3, 4, 5, 6], [7, 8]))]
  for seq in seqs:
    sched.add(seq)
  while runner.busy:
    runner.step()
  for seq in seqs:
    want = greedy_generate(model, np.asarray([seq.prompt]), 5)[0, len(seq.prompt):]
    assert seq.output == np.asarray(want).tolist() and seq.finish_reason == 'length'
  assert policy.buckets[0] == (8, 4, 2) and stats.decode_tokens == 8
  assert sched.allocator.num_free == 19
