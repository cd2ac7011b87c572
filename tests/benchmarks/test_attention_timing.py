"""benchmarks/attention_timing.py in smoke mode: every cell runs on CPU, the kernel agrees
with the scan in interpret mode, and what it writes holds the forms and real numbers."""

import ast
import json
import pathlib

import pytest

from benchmarks import attention_timing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_smoke_run_writes_json_and_markdown(tmp_path):
  result = attention_timing.main(['--smoke', '--models=gemma3_270m', '--kv=int8,bf16',
                                  f'--out={tmp_path}'])
  saved = json.loads((tmp_path / 'attention_timing.json').read_text())
  assert saved['environment']['backend'] == result['environment']['backend'] == 'cpu'
  (prefill,) = saved['prefill']
  assert prefill['before']['form'] == 'blockwise' and prefill['after']['form'] == 'sdpa_xla'
  assert prefill['before']['ms'] > 0 and prefill['after']['temp_bytes'] > 0
  assert prefill['speedup'] > 0
  assert [r['kv'] for r in saved['decode']] == ['int8', 'bf16']
  for r in saved['decode']:
    assert r['before']['form'] == 'scan' and r['before']['ms'] > 0
    # On CPU the kernel is checked in interpret mode, not timed.
    assert r['after']['form'] == 'kernel (interpret)' and 'ms' not in r['after']
    assert r['after']['max_abs_diff_vs_scan'] < 0.05
    assert r['kv_bytes_read'] > 0
  text = (tmp_path / 'attention_timing.md').read_text()
  assert '| gemma3_270m | 64 | int8 | scan' in text and 'not timed' in text
  assert 'nan' not in text  # an untimed cell has no speedup, written '-'


def test_unknown_model_fails_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match="model 'llama3' is unknown"):
    attention_timing.main(['--smoke', '--models=llama3', f'--out={tmp_path}'])



def test_it_stands_below_the_device_check():
  """The device check runs this as its attention section, so no import here, at any level,
  reaches the check: the environment and chip come from `benchmarks.device_env`."""
  tree = ast.parse((ROOT / 'benchmarks' / 'attention_timing.py').read_text())
  imported = {f'{n.module}.{a.name}' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              for a in n.names}
  imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  assert 'benchmarks.device_env.chip_for' in imported
  assert not any(m and m.startswith('benchmarks.device_check') for m in imported), imported
