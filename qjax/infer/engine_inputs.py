"""A dispatch's device inputs, built on the host from the scheduler's rows.

One builder (`build`) serves the plain step, the decode block and the speculative round:
every engine row b gets its block and ring tables, the positions it has cached, the tokens
it feeds, its last token, its next output index (the sampler's stream position), its token
limit, stop tokens and sampling parameters. A plain step also packs the fed tokens
(`qjax.infer.engine` module docstring): each row's tokens after another's, with the row
(`seq_of`) and slot (`slot_of`) of every packed token, each row's last token (`last_B`), the
bucket (M, T, C) whose compiled step fits them and, when a request asks for a repetition
penalty, the tokens each row has seen (`seen_BV`).

`Resident` keeps arrays on the device between dispatches and sends one only when its host
value changed; `SamplingCache` keeps the device copy of a mix of sampling parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qjax.infer import page_host
from qjax.infer.sampling import SamplingBatch, SamplingParams

GREEDY = SamplingParams(temperature=0.0)  # the parameters of a row that feeds nothing


def buckets(max_batch: int, chunk: int) -> tuple[tuple[int, int, int], ...]:
  """(M, T, C) of every step shape (`qjax.infer.engine`): M packed tokens, at most C rows
  feeding more than one token, at most T tokens each. Decodes alone: (max_batch, 1, 0).
  Beside prompt tokens: max_batch + chunk // 2 tokens with one such row (chunks of 16 and
  more: a short prompt or a prefix hit's rest need not pay for a whole chunk), max_batch +
  k chunks with k rows (k = 1, 2, 4, ...), and max_batch * chunk tokens with every row (the
  most a step can feed); T = min(chunk, M)."""
  shapes, k = {(max_batch * chunk, max_batch)}, 1
  if chunk >= 16:
    shapes.add((max_batch + chunk // 2, 1))
  while max_batch + k * chunk < max_batch * chunk:
    shapes.add((max_batch + k * chunk, min(k, max_batch)))
    k *= 2
  return ((max_batch, 1, 0),) + tuple((n, min(chunk, n), c) for n, c in sorted(shapes)
                                      if n > max_batch)


def stop_width(n: int) -> int:
  """Stop-token columns for n stop tokens: a power of two (few compilations), at least 1."""
  return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class StepInputs:
  """Host values of one dispatch's inputs (B engine rows; the packed fields for a plain
  step only). A row is live when it feeds tokens; the others are padding."""
  table_BE: np.ndarray  # page table (pages in logical order)
  ring_BE: np.ndarray  # ring pages (sliding-window layers)
  length_B: np.ndarray  # positions cached before the dispatch
  num_new_B: np.ndarray  # tokens fed
  tok_B: np.ndarray  # the last known token (a decode's input)
  position_B: np.ndarray  # index of the next output token (the sampler's stream position)
  max_B: np.ndarray  # max_tokens
  stop_BZ: np.ndarray  # stop tokens, -1 padded
  live_B: np.ndarray
  params: list  # SamplingParams per row (`GREEDY` where not live)
  tokens_M1: Optional[np.ndarray] = None  # packed: the fed tokens
  seq_of_M: Optional[np.ndarray] = None  # packed: each token's row
  slot_of_M: Optional[np.ndarray] = None  # packed: each token's place in its row (T: padding)
  last_B: Optional[np.ndarray] = None  # packed: each row's last token's index
  bucket: Optional[tuple[int, int, int]] = None  # packed: (M, T, C)
  seen_BV: Optional[np.ndarray] = None  # tokens seen, when a live row has a penalty

  def layout(self) -> dict:
    """The cache layout of a packed step (`paged.with_step`'s arguments)."""
    _, w, c = self.bucket
    return dict(page_table=self.table_BE, ring_table=self.ring_BE, length=self.length_B,
                num_new=self.num_new_B, seq_of=self.seq_of_M, slot_of=self.slot_of_M,
                att_width=w, att_wide=c)

  def loop(self) -> dict:
    """The rows' loop state (`decode_core.LoopState` fields) as host arrays."""
    return dict(tok_B=self.tok_B, count_B=self.position_B, max_B=self.max_B,
                stop_BZ=self.stop_BZ, live_B=self.live_B)


def build(rows, num_new, *, max_pages: int, ring_width: int, buckets_nwc=None,
          chunk_size: int = 0, vocab: int = 0) -> StepInputs:
  """The inputs of a dispatch over `rows` (a `SequenceState` or None per engine row), row b
  feeding `num_new[b]` tokens; with `buckets_nwc` (a plain step) packed into the smallest
  bucket that fits, and with `vocab` the seen-token mask when a live row asks for a
  repetition penalty."""
  b = len(rows)
  width = stop_width(max([len(s.params.stop_tokens) for s in rows if s is not None] + [1]))
  x = StepInputs(
      table_BE=np.zeros((b, max_pages), np.int32), ring_BE=np.zeros((b, ring_width), np.int32),
      length_B=np.zeros(b, np.int32), num_new_B=np.zeros(b, np.int32),
      tok_B=np.zeros(b, np.int32), position_B=np.zeros(b, np.int32),
      max_B=np.zeros(b, np.int32), stop_BZ=np.full((b, width), -1, np.int32),
      live_B=np.zeros(b, bool), params=[GREEDY] * b)
  for row, (seq, n) in enumerate(zip(rows, num_new)):
    if seq is None or not n:
      continue
    x.table_BE[row, :len(seq.pages)] = seq.pages
    x.ring_BE[row, :len(seq.ring_pages)] = seq.ring_pages
    x.length_B[row], x.num_new_B[row] = seq.num_cached, n
    x.tok_B[row], x.position_B[row] = seq.tokens[-1], len(seq.output)
    x.max_B[row] = seq.max_tokens
    x.stop_BZ[row, :len(seq.params.stop_tokens)] = seq.params.stop_tokens
    x.live_B[row], x.params[row] = True, seq.params
  if buckets_nwc is not None:
    _pack(x, rows, buckets_nwc, chunk_size)
  if vocab and any(prm.repetition_penalty != 1 for prm in x.params):
    x.seen_BV = np.zeros((b, vocab), bool)
    for row, seq in enumerate(rows):
      if seq is not None:
        x.seen_BV[row, seq.tokens] = True
  return x


def _pack(x: StepInputs, rows, buckets_nwc, chunk_size: int) -> None:
  """Fill `x`'s packed fields: the fed tokens one row after another, in the smallest
  bucket that holds them."""
  fed = x.num_new_B.tolist()
  total, widest, wide = sum(fed), max(fed), sum(k > 1 for k in fed)
  if widest > chunk_size:
    raise RuntimeError(f'Engine: a sequence feeds {widest} tokens in one step, past '
                       f'chunk_size={chunk_size}; this is a scheduler bug.')
  n, w, c = next(s for s in buckets_nwc if s[0] >= total and s[1] >= widest and s[2] >= wide)
  x.bucket = (n, w, c)
  x.tokens_M1 = np.zeros((n, 1), np.int32)
  x.seq_of_M, x.slot_of_M = np.zeros(n, np.int32), np.full(n, w, np.int32)  # padding: w
  x.last_B, at = np.zeros(len(rows), np.int32), 0
  for row, (seq, k) in enumerate(zip(rows, fed)):
    if not k:
      continue
    x.tokens_M1[at:at + k, 0] = seq.tokens[seq.num_cached:seq.num_cached + k]
    x.seq_of_M[at:at + k], x.slot_of_M[at:at + k] = row, np.arange(k)
    at += k
    x.last_B[row] = at - 1


def check(rows, writes, page_size: int, max_len: int) -> None:
  """Raise (naming the request) if a live row's `writes` positions overflow its pages or
  the context (`page_host.check_step`)."""
  live = [(s, n) for s, n in zip(rows, writes) if s is not None and n]
  page_host.check_step([s.id for s, _ in live], [s.num_cached for s, _ in live],
                       [n for _, n in live], [len(s.pages) for s, _ in live], page_size,
                       max_len)


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


class SamplingCache:
  """`SamplingBatch.stack(params)`, kept on the device for a mix of params seen before."""

  def __init__(self):
    self._batches: dict[tuple, SamplingBatch] = {}

  def __call__(self, params) -> SamplingBatch:
    key = tuple(params)
    batch = self._batches.get(key)
    if batch is None:
      if len(self._batches) > 64:
        self._batches.clear()
      batch = self._batches[key] = SamplingBatch.stack(params)
    return batch
