"""The engine's many-step decode: K steps per dispatch with the rows' state on the device.

When every running sequence decodes (no prompt chunk to feed, no stop string to check on
the host, no repetition penalty), `Engine` runs up to K = `EngineConfig.decode_block` decode
steps in one jitted `lax.while_loop` (`decode_block`): each step feeds every live row's
last token through the paged cache (the unpacked (B, 1) layout: row b's token is row b),
samples (`qjax.infer.sampling.sample`, or the argmax when every row is greedy), and ends a
row at a stop token, at its max_tokens or at a non-finite logit, all on the device. The host
reads the K tokens of every row once per block. With requests waiting for a row or pages,
the block also ends as soon as a row finishes, so admission is no later than step by step.

What the rows need on the device (block and ring tables, lengths, last tokens, output
positions, limits, stop tokens, sampling parameters) is kept there between dispatches by
`Resident`: the host rebuilds each array from its bookkeeping (cheap numpy) and sends it
only when its value differs from the one the device holds; in steady decode only a block
table that gained a page changes. A block needs pages for its K positions ahead
(`Scheduler.reserve_all`); where the pool cannot give them without preempting, the engine
runs one step instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer import paged
from qjax.infer.sampling import row_keys, sample
from qjax.nn import validate
from qjax.nn.generate import argmax_or_non_finite
from qjax.nn.model_split import merge

_TRACES = [0]  # how often `decode_block` was traced (= compiled), over every engine


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockRows:
  """The rows' decode state on the device (a pytree; row b is the engine's row b).

  Attributes:
    tok_B: int32, the last token of each row (fed by the next step).
    position_B: int32, each row's output count (the output index of the next token).
    max_B: int32, each row's max_tokens.
    stop_BS: int32, stop tokens per row padded with -1.
    live_B: bool, rows decoding (a free row, or one that finished, is not).
  """
  tok_B: jax.Array
  position_B: jax.Array
  max_B: jax.Array
  stop_BS: jax.Array
  live_B: jax.Array


def _draw(logits_BV, params, position_B):
  """Tokens and model log-probabilities as the single step draws them (`engine._step`)."""
  def greedy(x_BV):
    tok_B = argmax_or_non_finite(x_BV)
    lse_B = jax.nn.logsumexp(x_BV, axis=-1)
    return tok_B, jnp.take_along_axis(x_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B

  def draw(x_BV):
    tok_B, logprob_B = sample(x_BV, params, row_keys(params.seed_B, position_B))
    return validate.mark_non_finite(tok_B, x_BV), logprob_B
  return jax.lax.cond(jnp.all(params.temperature_B == 0), greedy, draw, logits_BV)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def decode_block(graphdef, state, cache, rows: BlockRows, params, block: int, stop_early):
  """Up to `block` decode steps of the live rows (module docstring); ends early when no row
  is live, or, with `stop_early`, once a row finished. Returns (cache, rows, tok_BK,
  logprob_BK, num_B): row b generated tok_BK[b, :num_B[b]]. The values of rows that are not
  live are never read (they may differ from what the host would build for an idle row)."""
  _TRACES[0] += 1  # runs only while tracing
  model = merge(graphdef, state)
  b = rows.tok_B.shape[0]

  def cond(c):
    i, _, rows, _, _, ended = c
    return (i < block) & jnp.any(rows.live_B) & ~(stop_early & ended)

  def body(c):
    i, cache, rows, tok_BK, lp_BK, ended = c
    live_B = rows.live_B
    cache = dataclasses.replace(cache, num_new=live_B.astype(jnp.int32))
    x_BTD, cache = paged.forward(model, rows.tok_B[:, None], cache)
    tok_B, lp_B = _draw(model.logits(x_BTD)[:, 0], params, rows.position_B)
    tok_B = jnp.where(live_B, tok_B, rows.tok_B)
    position_B = rows.position_B + live_B
    stop_B = (jnp.any(tok_B[:, None] == rows.stop_BS, axis=1) | (tok_B < 0) |
              (position_B >= rows.max_B))
    rows = dataclasses.replace(rows, tok_B=tok_B, position_B=position_B,
                               live_B=live_B & ~stop_B)
    ended = ended | jnp.any(live_B & stop_B)
    return (i + 1, cache, rows, tok_BK.at[:, i].set(tok_B), lp_BK.at[:, i].set(lp_B), ended)

  init = (jnp.int32(0), cache, rows, jnp.zeros((b, block), jnp.int32),
          jnp.zeros((b, block), jnp.float32), jnp.bool_(False))
  _, cache, out, tok_BK, lp_BK, _ = jax.lax.while_loop(cond, body, init)
  cache = dataclasses.replace(cache, num_new=jnp.zeros_like(cache.num_new))
  return cache, out, tok_BK, lp_BK, out.position_B - rows.position_B


class Resident:
  """Arrays kept on the device between steps with their host values: `put` sends an array
  only when its host value differs from what the device holds (or that array was donated)."""

  def __init__(self):
    self._held: dict[str, tuple[np.ndarray, jax.Array]] = {}
    self.sent = 0  # arrays copied host -> device
    self.kept = 0  # arrays reused from the device

  def put(self, name: str, host: np.ndarray) -> jax.Array:
    hit = self._held.get(name)
    if (hit is not None and hit[0].shape == host.shape and not hit[1].is_deleted()
        and np.array_equal(hit[0], host)):
      self.kept += 1
      return hit[1]
    dev = jnp.asarray(host)
    self._held[name] = (host, dev)
    self.sent += 1
    return dev

  def hold(self, name: str, host: np.ndarray, dev: jax.Array) -> None:
    """Record that the device holds `dev` whose value is `host` (a step's output)."""
    self._held[name] = (host, dev)


def stop_width(n: int) -> int:
  """Stop-token columns for n stop tokens: a power of two (few compilations), at least 1."""
  return 1 << max(n - 1, 0).bit_length()


def row_arrays(rows, max_pages: int, ring_width: int) -> dict[str, np.ndarray]:
  """The host values of a block's inputs for `rows` (a sequence or None per engine row)."""
  b = len(rows)
  width = stop_width(max([len(s.params.stop_tokens) for s in rows if s is not None] + [1]))
  out = dict(table=np.zeros((b, max_pages), np.int32), ring=np.zeros((b, ring_width), np.int32),
             length=np.zeros(b, np.int32), tok=np.zeros(b, np.int32),
             position=np.zeros(b, np.int32), max=np.zeros(b, np.int32),
             stop=np.full((b, width), -1, np.int32), live=np.zeros(b, bool))
  for row, seq in enumerate(rows):
    if seq is None:
      continue
    out['table'][row, :len(seq.pages)] = seq.pages
    out['ring'][row, :len(seq.ring_pages)] = seq.ring_pages
    out['length'][row], out['tok'][row] = seq.num_cached, seq.tokens[-1]
    out['position'][row], out['max'][row] = len(seq.output), seq.max_tokens
    out['stop'][row, :len(seq.params.stop_tokens)] = seq.params.stop_tokens
    out['live'][row] = True
  return out
