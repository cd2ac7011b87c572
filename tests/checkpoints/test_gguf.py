"""GGUF import on tiny files written by `gguf.GGUFWriter`: name map, layouts, norm offset,
dequantization, metadata -> config, the sha256-keyed cache, and the bad-input errors."""

import numpy as np
import pytest

pytest.importorskip('gguf')

from qjax.checkpoints.gguf import GEMMA3_FACTS, gguf_config, load_gguf, open_gguf  # noqa: E402
from qjax.checkpoints.params import model_params  # noqa: E402
from qjax.core import int_format  # noqa: E402
from qjax.eval import logits  # noqa: E402
from qjax.nn import QuantPolicy, QuantRule, quantize_model  # noqa: E402
import gguf_testdata as td  # noqa: E402


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory):
  cfg = td.tiny_config()
  path = tmp_path_factory.mktemp('gguf') / 'tiny.gguf'
  stored = td.write_gguf(path, cfg, td.random_params(cfg))
  return path, cfg, stored


def test_config_from_metadata_and_facts(tiny_gguf):
  path, cfg, _ = tiny_gguf
  got = gguf_config(open_gguf(path))
  assert got == cfg.replace(rms_eps=float(np.float32(cfg.rms_eps)))
  assert got.global_every == GEMMA3_FACTS['global_every']
  assert got.local_rope_base == GEMMA3_FACTS['local_rope_base']
  assert got.sliding_window == 4  # from the metadata, not the 512 fallback


def test_params_round_trip_every_layout_and_the_norm_offset(tiny_gguf, tmp_path):
  path, cfg, stored = tiny_gguf
  model, info = load_gguf(path, cache_dir=tmp_path)
  again = td._gguf_tensors(cfg, model_params(model))  # pylint: disable=protected-access
  assert set(again) == set(stored)
  for name, arr in stored.items():
    np.testing.assert_allclose(again[name], arr, rtol=0, atol=1e-6, err_msg=name)
  assert info['tensor_types']['layers/0/attn/q_proj/w'] == 'Q8_0'
  assert info['tensor_types']['layers/1/mlp/gate_proj/w'] == 'Q5_0'
  assert info['tensor_types']['layers/1/mlp/down_proj/w'] == 'F32'
  # A quantized tensor really went through dequantization (it differs from the float one).
  assert not np.array_equal(stored['token_embd.weight'],
                            td.random_params(cfg)['embed/w'])


def test_cache_hit_gives_the_same_model(tiny_gguf, tmp_path):
  path, _, _ = tiny_gguf
  cold, info_cold = load_gguf(path, cache_dir=tmp_path)
  warm, info_warm = load_gguf(path, cache_dir=tmp_path)
  assert (info_cold['cache'], info_warm['cache']) == ('miss', 'hit')
  assert info_cold['sha256'] == info_warm['sha256']
  assert info_warm['sha256'] in info_warm['cache_path']
  assert info_warm['tensor_types'] == info_cold['tensor_types']
  a, b = model_params(cold), model_params(warm)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  bf16, _ = load_gguf(path, cache_dir=tmp_path, param_dtype='bfloat16')
  assert bf16.embed.w[...].dtype == np.dtype('bfloat16') and bf16.config.param_dtype == 'bfloat16'


def test_damaged_cache_entry_is_rebuilt(tiny_gguf, tmp_path):
  path, _, _ = tiny_gguf
  _, info = load_gguf(path, cache_dir=tmp_path)
  with open(info['cache_path'], 'wb') as f:
    f.write(b'not safetensors')
  _, info = load_gguf(path, cache_dir=tmp_path)
  assert info['cache'] == 'miss'


def test_quantize_model_runs_on_a_loaded_gemma(tiny_gguf, tmp_path):
  path, _, _ = tiny_gguf
  model, _ = load_gguf(path, cache_dir=tmp_path)
  tokens = np.arange(12, dtype=np.int32)[None] % model.config.vocab_size
  ref = np.asarray(logits(model, tokens))
  for fmt in (int_format(8), int_format(4, group_size=32)):
    qmodel, report = quantize_model(model, QuantPolicy((QuantRule('.*', fmt),)))
    got = np.asarray(logits(qmodel, tokens))
    assert np.isfinite(got).all() and got.shape == ref.shape
    assert report is not None and np.abs(got - ref).max() < 0.5 * np.abs(ref).max()


def test_unsupported_architecture_is_a_clear_error(tmp_path):
  cfg = td.tiny_config()
  path = tmp_path / 'llama.gguf'
  td.write_gguf(path, cfg, td.random_params(cfg), arch='llama')
  with pytest.raises(ValueError, match=r"architecture 'llama' is not supported.*safetensors"):
    load_gguf(path, cache=False)


@pytest.mark.parametrize('keep', [0.999, 0.5, 0.01])
def test_truncated_file_is_a_clear_error(tiny_gguf, tmp_path, keep):
  path, _, _ = tiny_gguf
  data = path.read_bytes()
  cut = tmp_path / 'cut.gguf'
  cut.write_bytes(data[:int(len(data) * keep)])
  with pytest.raises(ValueError, match='truncated|not a readable GGUF'):
    load_gguf(cut, cache=False)


def test_missing_and_empty_files(tmp_path):
  with pytest.raises(ValueError, match='does not exist'):
    load_gguf(tmp_path / 'nope.gguf')
  (tmp_path / 'empty.gguf').write_bytes(b'')
  with pytest.raises(ValueError, match='not a readable GGUF'):
    load_gguf(tmp_path / 'empty.gguf', cache=False)


def test_tokenizer_model_vocab_mismatch_is_a_clear_error(tmp_path):
  cfg = td.tiny_config()
  path = tmp_path / 'mismatch.gguf'
  # The embedding has rows for every token, the vocabulary lists one more.
  td.write_gguf(path, cfg, td.random_params(cfg), tokens=td.TOKENS + ['extra'],
                types=td.TYPES + [1])
  with pytest.raises(ValueError, match='vocabulary mismatch'):
    load_gguf(path, cache=False)

