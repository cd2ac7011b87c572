"""Convert a tiny HF checkpoint (written without torch) and serve it: `qjax.pipeline.convert`.

The checkpoint is a random qjax Llama under HF names with a byte-level BPE tokenizer and a
chat template; the conversion is RTN int4 g16 (the calibration split it would give GPTQ is
checked on its own, cheaply). The
command-line runs of `experiments.convert` / `.serve` / `.generate` on checkpoints saved by
HF transformers itself are in test_convert_cli.py (the reference extra).
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')
pytest.importorskip('jinja2')

from flax import nnx  # noqa: E402

from configs import convert as convert_config  # noqa: E402
from qjax import infer  # noqa: E402
from qjax.checkpoints import hf_config, model_params, read_record  # noqa: E402
from qjax.checkpoints.hf_tokenizer import HFTokenizer  # noqa: E402
from qjax.nn import Transformer  # noqa: E402
from qjax.pipeline import convert  # noqa: E402
import hf_testdata  # noqa: E402

VOCAB = 320
HF_CFG = dict(model_type='llama', hidden_act='silu', hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=VOCAB,
              intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=128,
              tie_word_embeddings=False,
              rope_parameters=dict(rope_type='llama3', rope_theta=1e4, factor=8.0,
                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=32))


def tiny_config(source, out, method='rtn'):
  c = convert_config.get_config()
  c.source, c.out = str(source), str(out)
  c.quant.method, c.quant.bits, c.quant.group_size = method, 4, 16
  c.calib.num_sequences, c.calib.seq_len, c.calib.batch_size = 8, 32, 4
  c.eval.windows, c.eval.seq_len, c.eval.batch = 6, 32, 3
  c.eval.prompt_len, c.eval.greedy_tokens = 8, 8
  return c


@pytest.fixture(scope='module')
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp('convert')
  source = root / 'hf'
  cfg = hf_config(HF_CFG)
  hf_testdata.write_hf(source, HF_CFG, model_params(Transformer(cfg, rngs=nnx.Rngs(0))))
  hf_testdata.write_tokenizer(source, VOCAB)
  row = convert.convert(tiny_config(source, root / 'out'), log=lambda s: None)
  return source, root / 'out', row


def test_convert_writes_weights_tokenizer_and_a_record_that_hashes_them(converted):
  source, out, row = converted
  assert row['reload_bit_identical'] and row['name'] == 'rtn-int4-g16'
  assert row['weight_bytes'] < row['float_weight_bytes']
  record = read_record(str(out))  # verifies every artifact's sha256
  for name in ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json'):
    assert (out / name).read_bytes() == (source / name).read_bytes()
    assert name in record['artifacts']
  assert set(record['base_checkpoint']['files']) == {'config.json', 'model.safetensors'}
  assert record['model_config']['rope_scaling']['kind'] == 'llama3'
  (out / 'tokenizer_config.json').write_text('{}')  # an edited artifact is refused
  with pytest.raises(ValueError, match="artifact 'tokenizer_config.json'.*modified"):
    convert.load_converted(str(out))
  (out / 'tokenizer_config.json').write_bytes((source / 'tokenizer_config.json').read_bytes())


def test_converted_checkpoint_serves_text_and_chat_with_the_engine(converted):
  _, out, _ = converted
  model, tok, record = convert.load_converted(str(out))
  assert record['method'] == 'rtn' and tok.stop_ids == (2, 4)
  rendered = tok.render_chat([{'role': 'user', 'content': 'Hi'}])
  assert rendered == '<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n'
  ids = tok.chat('Hi')
  assert ids[0] == tok.encode('')[0] == 1 and ids.count(1) == 1  # one BOS: the template's
  engine = infer.Engine(model, infer.EngineConfig(max_batch=2, num_pages=24, max_len=96),
                        tokenizer=tok)
  params = infer.SamplingParams(temperature=0.0, max_tokens=6, stop_tokens=tok.stop_ids)
  outs = engine.generate([ids, 'To be, or not to be'], params)
  assert all(1 <= len(o) <= 6 for o in outs)
  assert np.all(np.asarray(outs[1]) < VOCAB) and isinstance(tok.decode(outs[1]), str)


def test_calibration_windows_come_after_the_evaluation_windows_and_start_with_bos(converted):
  from qjax.pipeline import calibration_set  # pylint: disable=g-import-not-at-top
  source, _, _ = converted
  tok = HFTokenizer.from_dir(str(source))
  c = tiny_config(source, '')
  data, windows = convert.corpus_data(tok, c.corpus, c.eval.seq_len, c.eval.windows)
  assert windows.shape == (6, 33) and np.all(windows[:, 0] == 1)  # <bos>
  ids = np.asarray(tok.encode(convert.corpus(c.corpus), add_special_tokens=False))
  np.testing.assert_array_equal(windows[:, 1:], ids[:6 * 33].reshape(6, 33)[:, 1:])
  np.testing.assert_array_equal(data.train, ids[6 * 33:])  # disjoint from evaluation
  calib, desc = calibration_set(c.calib, data)
  assert calib.shape == (8, 32) and np.all(calib[:, 0] == 1) and 'BOS' in desc
  assert 'training split' in desc


def test_bad_sources_are_refused_by_name(tmp_path, converted):
  source, _, _ = converted
  with pytest.raises(ValueError, match="config.source='.*nowhere' does not exist"):
    convert.load_source(str(tmp_path / 'nowhere'), str(tmp_path / 'o1'))
  bare = tmp_path / 'bare'
  bare.mkdir()
  for name in ('config.json', 'model.safetensors'):
    (bare / name).write_bytes((source / name).read_bytes())
  with pytest.raises(ValueError, match='has no tokenizer.json'):
    convert.load_source(str(bare), str(tmp_path / 'o2'))
  base = HFTokenizer.from_dir(str(source))
  (tmp_path / 'o3').mkdir()
  (tmp_path / 'o3' / 'tokenizer.json').write_bytes((source / 'tokenizer.json').read_bytes())
  with pytest.raises(ValueError, match='no chat template.*--config.chat=True'):
    HFTokenizer.from_dir(str(tmp_path / 'o3')).chat('Hi')
  assert base.chat_template == hf_testdata.CHAT_TEMPLATE
  assert json.loads((source / 'config.json').read_text())['model_type'] == 'llama'
  assert os.path.isfile(source / 'tokenizer.json')


def test_a_gemma_gguf_source_brings_its_tokenizer_bos_and_eos(tmp_path, monkeypatch):
  pytest.importorskip('gguf')
  import gguf_testdata as td  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('QJAX_CACHE_DIR', str(tmp_path / 'cache'))
  cfg = td.tiny_config(d_model=64, head_dim=32)
  td.write_gguf(tmp_path / 'tiny.gguf', cfg, td.random_params(cfg))
  model, tok, base, what = convert.load_source(str(tmp_path / 'tiny.gguf'),
                                               str(tmp_path / 'out'))
  assert base['files'].keys() == {'tiny.gguf'} and what.startswith('GGUF tiny.gguf')
  assert sorted(os.listdir(tmp_path / 'out')) == ['tokenizer.json', 'tokenizer_config.json']
  assert tok.stop_ids == (1,) and tok.encode('ab')[0] == 2 == convert.bos_id(tok)
  assert tok.chat_template is None  # the tiny GGUF has none
  assert model.config.sliding_window == cfg.sliding_window


def test_the_headline_gives_each_figure_with_its_sample(converted):
  _, _, row = converted
  line = convert.headline(row)
  assert row['greedy_positions'] == (4, 8) and row['kl_positions'] == (2, 32)
  assert f"KL {row['kl']:.4f} nats/token over 2 windows x 32 positions" in line
  assert 'over 4 prompts x 8 tokens' in line and line.startswith('rtn-int4-g16: perplexity')


def test_float_conversion_keeps_the_model_and_says_so(converted, tmp_path):
  source, _, _ = converted
  c = tiny_config(source, tmp_path / 'float')
  c.quant.method = 'float'
  row = convert.convert(c, log=lambda s: None)
  assert row['name'] == 'float' and row['kl'] == 0 and row['greedy_agreement'] == 1
  assert row['weight_bytes'] == row['float_weight_bytes'] and row['reload_bit_identical']
  model, _, record = convert.load_converted(str(tmp_path / 'float'))
  assert record['method'] == 'float'
  assert set(record['weight_formats'].values()) == {'float'}
  want = model_params(Transformer(hf_config(HF_CFG), rngs=nnx.Rngs(0)))
  got = model_params(model)
  for key, value in want.items():
    np.testing.assert_array_equal(np.asarray(got[key]), value)


def test_an_output_directory_must_be_new_or_empty(converted, tmp_path):
  # Converting a second model into a full OUT used to keep the first one's
  # tokenizer_config.json / generation_config.json, hash them into the second's record and
  # serve its chat template and stop ids.
  source, out, _ = converted
  with pytest.raises(ValueError, match=r"--config.out='.*out' already holds \[.*"
                                       r"'conversion_record.json'.*new or empty directory"):
    convert.convert(tiny_config(source, out), log=lambda s: None)
  (tmp_path / 'a-file').write_text('')
  with pytest.raises(ValueError, match=r"--config.out='.*a-file' is an existing file; pass a "
                                       'new directory'):
    convert.convert(tiny_config(source, tmp_path / 'a-file'), log=lambda s: None)
  for inside in (source, source / 'sub'):
    with pytest.raises(ValueError, match=r'--config.out=.* is or overlaps --config.source'):
      convert.convert(tiny_config(source, inside), log=lambda s: None)
  assert not (source / 'sub').exists()
  (tmp_path / 'empty').mkdir()
  convert.check_out(str(source), str(tmp_path / 'empty'))  # an empty directory is fine


def _without_tokenizer_json(source, tmp_path):
  """A copy of the converted source's checkpoint with no tokenizer.json."""
  half = tmp_path / 'half'
  half.mkdir()
  for name in ('config.json', 'model.safetensors', 'tokenizer_config.json'):
    (half / name).write_bytes((source / name).read_bytes())
  return half


def test_a_source_without_tokenizer_json_is_named(converted, tmp_path):
  half = _without_tokenizer_json(converted[0], tmp_path)
  with pytest.raises(ValueError, match=rf"--config.source='{half}' has no tokenizer.json"):
    convert.convert(tiny_config(half, tmp_path / 'o'), log=lambda s: None)


def test_a_failed_conversion_leaves_out_as_it_was(converted, tmp_path):
  # A conversion that failed left the tokenizer files it had copied in OUT, so the same
  # command, corrected, was refused: '--config.out=... already holds [...]'.
  source, _, _ = converted
  half = _without_tokenizer_json(source, tmp_path)
  empty = tmp_path / 'empty'
  empty.mkdir()
  for out in (tmp_path / 'new', empty):
    with pytest.raises(ValueError, match='has no tokenizer.json'):
      convert.convert(tiny_config(half, out), log=lambda s: None)
    assert not out.exists() if out.name == 'new' else not os.listdir(out)
    convert.check_out(str(source), str(out))  # the corrected command may use it


def test_a_weight_format_the_model_cannot_take_names_the_flags_before_any_work(converted,
                                                                              tmp_path):
  source, _, _ = converted
  c = tiny_config(source, tmp_path / 'g48')
  c.quant.group_size = 48  # d_model 64: groups of 48 split rows
  log = []
  with pytest.raises(ValueError, match=r'group_size=48 .* does not divide .*The weight format '
                                       r'comes from --config.bits=4 and '
                                       r'--config.group_size=48 \(0: one scale per output'):
    convert.convert(c, log=log.append)
  assert not any('perplexity' in line for line in log)  # before the float evaluation
  assert not (tmp_path / 'g48').exists()


@pytest.mark.parametrize('method,message', [
    ('gtpq', r"--config.method='gtpq' is not a conversion method; use one of \('float', "
             r"'rtn', 'gptq'.*\(did you mean --config.method=gptq\?\)"),
    ('fp16', r"--config.method='fp16' is not a conversion method"),
])
def test_an_unknown_method_is_named_before_any_work(tmp_path, method, message):
  # Was apply_method's "method='gtpq' is unknown" after the float model's evaluation,
  # without the flag or 'float'.
  c = tiny_config(tmp_path / 'no-such-source', tmp_path / 'out', method=method)
  with pytest.raises(ValueError, match=message):
    convert.convert(c, log=lambda s: None)
  assert not (tmp_path / 'out').exists()


def test_an_empty_source_is_named(tmp_path):
  # Was "--config.out=... is or overlaps --config.source=''".
  with pytest.raises(ValueError, match=r'--config.source is empty; pass --config.source=DIR'):
    convert.convert(tiny_config('', tmp_path / 'out'), log=lambda s: None)

def test_gemma3_270m_names_the_packaged_gguf(monkeypatch):
  from qjax.checkpoints import gemma3  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(gemma3, 'gemma3_270m_path', lambda: '/cache/gemma3-270m.gguf')
  assert convert.resolve_source('gemma3-270m') == '/cache/gemma3-270m.gguf'
  assert convert.resolve_source('/some/dir') == '/some/dir'


def _command(args, xla_flags):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', *args], cwd=root, capture_output=True,
                        text=True, timeout=600, env=env, check=False)


def test_generate_runs_a_checkpoint_in_its_own_precision(converted, subprocess_xla_flags):
  # It used to sample at 0.7 with an int8 KV cache: not the tokens of the float model.
  _, out, _ = converted
  r = _command(['experiments.generate', f'--config.checkpoint={out}', '--prompt=To be',
                '--config.max_tokens=2', '--config.engine.max_len=64'], subprocess_xla_flags)
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'KV cache float32, temperature 0 (greedy), up to 2 tokens' in r.stderr


def test_serve_names_the_flag_for_a_prompt_past_max_len(converted, subprocess_xla_flags):
  _, out, _ = converted
  r = _command(['experiments.serve', f'--config.checkpoint={out}', '--config.max_len=8',
                '--config.prompts=To be, or not to be, that is the question'],
               subprocess_xla_flags)
  assert r.returncode != 0
  assert '--config.max_tokens=24 > --config.max_len=8; pass --config.max_len=' in r.stderr
