"""benchmarks/device_check.py in its smoke mode: every part of the check runs (a NameError or
a changed API fails here, not on the accelerator), and what it writes holds real numbers."""

import json
import sys

import pytest

from benchmarks import device_check


@pytest.mark.plots
def test_smoke_run_writes_json_markdown_and_plot(tmp_path):
  result = device_check.main(['--smoke', '--formats=bf16,w8a8', '--hf=no', '--threads=2',
                              f'--out={tmp_path}'])
  saved = json.loads((tmp_path / 'device_check.json').read_text())
  assert [(r['model'], r['format']) for r in saved['rows']] == [
      ('llama32_1b', 'bf16'), ('llama32_1b', 'w8a8'), ('gemma3_270m', 'bf16'),
      ('gemma3_270m', 'w8a8')]
  assert saved['environment']['backend'] == result['environment']['backend']
  for r in saved['rows']:
    assert 'error' not in r, r
    assert r['weight_bytes'] > 0 and r['prefill_tok_s'] > 0 and r['compile_s'] > 0
    for b in (1, 2):
      assert r[f'b{b}']['device_loop_ms'] > 0
    assert r['b1']['host_loop_ms'] > 0 and 'host_loop_ms' not in r['b2']  # --host_batches=1
  by = {(r['model'], r['format']): r for r in saved['rows']}
  # int8 codes + scales take about half the bytes of bf16 (the norms stay bf16).
  assert by['llama32_1b', 'w8a8']['weight_bytes'] < 0.6 * by['llama32_1b', 'bf16']['weight_bytes']
  text = (tmp_path / 'device_check.md').read_text()
  assert '## llama32_1b' in text and '## gemma3_270m' in text and '| w8a8 |' in text
  assert (tmp_path / 'device_check.png').read_bytes()[:4] == b'\x89PNG'
  att = saved['attention']  # the attention section: every cell of both models ran
  assert [(r['model'], r['kv']) for r in att['decode']] == [('llama32_1b', 'int8'),
                                                            ('gemma3_270m', 'int8')]
  assert all(r['before']['ms'] > 0 for r in att['prefill'] + att['decode'])
  assert '## Attention' in text and '### Paged decode attention' in text


def test_the_budget_bounds_the_whole_check(tmp_path):
  """--budget_s covers rows and attention: with none left for rows, every row is listed as
  not run and the attention section gets what remains (here nothing)."""
  saved = device_check.main(['--smoke', '--formats=bf16,int8', '--hf=no', '--threads=2',
                             '--budget_s=0', '--attention_budget_s=5', f'--out={tmp_path}'])
  assert saved['rows'] == [] and saved['not_run'] == [
      'llama32_1b bf16', 'llama32_1b int8', 'gemma3_270m bf16', 'gemma3_270m int8']
  att = saved['attention']
  assert att['prefill'] == att['decode'] == [] and len(att['not_run']) == 4
  text = (tmp_path / 'device_check.md').read_text()
  assert 'Not run (time budget): llama32_1b bf16' in text


def test_rows_the_check_exists_for_run_before_the_comparison_forms():
  order = device_check.row_order(['llama32_1b', 'gemma3_270m'], device_check.FORMATS, hf=True)
  assert order[:12] == [(m, f) for m in ('llama32_1b', 'gemma3_270m')
                        for f in ('hf-bf16', 'bf16', 'int4', 'w8a8', 'int8', 'fp8')]
  assert order[12:] == [(m, f) for m in ('llama32_1b', 'gemma3_270m')
                        for f in ('int4_pallas', 'int4_packed', 'fp8xfp8')]
  assert device_check.row_order(['gemma3_270m'], ['fp8xfp8', 'bf16'], hf=False) == [
      ('gemma3_270m', 'bf16'), ('gemma3_270m', 'fp8xfp8')]


def test_bad_names_fail_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match="model 'llama3' is unknown"):
    device_check.main(['--smoke', '--models=llama3', f'--out={tmp_path}'])
  with pytest.raises(SystemExit, match="format 'int5' is unknown"):
    device_check.main(['--smoke', '--formats=int5', f'--out={tmp_path}'])


def test_chip_and_int4_group_choices():
  assert device_check.int4_group(device_check.model_config('llama32_1b', False)) == 128
  assert device_check.int4_group(device_check.model_config('gemma3_270m', False)) == 128
  assert device_check.CHIP_OF_KIND[0] == ('h200', 'h200')


def test_int4_rows_differ_only_in_layout_and_path():
  cfg = device_check.model_config('llama32_1b', True)
  pols = {f: device_check.policy(f, cfg) for f in device_check.INT4_VARIANTS}
  assert {f: p.path for f, p in pols.items()} == {'int4': 'auto', 'int4_pallas': 'pallas',
                                                   'int4_packed': 'dequant'}
  assert len({p.rules for p in pols.values()}) == 1  # the same int4 g128 weights
  assert pols['int4'].rules[0].weight.group_size == 128


def _saved_runs(tmp_path) -> str:
  """Two saved device-check results (JSON files), as --render takes them."""
  run = {'environment': {'date_utc': '2026-12-04 17:06', 'device_kind': 'NVIDIA H200',
                         'backend': 'gpu', 'versions': {'jax': '0.11.2'}, 'python': '3.12.3'},
         'protocol': {'prefill': 512, 'prompt': 128, 'steps': 64, 'batches': [1]},
         'wall_s': 10.0}
  cell = {'host_loop_ms': 3.0, 'host_loop_tok_s': 333.0, 'device_loop_ms': 1.5,
          'device_loop_tok_s': 667.0, 'hbm_fraction_device_loop': 0.35}
  a = dict(run, rows=[{'model': 'llama32_1b', 'format': 'bf16', 'weight_bytes': 2**31,
                       'prefill_tok_s': 7e4, 'b1': cell, 'compile_s': 20.0}])
  b = dict(run, rows=[{'model': 'gemma3_270m', 'format': 'int4', 'group': 128,
                       'weight_bytes': 2**28, 'prefill_tok_s': 9e4, 'b1': cell}],
           not_run=['gemma3_270m fp8'])
  paths = []
  for name, res in (('a.json', a), ('b.json', b)):
    (tmp_path / name).write_text(json.dumps(res))
    paths.append(str(tmp_path / name))
  return ','.join(paths)


@pytest.mark.plots
def test_render_merges_saved_runs(tmp_path):
  merged = device_check.main([f'--render={_saved_runs(tmp_path)}', f'--out={tmp_path}'])
  assert len(merged['rows']) == 2 and merged['wall_s'] == 20.0
  text = (tmp_path / 'device_check.md').read_text()
  assert '| bf16 | 2,048 | 70,000 | 3.000 | 1.500 | 35% | 20.0 |' in text, text
  assert '| int4 g128 |' in text and 'Not run (time budget): gemma3_270m fp8.' in text
  assert (tmp_path / 'device_check.png').read_bytes()[:4] == b'\x89PNG'


def test_render_without_matplotlib_writes_the_table(tmp_path, monkeypatch):
  """matplotlib is an optional extra: a device image without it still gets JSON + table."""
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # `import matplotlib` raises
  with pytest.warns(UserWarning, match=r"plot: figure not written: .*pip install 'qjax\[plots"):
    device_check.main([f'--render={_saved_runs(tmp_path)}', f'--out={tmp_path}'])
  assert '| int4 g128 |' in (tmp_path / 'device_check.md').read_text()
  assert not (tmp_path / 'device_check.png').exists()


def test_decode_dispatch_runs():
  from benchmarks import decode_dispatch  # pylint: disable=g-import-not-at-top
  out = decode_dispatch.main(['--layers=1', '--steps=3', '--reps=1'])
  assert out['host'] > 0 and out['device'] > 0
