"""Llama / Qwen2 / Mistral safetensors import against HF transformers' float32 logits.

The tiny checkpoints and golden logits under tests/testdata/hf_tiny/ were written by
scripts/make_reference.py (HF `save_pretrained`, random weights, perturbed norms and biases);
no torch is needed here.
"""

import json
import pathlib
import shutil

import numpy as np
import pytest

pytest.importorskip('safetensors')

from qjax.checkpoints.safetensors_io import hf_config, load_hf  # noqa: E402
from qjax.core import int_format  # noqa: E402
from qjax.eval import logits  # noqa: E402
from qjax.nn import QuantPolicy, QuantRule, quantize_model  # noqa: E402

TINY = pathlib.Path(__file__).resolve().parents[1] / 'testdata' / 'hf_tiny'
NAMES = ('llama', 'qwen2', 'mistral')


@pytest.mark.parametrize('name', NAMES)
def test_logits_match_hf_float32(name):
  model, info = load_hf(TINY / name)
  golden = np.load(TINY / name / 'golden.npz')
  got = np.asarray(logits(model, golden['tokens']))
  assert np.abs(golden['logits']).max() > 1.0  # the comparison is not of near-zero logits
  np.testing.assert_allclose(got, golden['logits'], rtol=0, atol=1e-4)
  assert info['files'] == ['model.safetensors']


def test_each_tiny_model_exercises_its_family_option():
  llama = load_hf(TINY / 'llama')[1]['config']
  qwen2 = load_hf(TINY / 'qwen2')[1]['config']
  mistral, info = load_hf(TINY / 'mistral')
  assert not llama.tie_embeddings and llama.num_kv_heads == 2 and llama.sliding_window is None
  assert qwen2.tie_embeddings and qwen2.qkv_bias and qwen2.num_kv_heads == 1
  assert qwen2.rope_base == 1e6
  cfg = mistral.config
  assert cfg.sliding_window == 5 and cfg.global_every is None and cfg.head_dim == 16
  assert info['source_dtypes'] == ['bfloat16']


def test_quantize_model_runs_on_a_loaded_llama():
  model, _ = load_hf(TINY / 'llama')
  golden = np.load(TINY / 'llama' / 'golden.npz')
  qmodel, _ = quantize_model(model, QuantPolicy((QuantRule('.*', int_format(8)),)))
  got = np.asarray(logits(qmodel, golden['tokens']))
  assert np.mean(got.argmax(-1) == golden['logits'].argmax(-1)) > 0.9


def _copy(tmp_path, name='llama'):
  dst = tmp_path / name
  shutil.copytree(TINY / name, dst)
  return dst


def _edit_config(directory, **changes):
  path = directory / 'config.json'
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


@pytest.mark.parametrize('changes, match', [
    (dict(intermediate_size=96), r"mlp.down_proj.weight' has shape \(32, 64\), but "
                                 r'config.json .*intermediate_size=96.* implies \(32, 96\)'),
    (dict(num_key_value_heads=4), r"k_proj.weight' has shape \(16, 32\).*implies \(32, 32\)"),
    (dict(vocab_size=100), r"(embed_tokens|lm_head).weight' has shape \(128, 32\)"),
    (dict(tie_word_embeddings=True), 'tie_word_embeddings=true but lm_head.weight differs'),
    (dict(num_hidden_layers=3), r'model.layers.2.* missing'),
    (dict(model_type='gpt2'), r"model_type 'gpt2' is not supported"),
    (dict(rope_parameters={'rope_type': 'longrope', 'rope_theta': 5e5}), "rope_type 'longrope'"),
    (dict(hidden_act='gelu'), "hidden_act 'gelu'"),
    (dict(attention_bias=True), 'attention_bias=true is not supported'),
])
def test_config_that_does_not_match_the_weights_is_a_clear_error(tmp_path, changes, match):
  directory = _copy(tmp_path)
  _edit_config(directory, **changes)
  with pytest.raises(ValueError, match=match):
    load_hf(directory)


def test_missing_tensor_and_missing_files(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = _copy(tmp_path, 'qwen2')
  tensors = load_file(directory / 'model.safetensors')
  del tensors['model.layers.1.self_attn.k_proj.bias']
  save_file(tensors, directory / 'model.safetensors')
  with pytest.raises(ValueError, match=r"layers.1.self_attn.k_proj.bias'\] required"):
    load_hf(directory)
  with pytest.raises(ValueError, match='must hold config.json'):
    load_hf(tmp_path / 'nowhere')


def test_qwen2_sliding_layers():
  base = json.loads((TINY / 'qwen2' / 'config.json').read_text())
  assert hf_config(dict(base, use_sliding_window=True, sliding_window=8,
                        layer_types=['sliding_attention'] * 2)).sliding_window == 8
  with pytest.raises(ValueError, match='mix sliding and full'):
    hf_config(dict(base, sliding_window=8,
                   layer_types=['full_attention', 'sliding_attention']))
