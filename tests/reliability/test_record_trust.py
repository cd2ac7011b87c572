"""A conversion record that is hashed, schema-checked and reproducible."""

import json
import os
import signal

import numpy as np
import pytest
from flax import nnx

from qjax import checkpoints as qckpt
from qjax.nn import Transformer, quantize_model

from reliability_lib import (CFG, POLICY, copy_quantized, record_fields, rewrite_json,  # noqa: F401
                             saved_quantized)


def _record_path(d):
  return os.path.join(d, qckpt.RECORD_NAME)


def test_reload_verifies_and_reproduces(copy_quantized, saved_quantized):
  loaded, record = qckpt.load_quantized(str(copy_quantized))
  assert record['content_sha256'] == qckpt.content_sha256(nnx.state(saved_quantized[1]))
  assert record['logits_fingerprint']['tokens'] == qckpt.fingerprint_tokens(CFG)[0].tolist()
  assert qckpt.logits_fingerprint(loaded)['sha256'] == record['logits_fingerprint']['sha256']


def test_edited_structure_field_is_refused_by_the_record_hash(copy_quantized):
  path = _record_path(copy_quantized)
  rewrite_json(path, lambda r: r['model_config'].update(rope_base=500.0))
  with pytest.raises(ValueError, match=r'does not match its record_sha256') as e:
    qckpt.load_quantized(str(copy_quantized))
  assert path in str(e.value)


def test_edited_and_rehashed_record_is_refused_by_the_logits_fingerprint(copy_quantized):
  def edit(r):
    r['model_config']['rope_base'] = 500.0
    r['record_sha256'] = qckpt.record_sha256(r)
  rewrite_json(_record_path(copy_quantized), edit)
  with pytest.raises(ValueError, match=r'logits on the fingerprint tokens differ .* by up to'):
    qckpt.load_quantized(str(copy_quantized))


def test_truncated_record_names_the_file(copy_quantized):
  path = _record_path(copy_quantized)
  text = open(path).read()
  with open(path, 'w') as f:
    f.write(text[:len(text) // 2])
  with pytest.raises(ValueError, match=r'not valid JSON') as e:
    qckpt.read_record(str(copy_quantized))
  assert path in str(e.value)


@pytest.mark.parametrize('field,value,expected', [
    ('artifacts', ['state'], r"field 'artifacts' is list .*expected dict"),
    ('qarray_layout', '2', r"field 'qarray_layout' is str '2', expected int"),
    ('model_config', None, r"field 'model_config' is NoneType"),
])
def test_wrong_typed_field_names_file_and_field(copy_quantized, field, value, expected):
  path = _record_path(copy_quantized)
  rewrite_json(path, lambda r: r.update({field: value}))
  with pytest.raises(ValueError, match=expected) as e:
    qckpt.read_record(str(copy_quantized))
  assert path in str(e.value)


def test_record_that_is_not_an_object_is_refused(copy_quantized):
  with open(_record_path(copy_quantized), 'w') as f:
    json.dump([1, 2], f)
  with pytest.raises(ValueError, match=r'a conversion record is a JSON object, got list'):
    qckpt.read_record(str(copy_quantized))


def test_missing_required_field_is_named(copy_quantized):
  rewrite_json(_record_path(copy_quantized), lambda r: r.pop('tokenizer'))
  with pytest.raises(ValueError, match=r"no field\(s\) \['tokenizer'\]"):
    qckpt.read_record(str(copy_quantized))


class _Alarm:
  """Fail instead of hanging (the bug was an endless read of a FIFO / /dev/zero)."""

  def __enter__(self):
    def fail(*_):
      raise TimeoutError('hashing the checkpoint directory hung')
    self.old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)

  def __exit__(self, *exc):
    signal.alarm(0)
    signal.signal(signal.SIGALRM, self.old)


def test_fifo_in_checkpoint_is_refused_without_hanging(copy_quantized):
  fifo = os.path.join(copy_quantized, 'state', 'pipe')
  os.mkfifo(fifo)
  with _Alarm(), pytest.raises(ValueError, match=r'is a FIFO') as e:
    qckpt.read_record(str(copy_quantized))
  assert fifo in str(e.value)


def test_symlink_out_of_the_checkpoint_is_refused(copy_quantized):
  link = os.path.join(copy_quantized, 'zeros')
  os.symlink('/dev/zero', link)
  with _Alarm(), pytest.raises(ValueError, match=r"symlink to '/dev/zero', outside"):
    qckpt.tree_sha256(str(copy_quantized))


def test_content_hash_is_reproducible_where_file_hashes_are_not(tmp_path, saved_quantized):
  # The same conversion twice: the Orbax files differ (names, timestamps, paths) but the
  # arrays, and so the content hash and the fingerprint, are the same.
  qmodel, _ = quantize_model(Transformer(CFG, rngs=nnx.Rngs(0)), POLICY)
  qckpt.save_quantized(str(tmp_path / 'again'), qmodel, POLICY, record_fields())
  a = qckpt.read_record(str(saved_quantized[0]))
  b = qckpt.read_record(str(tmp_path / 'again'))
  assert a['content_sha256'] == b['content_sha256']
  assert a['logits_fingerprint'] == b['logits_fingerprint']
  other, _ = quantize_model(Transformer(CFG, rngs=nnx.Rngs(1)), POLICY)
  assert qckpt.content_sha256(nnx.state(other)) != a['content_sha256']


def test_content_hash_covers_names_dtypes_shapes_and_bytes():
  base = {'w': np.zeros((2, 2), np.float32)}
  h = qckpt.content_sha256(base)
  assert h != qckpt.content_sha256({'v': np.zeros((2, 2), np.float32)})
  assert h != qckpt.content_sha256({'w': np.zeros((2, 2), np.float16)})
  assert h != qckpt.content_sha256({'w': np.zeros((4,), np.float32)})
  assert h != qckpt.content_sha256({'w': np.eye(2, dtype=np.float32)})
  assert h == qckpt.content_sha256({'w': np.zeros((2, 2), np.float32)})


def test_saving_into_an_existing_file_is_refused(tmp_path, saved_quantized):
  target = tmp_path / 'a_file'
  target.write_text('x')
  with pytest.raises(ValueError, match=r'exists and is a file') as e:
    qckpt.save_quantized(str(target), saved_quantized[1], POLICY, record_fields())
  assert str(target) in str(e.value)


def test_a_directory_that_is_no_conversion_output_says_how_to_make_one(tmp_path):
  # `serve --config.checkpoint=<a HF checkpoint>` said to run experiments.quantize, and a
  # missing directory 'has no conversion_record.json'.
  with pytest.raises(ValueError, match=r"'.*nope' does not exist or is not a directory, so it "
                                       r'has no conversion_record.json; pass a qjax conversion '
                                       r'output \(python -m experiments.convert'):
    qckpt.read_record(str(tmp_path / 'nope'))
  (tmp_path / 'config.json').write_text('{}')
  with pytest.raises(ValueError, match=r'it is a HF checkpoint, not a qjax conversion output; '
                                       r'convert it first \(python -m experiments.convert '
                                       rf'--config.source={tmp_path} --config.out=OUT'):
    qckpt.read_record(str(tmp_path))
