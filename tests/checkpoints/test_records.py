"""Conversion records: one builder for every entry point; written, hashed, verified."""

import collections
import json
import os

import pytest

from qjax import checkpoints as qckpt

Layer = collections.namedtuple('Layer', 'path weight act quantized')
LAYERS = [Layer('embed', 'float32', None, False),
          Layer('layers/0/attn/q_proj', 'int4 g32', 'int8', True),
          Layer('layers/0/mlp/down_proj', 'int4 g32', None, True)]


def _record(**kw):
  args = dict(base_checkpoint={'sha256': 'ab' * 32, 'source': 'experiments/train.py'},
              tokenizer='bytes-v1', source_dtype='float32', layers=LAYERS, group_size=32,
              granularity='channel', method='rtn', scale_method='absmax (symmetric)',
              zero_point_method='none (symmetric)', calibration={'procedure': 'none'},
              compute_dtype='float32', compute_path='tiled', kv_cache_format='float32',
              evaluation={'ppl': 6.5})
  args.update(kw)
  return qckpt.conversion_record(**args)


def test_fields_come_from_the_report_layers():
  r = _record()
  assert r['weight_formats'] == {'embed': 'float32', 'layers/0/attn/q_proj': 'int4 g32',
                                 'layers/0/mlp/down_proj': 'int4 g32'}
  assert r['activation_formats']['layers/0/attn/q_proj'] == 'int8'
  assert r['exempt_modules'] == ['embed']
  assert r['method'] == 'rtn' and r['adapter_merge_status'] == 'no adapters'
  assert r['accumulation_dtype'] == 'int32 for integer dots, float32 otherwise'
  # Everything but what write_record adds once the artifacts exist.
  assert set(qckpt.REQUIRED_FIELDS) - set(r) == {'runtime', 'hardware', 'artifacts'}


def test_extra_fields_are_kept():
  assert _record(act_clip_paths=['layers/0/mlp/up_proj'])['act_clip_paths'] == [
      'layers/0/mlp/up_proj']


def test_written_record_is_complete_and_verified(tmp_path):
  (tmp_path / 'weights.bin').write_bytes(b'\x01\x02\x03')
  path = qckpt.write_record(str(tmp_path), _record())
  back = qckpt.read_record(str(tmp_path))
  assert back['artifacts'] == {'weights.bin': qckpt.file_sha256(str(tmp_path / 'weights.bin'))}
  assert back['exempt_modules'] == ['embed'] and json.load(open(path))['group_size'] == 32
  (tmp_path / 'weights.bin').write_bytes(b'\x01\x02\x04')
  with pytest.raises(ValueError, match="artifact 'weights.bin'.*was modified"):
    qckpt.read_record(str(tmp_path))
  os.remove(tmp_path / 'weights.bin')
