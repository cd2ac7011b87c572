"""experiments.aot: a tiny model compiled for v5e-1 and H200 from the command line (in a
subprocess started from another directory, so the compile-only toolchain never loads in a test
worker), its three files, and the errors a bad name gives."""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from experiments import aot as aot_command
from qjax import aot
from qjax.nn import TransformerConfig, num_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
_NO_TOOLCHAIN = not all(aot.toolchain.status()[p] for p in ('tpu', 'gpu'))


def _config(**fields):
  from configs import aot as aot_config  # pylint: disable=g-import-not-at-top
  c = aot_config.get_config('small')
  c.update(fields)
  return c


@pytest.mark.plots
@pytest.mark.skipif(_NO_TOOLCHAIN, reason='no compile-only toolchain: python -m qjax.aot.install')
def test_tiny_model_for_v5e_and_h200_writes_json_markdown_and_plot(tmp_path):
  out = tmp_path / 'out'
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_ENABLE_COMPILATION_CACHE='false')
  env.pop('PYTHONPATH', None)
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'experiments' / 'aot.py'),
       f'--config={ROOT}/configs/aot.py:small',
       '--config.batches=1', '--config.prefill_len=8', '--config.context=8',
       f'--config.out_dir={out}'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "the compiler's prediction" in proc.stdout and 'nothing ran' in proc.stdout
  for target in ('v5e-1', 'h200'):
    folder = out / f'tiny-{target}'
    result = json.loads((folder / 'aot.json').read_text())
    rows = {(r['program'], r['format']): r for r in result['rows']}
    assert set(rows) == {(p, f) for p in ('prefill T=8 B=1', 'decode B=1')
                         for f in ('bf16', 'int4')}, rows.keys()
    for row in rows.values():
      rep = row['report']
      assert rep['compiled'] and rep['fits'], rep['error']
      assert rep['peak_bytes'] == (rep['argument_bytes'] + rep['output_bytes'] -
                                   rep['alias_bytes'] + rep['temp_bytes'])
      assert row['roofline_ms_per_token'] > 0 and row['estimate_ms_per_token'] > 0
    assert rows[('decode B=1', 'bf16')]['speedup_vs_bf16'] == 1.0
    assert (rows[('decode B=1', 'int4')]['weight_bytes'] <
            rows[('decode B=1', 'bf16')]['weight_bytes'] / 2)
    md = (folder / 'aot.md').read_text()
    assert "(the compiler's prediction)" in md and 'nothing ran' in md
    assert '| decode B=1 | int4 | yes | yes |' in md, md
    assert (folder / 'aot.png').stat().st_size > 10_000
  tpu = json.loads((out / 'tiny-v5e-1' / 'aot.json').read_text())
  gpu = json.loads((out / 'tiny-h200' / 'aot.json').read_text())
  # The TPU's prefill runs the splash kernel (Mosaic); XLA:GPU gives no cost analysis.
  assert 'mosaic' in next(r for r in tpu['rows'] if r['program'].startswith('prefill')
                          )['report']['kernels']
  assert tpu['target']['bytes_source'] == 'xla cost analysis'
  assert gpu['target']['bytes_source'] == 'hlo ops (upper bound)'
  assert 'stands in' in gpu['attention'] or 'dense' in gpu['attention']


@pytest.mark.parametrize('field, value, names', [
    ('targets', 'v5e-1,tpu7', "'h200', 'h100'"),
    ('formats', 'bf16,int3', "'bf16', 'fp8'"),
    ('model', 'llama4', "'gemma3_270m', 'llama32_1b', 'llama3_8b'"),
    ('layers', 9, '1..8'),
])
def test_a_bad_name_fails_before_any_compile_naming_the_choices(field, value, names):
  c = _config(**{field: value}, **({'model': 'llama32_1b'} if field == 'layers' else {}))
  with pytest.raises(ValueError) as e:
    aot_command.make_plan(c)
  assert str(value).split(',')[-1] in str(e.value) and names.split(', ')[0] in str(e.value)
  for name in names.split(', '):
    assert name.strip("'") in str(e.value), str(e.value)


def test_gemma_layers_must_keep_its_local_global_pattern():
  with pytest.raises(ValueError, match='multiple of 6'):
    aot_command.make_plan(_config(model='gemma3_270m', layers=4))
  assert aot_command.make_plan(_config(model='gemma3_270m', layers=6)).depths == (6, 12)


def test_the_command_line_names_the_choices_of_a_bad_target(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.aot', f'--config={ROOT}/configs/aot.py:small',
       '--config.targets=v5e', f'--config.out_dir={tmp_path}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "Bad config: --config.targets='v5e'" in proc.stderr and "'v5e-1'" in proc.stderr
  assert not list(tmp_path.iterdir())  # nothing compiled, nothing written


def test_presets_have_the_published_shapes():
  shapes = {name: aot_command.load_model(name)[2] for name in ('llama32_1b', 'llama3_8b')}
  assert num_params(shapes['llama32_1b']) == 1_235_814_400  # Llama-3.2-1B (tied)
  assert num_params(shapes['llama3_8b']) == 8_030_261_248   # Llama-3-8B (untied)
  # The cost model's shape counts the same weights (it leaves out the norms).
  for cfg in shapes.values():
    shape = aot_command.model_shape(cfg, 'x')
    assert abs(shape.n_params - num_params(cfg)) < 1e-4 * num_params(cfg)
  assert aot_command.load_model('gemma3_270m')[2] == TransformerConfig.gemma3_270m()


def test_extrapolation_is_linear_in_the_layers_except_temp():
  def report(layers):
    return aot.Report(program='decode B=1', target='v5e-1', compiled=True,
                      argument_bytes=100 + 10 * layers, output_bytes=5, alias_bytes=0,
                      temp_bytes=7 * layers, generated_code_bytes=1, flops=2.0 * layers,
                      bytes_accessed=1000.0 + 50 * layers, hlo_bytes=60 * layers,
                      hbm_bytes=16e9, compile_s=1.0)
  r = aot_command.extrapolate(report(2), report(4), 2, 16, 16)
  assert (r.argument_bytes, r.bytes_accessed, r.flops, r.hlo_bytes) == (260, 1800.0, 32.0, 960)
  assert r.temp_bytes == 28 and r.peak_bytes == 260 + 5 + 28 and r.compile_s == 2.0
  assert r.roofline_s == pytest.approx(1800 / 819e9, rel=0.01)


def test_a_hf_config_json_or_a_gguf_names_the_model_without_weights(tmp_path):
  folder = ROOT / 'tests' / 'testdata' / 'hf_tiny' / 'llama'
  for spec in (folder, folder / 'config.json'):
    name, label, cfg = aot_command.load_model(str(spec))
    assert (name, cfg.d_model, cfg.num_layers, cfg.num_kv_heads) == ('llama', 32, 2, 2)
    assert 'config.json' in label
  pytest.importorskip('gguf')
  spec = importlib.util.spec_from_file_location(
      'gguf_testdata', ROOT / 'tests' / 'checkpoints' / 'gguf_testdata.py')
  gguf_testdata = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gguf_testdata)
  cfg = gguf_testdata.tiny_config()
  gguf_testdata.write_gguf(tmp_path / 'small.gguf', cfg, gguf_testdata.random_params(cfg))
  name, label, got = aot_command.load_model(str(tmp_path / 'small.gguf'))
  assert name == 'small' and 'GGUF' in label
  assert (got.d_model, got.num_layers, got.head_dim) == (cfg.d_model, cfg.num_layers,
                                                         cfg.head_dim)


@pytest.mark.plots
@pytest.mark.skipif(_NO_TOOLCHAIN, reason='no compile-only toolchain: python -m qjax.aot.install')
def test_a_hf_config_json_alone_compiles_from_the_command_line(tmp_path):
  """A HF config.json in a folder with no weights: the command compiles its shapes for a v5e
  (one format, decode only) and names the files after the folder."""
  folder = tmp_path / 'my-llama'
  folder.mkdir()
  shutil.copy(ROOT / 'tests' / 'testdata' / 'hf_tiny' / 'llama' / 'config.json', folder)
  out = tmp_path / 'out'
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_ENABLE_COMPILATION_CACHE='false')
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.aot', f'--config={ROOT}/configs/aot.py:small',
       f'--config.model={folder / "config.json"}', '--config.targets=v5e-1',
       '--config.formats=bf16', '--config.batches=1', '--config.prefill_len=0',
       '--config.context=8', f'--config.out_dir={out}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(p.name for p in folder.iterdir()) == ['config.json']  # no weight was needed
  result = json.loads((out / 'my-llama-v5e-1' / 'aot.json').read_text())
  [row] = result['rows']
  assert (row['program'], row['format']) == ('decode B=1', 'bf16')
  assert row['report']['compiled'] and row['report']['fits'], row['report']['error']
  assert 'HF config.json' in (out / 'my-llama-v5e-1' / 'aot.md').read_text()
