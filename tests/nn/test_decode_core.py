"""`decode_core.run_block`, the one decode loop, driven by scripted steps (no model): stop
tokens, token limits, non-finite tokens, early stops and multi-token steps end rows on the
device, and the tokens do not depend on the steps per dispatch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.nn import decode_core
from qjax.nn.decode_core import LoopState


def _scripted(tok_BUX, num_BU=None):
  """A step that emits tok_BUX[:, i] (num_BU[:, i] of them, default all) at step i; the
  context counts steps and the extra of a token is its step index."""
  tok_BUX = jnp.asarray(tok_BUX, jnp.int32)
  if tok_BUX.ndim == 2:
    tok_BUX = tok_BUX[..., None]
  b, _, x = tok_BUX.shape
  num_BU = (jnp.full(tok_BUX.shape[:2], x, jnp.int32) if num_BU is None else
            jnp.asarray(num_BU, jnp.int32))

  def step(state, i):
    extra_BX = jnp.full((b, x), i, jnp.float32)
    return tok_BUX[:, i], extra_BX, num_BU[:, i], state.carry, i + 1
  return step


@functools.partial(jax.jit, static_argnums=(0, 3), static_argnames=('width', 'room'))
def _run(step, state, ctx, block, **kw):
  return decode_core.run_block(step, state, ctx, block, **kw)


def _rows(out):
  return [out.tok_BW[b, :n].tolist() for b, n in enumerate(np.asarray(out.num_B))]


def _all_blocks(step, state, block, **kw):
  """Run blocks until no row is live; each row's tokens and extras, and the dispatches."""
  rows, extras, ctx, dispatches = None, None, jnp.int32(0), 0
  while bool(np.any(state.live_B)):
    out, ctx = _run(step, state, ctx, block, **kw)
    dispatches += 1
    state = out.state
    got = [(out.tok_BW[b, :n].tolist(), out.extra_BW[b, :n].tolist())
           for b, n in enumerate(np.asarray(out.num_B))]
    rows = [t for t, _ in got] if rows is None else [r + t for r, (t, _) in zip(rows, got)]
    extras = ([e for _, e in got] if extras is None else
              [r + e for r, (_, e) in zip(extras, got)])
  return rows, extras, state, dispatches


STREAM = np.arange(10, 42).reshape(2, 16)  # row 0: 10, 11, ...; row 1: 26, 27, ...


def test_stop_tokens_and_token_limits_end_rows_keeping_the_stop_token():
  state = LoopState.start([1, 2], [16, 9], stop_BZ=decode_core.stop_table([[14, 99], []]))
  out, ctx = _run(_scripted(STREAM), state, jnp.int32(0), 16)
  assert _rows(out) == [[10, 11, 12, 13, 14], list(range(26, 35))]
  np.testing.assert_array_equal(out.num_B, [5, 9])
  np.testing.assert_array_equal(out.state.count_B, [5, 9])
  np.testing.assert_array_equal(out.state.tok_B, [14, 34])
  assert not np.asarray(out.state.live_B).any()
  assert int(out.steps) == int(ctx) == 9  # ended early: no row live after step 9
  # Past its count a row repeats its last token, with extra 0.
  np.testing.assert_array_equal(out.tok_BW[0, 5:], 14)
  np.testing.assert_array_equal(out.extra_BW[0, 5:], 0)
  np.testing.assert_array_equal(out.extra_BW[1, :9], np.arange(9))


def test_a_negative_token_ends_its_row_and_rows_not_live_do_not_run():
  tok = STREAM.copy()
  tok[1, 3] = -1  # NON_FINITE
  state = LoopState.start([1, -1], [6, 6])  # row 1 is not live: its last token is -1
  assert np.asarray(state.live_B).tolist() == [True, False]
  out, _ = _run(_scripted(tok), state, jnp.int32(0), 8)
  assert _rows(out) == [list(range(10, 16)), []]
  state = LoopState.start([1, 2], [6, 6])
  out, _ = _run(_scripted(tok), state, jnp.int32(0), 8)
  assert _rows(out) == [list(range(10, 16)), [26, 27, 28, -1]]
  np.testing.assert_array_equal(out.state.live_B, [False, False])


def test_stop_early_ends_the_block_once_a_row_stopped():
  state = LoopState.start([1, 2], [16, 3])
  out, _ = _run(_scripted(STREAM), state, jnp.int32(0), 8, stop_early=jnp.bool_(True))
  assert int(out.steps) == 3 and _rows(out) == [[10, 11, 12], [26, 27, 28]]
  assert np.asarray(out.state.live_B).tolist() == [True, False]
  out, _ = _run(_scripted(STREAM), state, jnp.int32(0), 8, stop_early=jnp.bool_(False))
  assert int(out.steps) == 8 and _rows(out)[0] == list(range(10, 18))


def test_multi_token_steps_emit_num_tokens_cut_after_a_stop_token():
  tok_BUX = np.arange(100, 100 + 2 * 6 * 3).reshape(2, 6, 3)
  num_BU = [[1, 3, 2, 3, 1, 2], [3, 3, 3, 3, 3, 3]]
  tok_BUX[1, 1, 1] = 7  # row 1's stop token, mid-step: the third token is dropped
  state = LoopState.start([0, 0], [30, 30], stop_BZ=[[-1], [7]])
  out, _ = _run(_scripted(tok_BUX, num_BU), state, jnp.int32(0), 6, width=3)
  assert out.tok_BW.shape == (2, 18)
  want0 = [t for i, n in enumerate(num_BU[0]) for t in tok_BUX[0, i, :n].tolist()]
  assert _rows(out) == [want0, [118, 119, 120, 121, 7]]
  np.testing.assert_array_equal(out.num_B, [12, 5])
  np.testing.assert_array_equal(out.extra_BW[1, :5], [0, 0, 0, 1, 1])


def test_room_keeps_multi_token_steps_within_the_limit():
  tok_BUX = np.arange(100, 100 + 2 * 6 * 3).reshape(2, 6, 3)
  state = LoopState.start([0, 0], [7, 10])
  out, _ = _run(_scripted(tok_BUX), state, jnp.int32(0), 6, width=3)
  np.testing.assert_array_equal(out.num_B, [9, 12])  # room 0: the last step passes max_B
  out, _ = _run(_scripted(tok_BUX), state, jnp.int32(0), 6, width=3, room=2)
  np.testing.assert_array_equal(out.num_B, [6, 9])  # a row stops with <= 2 tokens left
  assert not np.asarray(out.state.live_B).any()


@pytest.mark.parametrize('width', [1, 3])
def test_one_step_per_dispatch_equals_eight(width):
  tok_BUX = np.arange(2 * 16 * width).reshape(2, 16, width) + 10
  num_BU = np.random.default_rng(0).integers(1, width + 1, (2, 16))
  stop = int(tok_BUX[1, 9, 0])
  step = _scripted(tok_BUX, num_BU)
  state = LoopState.start([0, 0], [13, 40], stop_BZ=[[-1], [stop]])
  one = _all_blocks(step, state, 1, width=width)
  eight = _all_blocks(step, state, 8, width=width)
  assert one[0] == eight[0] and one[1] == eight[1]
  np.testing.assert_array_equal(one[2].count_B, eight[2].count_B)
  np.testing.assert_array_equal(one[2].tok_B, eight[2].tok_B)
  assert eight[0][1][-1] == stop and eight[3] < one[3]
