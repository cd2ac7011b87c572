"""Shared helpers of the reliability tests: tiny configs, fixtures, file edits.

(Not a conftest.py: tests/integration has one, and two modules named conftest collide.)
"""

import os
import shutil

import pytest
from flax import nnx

from configs import tiny_lm
from qjax import checkpoints as qckpt
from qjax import pipeline
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, quantize_model

TINY = {
    'model.d_model': 32, 'model.num_layers': 1, 'model.num_heads': 2, 'model.num_kv_heads': 1,
    'model.head_dim': 16, 'model.d_ff': 64, 'data.seq_len': 16, 'train.batch': 2,
    'train.steps': 8, 'train.warmup': 1, 'train.log_every': 2, 'train.eval_windows': 4,
    'train.eval_batch': 4, 'checkpoint.every': 4, 'checkpoint.keep': 2,
}
CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=16)
POLICY = QuantPolicy((QuantRule('embed', exempt=True),
                      QuantRule('.*', int_format(8))))


def tiny_train_config(workdir, **extra):
  c = pipeline.apply_overrides(tiny_lm.get_config(), {**TINY, **extra})
  c.workdir = str(workdir)
  return c


def record_fields():
  """The descriptive record fields ('none' is an allowed value of each)."""
  return {f: 'none' for f in qckpt.REQUIRED_FIELDS if f not in ('runtime', 'hardware',
                                                                 'artifacts')}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A finished 8-step training run (copy it before changing it: `copy_run`)."""
  wd = tmp_path_factory.mktemp('reliability_run')
  pipeline.train(tiny_train_config(wd), str(wd))
  return wd


@pytest.fixture
def copy_run(trained, tmp_path):
  dst = tmp_path / 'run'
  shutil.copytree(trained, dst, symlinks=True)
  return dst


@pytest.fixture(scope='module')
def saved_quantized(tmp_path_factory):
  """A tiny int8 model saved with `save_quantized` (copy before editing: `copy_quantized`)."""
  qmodel, _ = quantize_model(Transformer(CFG, rngs=nnx.Rngs(0)), POLICY)
  out = tmp_path_factory.mktemp('reliability_q') / 'q'
  qckpt.save_quantized(str(out), qmodel, POLICY, record_fields())
  return out, qmodel


@pytest.fixture
def copy_quantized(saved_quantized, tmp_path):
  dst = tmp_path / 'q'
  shutil.copytree(saved_quantized[0], dst, symlinks=True)
  return dst


def rewrite_json(path, update):
  import json  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    d = json.load(f)
  update(d)
  with open(path, 'w') as f:
    json.dump(d, f)
  return d


def flip_byte(path, offset=None):
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.seek(size // 2 if offset is None else offset)
    b = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([b[0] ^ 0xFF]))
