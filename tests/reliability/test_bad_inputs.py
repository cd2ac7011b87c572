"""Each bad input gets an error that names the value and the fix."""

import os
import pathlib
import shutil

import numpy as np
import pytest
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import costmodel
from qjax import pipeline
from qjax.core import QFormat
from qjax.core.calibration import mse_range
from qjax.nn import Transformer
from qjax.train import make_optimizer
from qjax.train import data as qdata

from reliability_lib import CFG, tiny_train_config

HF_TINY = pathlib.Path(__file__).resolve().parents[1] / 'testdata' / 'hf_tiny' / 'llama'


@pytest.mark.parametrize('lr', [0.0, -1e-3, float('nan')])
def test_non_positive_learning_rate(lr, tmp_path):
  with pytest.raises(ValueError, match=rf'lr={lr!r} must be a finite number > 0'):
    make_optimizer(lr, 10, 1)
  with pytest.raises(ValueError, match=rf'--config.train.lr={lr!r}'):
    pipeline.check_train_config(tiny_train_config(tmp_path, **{'train.lr': lr}))


@pytest.mark.parametrize('key', ['checkpoint.every', 'train.log_every', 'train.batch'])
def test_zero_counts(key, tmp_path):
  with pytest.raises(ValueError, match=rf'--config.{key}=0 must be a positive integer'):
    pipeline.check_train_config(tiny_train_config(tmp_path, **{key: 0}))


def test_optimizer_typo():
  with pytest.raises(ValueError, match=r"'adamww' is not an optax optimizer.*did you mean "
                                       r"'adamw'"):
    make_optimizer(1e-3, 10, 1, name='adamww')


@pytest.mark.parametrize('fraction', [0.0, 1.0, 1.5, -0.1])
def test_valid_fraction_outside_the_unit_interval(fraction):
  with pytest.raises(ValueError, match=rf'valid_fraction={fraction!r} must be in \(0, 1\)'):
    qdata.load_data(qdata.EMBEDDED, 16, fraction)


def test_binary_file_as_text(tmp_path):
  path = tmp_path / 'weights.bin'
  path.write_bytes(b'text at first \xff\xfe\x00 then binary')
  with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 14 is b'\\xff'"):
    qdata.load_text(str(path))


@pytest.mark.parametrize('kw,expected', [
    ({'bits': 4.0}, r'bits=4.0 must be an integer \(got float\)'),
    ({'group_size': 3.5}, r'group_size=3.5 must be an integer'),
    ({'calibration': 'mse', 'calibration_arg': 1}, r'mse calibration_arg=1 .* \[2, 1000\]'),
    ({'calibration': 'mse', 'calibration_arg': 2.5}, r'mse calibration_arg=2.5'),
])
def test_format_arguments(kw, expected):
  with pytest.raises(ValueError, match=expected):
    QFormat(**kw)


@pytest.mark.parametrize('kw,expected', [
    ({'num_ratios': 1}, r'num_ratios=1 must be an integer >= 2'),
    ({'min_ratio': 0.0}, r'min_ratio=0.0 must be in \(0, 1\)'),
    ({'min_ratio': 1.5}, r'min_ratio=1.5'),
])
def test_mse_calibration_arguments(kw, expected):
  with pytest.raises(ValueError, match=expected):
    mse_range(np.ones((1, 4), np.float32), (1,), QFormat(), **kw)


def test_save_state_into_an_existing_file(tmp_path):
  target = tmp_path / 'not_a_dir'
  target.write_text('')
  with pytest.raises(ValueError, match=rf"save_state: '{target}' exists and is a file"):
    qckpt.save_state(str(target), object())  # refused before the model is touched


MODEL, CHIP = 'gemma3_270m', 'h200'


def _plan(**kw):
  w = costmodel.Workload(batch=1, prompt_len=64, gen_len=8)
  return costmodel.plan(MODEL, CHIP, w, **kw)


def test_plan_with_zero_chips():
  with pytest.raises(ValueError, match=r'n_chips=0 must be a positive integer'):
    _plan(n_chips=0)


def test_plan_with_a_mesh_of_another_chip_count():
  with pytest.raises(ValueError, match=r"mesh '3x3' has 9 chips, but n_chips is 8"):
    _plan(n_chips=8, meshes=['3x3'])


def test_plan_with_an_interconnect_typo():
  with pytest.raises(ValueError, match=r"interconnect model 'all_linkz'.*all_links"):
    _plan(n_chips=8, interconnect='all_linkz')


def _hf_copy(tmp_path):
  dst = tmp_path / 'hf'
  shutil.copytree(HF_TINY, dst)
  return dst


def test_truncated_safetensors_names_the_file(tmp_path):
  d = _hf_copy(tmp_path)
  f = d / 'model.safetensors'
  f.write_bytes(f.read_bytes()[:40])
  with pytest.raises(ValueError, match=r'not a readable safetensors file') as e:
    qckpt.load_hf(d)
  assert str(f) in str(e.value)


def test_broken_config_json_names_the_file(tmp_path):
  d = _hf_copy(tmp_path)
  (d / 'config.json').write_text('{"model_type": "llama",')
  with pytest.raises(ValueError, match=r'not valid JSON') as e:
    qckpt.load_hf(d)
  assert str(d / 'config.json') in str(e.value)


def test_nan_weights_are_refused_on_load(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  d = _hf_copy(tmp_path)
  tensors = load_file(str(d / 'model.safetensors'))
  name = sorted(n for n in tensors if n.endswith('mlp.up_proj.weight'))[0]
  w = tensors[name].copy()
  w.flat[3] = np.nan
  tensors[name] = w
  save_file(tensors, str(d / 'model.safetensors'))
  with pytest.raises(ValueError, match=r"parameter '.*up_proj.*' holds 1 NaN/Inf values"):
    qckpt.load_hf(d)


def test_gguf_cache_entry_is_verified_by_content(tmp_path):
  from qjax.checkpoints import param_cache  # pylint: disable=g-import-not-at-top
  entry = tmp_path / 'e' / 'params.safetensors'
  params = {'a': np.arange(4, dtype=np.float32), 'b': np.ones((2, 2), np.float32)}
  param_cache.save_params(entry, params, {'config': {}})
  param_cache.verify_params(param_cache.LazyParams(entry), str(entry))
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  meta = param_cache.LazyParams(entry).metadata
  save_file(dict(params, a=np.arange(4, dtype=np.float32) + 1), str(entry),
            metadata={k: __import__('json').dumps(v) for k, v in meta.items()})
  with pytest.raises(ValueError, match=r'the entry is corrupted') as e:
    param_cache.verify_params(param_cache.LazyParams(entry), str(entry))
  assert str(entry) in str(e.value)
  assert os.path.isfile(entry)


def test_nan_weights_are_refused_by_every_import_path():
  # GGUF, the GGUF cache and safetensors all build the model through model_from_params.
  params = qckpt.model_params(Transformer(CFG, rngs=nnx.Rngs(0)))
  key = sorted(k for k in params if 'up_proj' in k)[0]
  params[key] = params[key].copy()
  params[key].flat[0] = np.inf
  with pytest.raises(ValueError, match=rf"gguf-file: parameter '{key}' holds 1 NaN/Inf"):
    qckpt.model_from_params(CFG, params, source='gguf-file')
