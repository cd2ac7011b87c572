"""The library's one decode loop: up to U steps in one `lax.while_loop` while a row is live.

Every decoder runs on `run_block`: greedy and sampled generation (`qjax.nn.generate`), the
serving engine's decode blocks (`qjax.infer.engine_block`), and speculative rounds
(`qjax.infer.spec_round`, alone or in the engine). A caller supplies the step (a model
forward and a token choice, or a draft-verify round) and the loop owns what is common to
all of them, on the device: which rows are live, each row's count, last token, stop tokens
and token limit, the tokens recorded for the host, and when to end.

A step may emit 1..X tokens per row (a speculative round emits up to gamma + 1). A row
ends after a stop token (kept; later tokens of the same step are dropped), after a negative
token (`validate.NON_FINITE`: the logits were not finite), or once it has no more than
`room` tokens left to generate. Rows that are not live still run (fixed shapes); their
outputs are discarded. Letters: U steps per block, X tokens a step may emit, W = U * X
token columns a block records per row, Z stop tokens per row (the columns of its stop table).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """The rows' decode state carried from one step (and dispatch) to the next: a pytree.

  Attributes:
    tok_B: int32, each row's last token (fed by the next step).
    count_B: int32, tokens each row has generated (the output index of its next token).
    max_B: int32, tokens each row may generate; a row stops when count_B reaches it.
    stop_BZ: int32, each row's stop tokens, padded with -1 (Z >= 1); a row stops after one.
    live_B: bool, rows still generating (a row also stops at a `NON_FINITE` token).
    carry: the step's pytree (sampling parameters, seen-token masks).
  """

  tok_B: jax.Array
  count_B: jax.Array
  max_B: jax.Array
  stop_BZ: jax.Array
  live_B: jax.Array
  carry: Any = ()

  @classmethod
  def start(cls, tok_B, max_B, *, count_B=None, stop_BZ=None, carry=()) -> 'LoopState':
    """The state of rows whose last token is tok_B: count 0 (or count_B), no stops (or
    stop_BZ), every row live that has a token left to generate."""
    tok_B = jnp.asarray(tok_B, jnp.int32)
    b = tok_B.shape[0]
    count_B = (jnp.zeros((b,), jnp.int32) if count_B is None else
               jnp.asarray(count_B, jnp.int32))
    max_B = jnp.broadcast_to(jnp.asarray(max_B, jnp.int32), (b,))
    stop_BZ = (jnp.full((b, 1), -1, jnp.int32) if stop_BZ is None else
               jnp.asarray(stop_BZ, jnp.int32))
    return cls(tok_B, count_B, max_B, stop_BZ, (count_B < max_B) & (tok_B >= 0), carry)


def stop_table(stop_tokens: Sequence[Sequence[int]]) -> np.ndarray:
  """stop_BZ: each row's stop tokens padded with -1 (at least one column)."""
  s = max([len(t) for t in stop_tokens] + [1])
  out = np.full((len(stop_tokens), s), -1, np.int32)
  for row, toks in enumerate(stop_tokens):
    out[row, :len(toks)] = toks
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
  """What one `run_block` produced (on the device).

  Attributes:
    state: the rows' `LoopState` after the block.
    tok_BW: row b generated tok_BW[b, :num_B[b]]; later columns hold its last token.
    extra_BW: a float per generated token (a log-probability, say); 0 in later columns.
    num_B: int32, tokens each row generated in the block.
    steps: int32, steps the loop ran (fewer than U once no row was live, or stop_early).
  """

  state: LoopState
  tok_BW: jax.Array
  extra_BW: jax.Array
  num_B: jax.Array
  steps: jax.Array


def _emit(state: LoopState, tok_BX, num_B):
  """(num_B, stopped_B): the tokens live rows emit (cut after the first stop or negative
  token among the step's num_B) and the rows that met one."""
  x = tok_BX.shape[1]
  j_X = jnp.arange(x)
  stop_BX = jnp.any(tok_BX[..., None] == state.stop_BZ[:, None, :], axis=-1) | (tok_BX < 0)
  first_B = jnp.min(jnp.where(stop_BX & (j_X < num_B[:, None]), j_X, x), axis=1)
  num_B = jnp.where(state.live_B, jnp.minimum(num_B, first_B + 1), 0)
  return num_B, state.live_B & (first_B < num_B)


def run_block(step: Callable[..., Any], state: LoopState, ctx: Any, block: int, *,
              width: int = 1, room: int = 0, stop_early=False) -> tuple[Decoded, Any]:
  """Up to `block` (U) steps of the live rows in one `lax.while_loop`; call it under jit.

  Args:
    step: `step(state, ctx) -> (tok_BX, extra_BX, num_B, carry, ctx)`, one step of every
      row: X = `width` tokens per row of which the first num_B (1..X) are emitted, a float
      per token, the state's new carry and the caller's new context (caches, statistics).
    state: the rows' `LoopState`.
    ctx: a pytree the step threads (the KV caches, sums it keeps).
    block: U, the most steps to run (static).
    width: X, the most tokens a step emits per row (static).
    room: a row stays live only while it has more than `room` tokens left to generate
      (max_B - count_B > room), so a step emitting up to room + 1 tokens never passes
      max_B; with 0, a multi-token step may emit past max_B (the caller cuts).
    stop_early: a bool (traced): end the block as soon as some row stopped.

  Returns:
    (decoded, ctx): the `Decoded` (tokens in W = U * X columns) and the step's last context.
  """
  b, w = state.tok_B.shape[0], block * width
  count0_B = state.count_B
  col_W = jnp.arange(w)

  def cond(c):
    i, _, state, _, _, ended = c
    return (i < block) & jnp.any(state.live_B) & ~(stop_early & ended)

  def body(c):
    i, ctx, state, tok_BW, extra_BW, ended = c
    tok_BX, extra_BX, num_B, carry, ctx = step(state, ctx)
    tok_BX, extra_BX = tok_BX.astype(jnp.int32), extra_BX.astype(jnp.float32)
    num_B, stopped_B = _emit(state, tok_BX, num_B.astype(jnp.int32))
    # Scatter-free writes: column w of row b takes the step's token w - offset_B[b].
    j_BW = col_W[None] - (state.count_B - count0_B)[:, None]
    put_BW = (j_BW >= 0) & (j_BW < num_B[:, None])
    j_BW = jnp.clip(j_BW, 0, width - 1)
    tok_BW = jnp.where(put_BW, jnp.take_along_axis(tok_BX, j_BW, axis=1), tok_BW)
    extra_BW = jnp.where(put_BW, jnp.take_along_axis(extra_BX, j_BW, axis=1), extra_BW)
    last_B = jnp.take_along_axis(tok_BX, jnp.maximum(num_B - 1, 0)[:, None], axis=1)[:, 0]
    count_B = state.count_B + num_B
    live_B = state.live_B & ~stopped_B & (state.max_B - count_B > room)
    new = dataclasses.replace(state, tok_B=jnp.where(num_B > 0, last_B, state.tok_B),
                              count_B=count_B, live_B=live_B, carry=carry)
    ended = ended | jnp.any(state.live_B & ~live_B)
    return i + 1, ctx, new, tok_BW, extra_BW, ended

  init = (jnp.int32(0), ctx, state, jnp.zeros((b, w), jnp.int32),
          jnp.zeros((b, w), jnp.float32), jnp.bool_(False))
  steps, ctx, state, tok_BW, extra_BW, _ = lax.while_loop(cond, body, init)
  num_B = state.count_B - count0_B
  after_BW = col_W[None] >= num_B[:, None]
  tok_BW = jnp.where(after_BW, state.tok_B[:, None], tok_BW)
  extra_BW = jnp.where(after_BW, 0.0, extra_BW)
  return Decoded(state, tok_BW, extra_BW, num_B, steps), ctx
