"""Text data for the experiment loop: a byte-level tokenizer and deterministic splits.

The embedded default corpus is `pydoc_data.topics` (the English help text shipped with every
CPython), so the default run needs no download. Any UTF-8 text file works too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Iterator

import numpy as np

EMBEDDED = 'pydoc_data.topics'


class ByteTokenizer:
  """Bytes 0..255 are tokens 0..255; BOS = 256. Vocabulary 257 (round up for the model)."""

  vocab_size = 257
  bos_id = 256
  name = 'bytes-v1 (utf-8 bytes 0..255, BOS=256)'

  def encode(self, text: str, bos: bool = False) -> np.ndarray:
    ids = np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)
    return np.concatenate([[self.bos_id], ids]).astype(np.int32) if bos else ids

  def decode(self, ids) -> str:
    b = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
    return b.decode('utf-8', errors='replace')


def load_text(source: str) -> str:
  """The text of `source`: 'pydoc_data.topics' (embedded) or a path to a UTF-8 text file."""
  if source == EMBEDDED:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    return '\n\n'.join(topics.topics[k] for k in sorted(topics.topics))
  if not os.path.isfile(source):
    raise ValueError(f'data source {source!r} is neither {EMBEDDED!r} nor an existing file; '
                     'pass --config.data.source=/path/to/text.txt or the embedded default.')
  with open(source, 'rb') as f:
    raw = f.read()
  try:
    return raw.decode('utf-8')  # strict: a binary file is an error, not mojibake to train on
  except UnicodeDecodeError as e:
    raise ValueError(f'data source {source!r} is not UTF-8 text (byte {e.start} is '
                     f'{raw[e.start:e.start + 1]!r}: {e.reason}); pass a UTF-8 text file, not a '
                     'binary one.') from None


@dataclasses.dataclass
class TextData:
  """Token ids of a corpus split deterministically into train and validation."""

  train: np.ndarray
  valid: np.ndarray
  source: str
  sha256: str
  tokenizer: ByteTokenizer

  def describe(self) -> dict:
    return {'source': self.source, 'sha256': self.sha256, 'tokenizer': self.tokenizer.name,
            'train_tokens': int(self.train.size), 'valid_tokens': int(self.valid.size)}


def load_data(source: str, seq_len: int, valid_fraction: float = 0.1) -> TextData:
  """Tokenize `source` and split it: the last `valid_fraction` of the bytes is validation.

  Args:
    source: as for `load_text`.
    seq_len: training sequence length; each split must hold at least a few windows of it.
    valid_fraction: fraction of tokens held out (a contiguous tail: no leakage by overlap).

  Returns:
    TextData.
  """
  if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float)) or not (
      0.0 < valid_fraction < 1.0):
    raise ValueError(f'--config.data.valid_fraction={valid_fraction!r} must be in (0, 1) (the '
                     'held-out tail of the text); e.g. 0.1.')
  text = load_text(source)
  tok = ByteTokenizer()
  ids = tok.encode(text)
  n_valid = int(ids.size * valid_fraction)
  need = 4 * (seq_len + 1)
  if ids.size - n_valid < need or n_valid < seq_len + 1:
    raise ValueError(f'data source {source!r} has {ids.size} tokens: too short for seq_len='
                     f'{seq_len} (needs >= {need} train and {seq_len + 1} validation tokens '
                     f'at valid_fraction={valid_fraction}); use a longer text or a smaller '
                     'seq_len.')
  return TextData(ids[:-n_valid], ids[-n_valid:], source,
                  hashlib.sha256(ids.tobytes()).hexdigest(), tok)


def batch_at(ids: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
  """The training batch of step `step`: a pure function of (step, seed), so resumes replay.

  Returns:
    int32 [batch, seq_len + 1] windows (inputs are [:, :-1], targets [:, 1:]).
  """
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, ids.size - seq_len - 1, size=batch)
  return np.stack([ids[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def random_windows(ids: np.ndarray, n: int, seq_len: int, seed: int) -> np.ndarray:
  """`n` windows of `seq_len` tokens at random starts (a calibration set), int32 [n, seq_len]."""
  if n < 1 or seq_len < 1:
    raise ValueError(f'random_windows: n={n} and seq_len={seq_len} must both be >= 1.')
  if ids.size < seq_len + 1:
    raise ValueError(f'random_windows: {ids.size} tokens cannot hold a window of seq_len='
                     f'{seq_len}; use a shorter seq_len or a longer text.')
  starts = np.random.default_rng(seed).integers(0, ids.size - seq_len, size=n)
  return np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)


def eval_windows(ids: np.ndarray, seq_len: int, max_windows: int | None = None
                 ) -> np.ndarray:
  """Non-overlapping [n, seq_len + 1] windows covering `ids` from the start (for perplexity)."""
  n = (ids.size - 1) // seq_len
  if max_windows:
    n = min(n, max_windows)
  return np.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


def iterate(windows: np.ndarray, batch: int) -> Iterator[np.ndarray]:
  for i in range(0, len(windows), batch):
    yield windows[i:i + batch]
