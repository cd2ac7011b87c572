"""A HF checkpoint cannot be half-trusted: every rope field `load_hf` reads is applied or
refused, a second unindexed weight file, a file that is not a regular file and integer or
bool weights are refused, all before a weight is read."""

import json
import os
import pathlib
import shutil
import signal

import numpy as np
import pytest

from qjax import checkpoints as qckpt

HF_TINY = pathlib.Path(__file__).resolve().parents[1] / 'testdata' / 'hf_tiny' / 'llama'


@pytest.fixture
def hf_dir(tmp_path):
  d = tmp_path / 'hf'
  shutil.copytree(HF_TINY, d)
  return d


def _edit_config(d, **changes):
  config = json.loads((d / 'config.json').read_text())
  config.update(changes)
  (d / 'config.json').write_text(json.dumps(config))


class _Alarm:
  """Fail instead of hanging (the bug was an endless open of a FIFO)."""

  def __enter__(self):
    def fail(*_):
      raise TimeoutError('load_hf hung')
    self.old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)

  def __exit__(self, *exc):
    signal.alarm(0)
    signal.signal(signal.SIGALRM, self.old)


def test_rope_scaling_that_disagrees_with_rope_parameters_is_refused(hf_dir):
  # transformers applies rope_scaling over the default rope_parameters; qjax used to drop it.
  _edit_config(hf_dir, rope_scaling={'rope_type': 'linear', 'factor': 4})
  with pytest.raises(ValueError, match=r"rope_parameters \{'rope_theta': 10000.0, 'rope_type': "
                                       r"'default'\} and rope_scaling \{'rope_type': 'linear', "
                                       r"'factor': 4\} give different RoPE scalings.*keep the "
                                       r'one the checkpoint was trained with'):
    qckpt.load_hf(hf_dir)


def test_rope_scaling_that_agrees_with_rope_parameters_loads(hf_dir):
  scaling = {'rope_type': 'linear', 'factor': 4.0}
  _edit_config(hf_dir, rope_scaling=scaling, rope_parameters=dict(scaling, rope_theta=1e4))
  assert qckpt.load_hf(hf_dir)[0].config.rope_scaling.factor == 4.0


def test_a_second_unindexed_weight_file_is_refused(hf_dir):
  # A stale copy beside model.safetensors used to win for the names it redefined.
  shutil.copy(hf_dir / 'model.safetensors', hf_dir / 'old.safetensors')
  with pytest.raises(ValueError, match=r"2 safetensors files \['model.safetensors', "
                                       r"'old.safetensors'\] and no model.safetensors.index.json"
                                       r'.*move the files that are not part of the checkpoint '
                                       'away'):
    qckpt.load_hf(hf_dir)


@pytest.mark.parametrize('name', ['model.safetensors', 'config.json'])
def test_a_fifo_is_refused_without_hanging(hf_dir, name):
  (hf_dir / name).unlink()
  os.mkfifo(hf_dir / name)
  with _Alarm(), pytest.raises(ValueError, match=rf'{name}: a FIFO, not a regular file'):
    qckpt.load_hf(hf_dir)


@pytest.mark.parametrize('dtype,stored', [(np.int8, 'I8'), (np.int32, 'I32'),
                                          (np.bool_, 'BOOL')])
def test_integer_and_bool_weights_are_refused(hf_dir, dtype, stored):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(hf_dir / 'model.safetensors')
  name = 'model.layers.0.mlp.up_proj.weight'
  tensors[name] = tensors[name].astype(dtype)
  save_file(tensors, str(hf_dir / 'model.safetensors'))
  with pytest.raises(ValueError, match=rf"tensor '{name}' is stored as {stored}, not as "
                                       'floats'):
    qckpt.load_hf(hf_dir)


@pytest.mark.parametrize('changes,message', [
    (dict(rope_scaling='yarn'), r"rope_scaling='yarn' is a str, not an object; write it as "
                                r'"rope_scaling": \{"rope_type"'),
    (dict(rope_parameters=[10000.0, 'default']), r'rope_parameters=\[10000.0, .default.\] is a '
                                                 'list, not an object'),
    (dict(rope_parameters={'rope_type': 'yarn', 'factor': 4.0,
                           'original_max_position_embeddings': 0}),
     r"rope parameter original_max_position_embeddings=0 \(rope_type 'yarn'\) must be a "
     'positive integer'),
    (dict(rope_parameters={'rope_type': 'linear', 'factor': -2}),
     r"rope parameter factor=-2 \(rope_type 'linear'\) must be a positive number"),
    (dict(model_type='gemma2', hidden_act=None, hidden_activation='gelu_pytorch_tanh',
          query_pre_attn_scalar=0),
     r'query_pre_attn_scalar=0 must be a positive number'),
])
def test_bad_config_fields_are_named(hf_dir, changes, message):
  _edit_config(hf_dir, **changes)
  with pytest.raises(ValueError, match=message):
    qckpt.load_hf(hf_dir)


def test_a_config_json_that_is_a_list_is_named(hf_dir):
  (hf_dir / 'config.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match=r'config.json: holds a JSON list, not an object'):
    qckpt.load_hf(hf_dir)


def _tokenizer_dir(tmp_path):
  from tokenizers import Tokenizer, models  # pylint: disable=g-import-not-at-top
  d = tmp_path / 'tok'
  d.mkdir()
  Tokenizer(models.WordLevel({'a': 0, '<unk>': 1}, unk_token='<unk>')).save(
      str(d / 'tokenizer.json'))
  (d / 'tokenizer_config.json').write_text(json.dumps({'eos_token': 'a'}))
  (d / 'generation_config.json').write_text(json.dumps({'eos_token_id': 0}))
  (d / 'chat_template.jinja').write_text('{{ messages[0].content }}')
  return d


@pytest.mark.parametrize('name', ['tokenizer.json', 'tokenizer_config.json',
                                  'generation_config.json', 'chat_template.jinja'])
def test_a_tokenizer_file_that_is_a_fifo_is_refused(tmp_path, name):
  # tokenizer.json as a FIFO was 'has no tokenizer.json (it holds [..., tokenizer.json, ...])';
  # the others were skipped silently (a chat template and stop ids dropped), and copied by none.
  pytest.importorskip('tokenizers')
  from qjax.checkpoints.hf_tokenizer import HFTokenizer, copy_tokenizer  # pylint: disable=g-import-not-at-top
  d = _tokenizer_dir(tmp_path)
  (d / name).unlink()
  os.mkfifo(d / name)
  for load in (lambda: HFTokenizer.from_dir(str(d)),
               lambda: copy_tokenizer(str(d), str(tmp_path / 'out'))):
    with _Alarm(), pytest.raises(ValueError, match=rf'{name}: a FIFO, not a regular file'):
      load()


@pytest.mark.parametrize('name', ['tokenizer_config.json', 'generation_config.json'])
def test_a_tokenizer_json_file_that_is_a_list_is_named(tmp_path, name):
  pytest.importorskip('tokenizers')
  from qjax.checkpoints.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
  d = _tokenizer_dir(tmp_path)
  (d / name).write_text('[0, 1]')  # was an AttributeError ('list' object has no attribute)
  with pytest.raises(ValueError, match=rf'{name}: holds a JSON list, not an object'):
    HFTokenizer.from_dir(str(d))
