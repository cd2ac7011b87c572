"""Byte tokenizer, deterministic splits and batches, bad data sources."""

import numpy as np
import pytest

from qjax.data import corpus_path
from qjax.train import data as qdata


def test_tokenizer_round_trip_including_utf8():
  tok = qdata.ByteTokenizer()
  text = 'To be, or not to be — ça va? 数字 123 🙂'
  ids = tok.encode(text, bos=True)
  assert ids[0] == tok.bos_id and ids.max() < tok.vocab_size
  assert tok.decode(ids) == text


def test_embedded_default_needs_no_download():
  d = qdata.load_data(qdata.EMBEDDED, seq_len=64)
  assert d.train.size > 300_000 and d.valid.size > 30_000
  # deterministic split: the same ids and hash every time
  d2 = qdata.load_data(qdata.EMBEDDED, seq_len=64)
  assert d.sha256 == d2.sha256 and np.array_equal(d.valid, d2.valid)


def test_batches_are_a_pure_function_of_step_and_seed():
  ids = np.arange(10_000, dtype=np.int32)
  a = qdata.batch_at(ids, 7, 4, 16, seed=0)
  np.testing.assert_array_equal(a, qdata.batch_at(ids, 7, 4, 16, seed=0))
  assert not np.array_equal(a, qdata.batch_at(ids, 8, 4, 16, seed=0))
  assert a.shape == (4, 17) and (np.diff(a, axis=1) == 1).all()


def test_shakespeare_file_source():
  d = qdata.load_data(str(corpus_path('tinyshakespeare')), seq_len=128)
  assert qdata.ByteTokenizer().decode(d.train[:9]) == 'First Cit'


def test_bad_sources(tmp_path):
  with pytest.raises(ValueError, match='neither .* nor an existing file'):
    qdata.load_data(str(tmp_path / 'missing.txt'), seq_len=64)
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  with pytest.raises(ValueError, match='too short for seq_len=64'):
    qdata.load_data(str(empty), seq_len=64)
  short = tmp_path / 'short.txt'
  short.write_text('hello world ' * 20)
  with pytest.raises(ValueError, match='too short'):
    qdata.load_data(str(short), seq_len=64)
