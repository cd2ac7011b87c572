"""benchmarks/device_check.py in its smoke mode: every part of the check runs (a NameError or
a changed API fails here, not on the accelerator), and what it writes holds real numbers."""

import json

import pytest

from benchmarks import device_check


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
      assert r[f'b{b}']['host_loop_ms'] > 0 and r[f'b{b}']['device_loop_ms'] > 0
  by = {(r['model'], r['format']): r for r in saved['rows']}
  # int8 codes + scales take about half the bytes of bf16 (the norms stay bf16).
  assert by['llama32_1b', 'w8a8']['weight_bytes'] < 0.6 * by['llama32_1b', 'bf16']['weight_bytes']
  text = (tmp_path / 'device_check.md').read_text()
  assert '## llama32_1b' in text and '## gemma3_270m' in text and '| w8a8 |' in text
  assert (tmp_path / 'device_check.png').read_bytes()[:4] == b'\x89PNG'


def test_bad_names_fail_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match="model 'llama3' is unknown"):
    device_check.main(['--smoke', '--models=llama3', f'--out={tmp_path}'])
  with pytest.raises(SystemExit, match="format 'int5' is unknown"):
    device_check.main(['--smoke', '--formats=int5', f'--out={tmp_path}'])


def test_chip_and_int4_group_choices():
  assert device_check.int4_group(device_check.model_config('llama32_1b', False)) == 64
  assert device_check.int4_group(device_check.model_config('gemma3_270m', False)) == 128
  assert device_check.CHIP_OF_KIND[0] == ('h200', 'h200')
