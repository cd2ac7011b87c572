"""Sweeps: resumable, keep going past a failing point, table and plot written."""

import os

import pytest

from conftest import tiny_config

from configs import quantize as quantize_config
from qjax import eval as qeval
from qjax import pipeline


def test_runner_resumes_and_records_failures(tmp_path):
  path = str(tmp_path / 'r.jsonl')
  calls = []

  def run(name, ov):
    calls.append(name)
    if ov.get('bad'):
      raise ValueError('bad point: group size 7 does not divide 64')
    return {'ppl': float(ov['x'])}

  points = [('a', {'x': 1}), ('b', {'x': 2, 'bad': True}), ('c', {'x': 3})]
  rows = qeval.run_sweep(points, run, path, log=lambda s: None)
  assert [r['status'] for r in rows] == ['ok', 'error', 'ok']
  assert 'group size 7' in rows[1]['error']
  # A killed writer leaves a torn line: it is ignored, not fatal.
  with open(path, 'a') as f:
    f.write('{"name": "c", "sta')
  calls.clear()
  rows = qeval.run_sweep(points, run, path, log=lambda s: None)
  assert calls == ['b']               # finished points skipped; the failed one retried
  assert [r['name'] for r in rows] == ['a', 'b', 'c']
  with pytest.raises(ValueError, match='repeated'):
    qeval.run_sweep([('a', {}), ('a', {})], run, path)


@pytest.mark.plots
def test_ptq_sweep_end_to_end_on_tiny_model(trained_tiny, tmp_path):
  c = tiny_config(trained_tiny)
  c.out_dir = str(tmp_path / 'sweep')
  c.quant = quantize_config.quant_config()
  c.eval = quantize_config.eval_config()
  c.eval.windows, c.eval.ref_batch, c.eval.greedy_prompts = 4, 2, 2
  c.eval.prompt_len, c.eval.greedy_tokens = 8, 4
  points = [{'quant.bits': 8}, {'quant.bits': 4, 'quant.group_size': 32},
            {'quant.bits': 4, 'quant.group_size': 24}]      # 24 divides no layer: fails
  logs = []
  rows = pipeline.run_ptq_sweep(c, points, log=logs.append)
  assert [r['status'] for r in rows] == ['ok', 'ok', 'ok', 'error']   # float row first
  assert 'group_size=24' in rows[-1]['error']
  for f in ('results.jsonl', 'table.md', 'ppl_vs_bytes.png'):
    assert os.path.getsize(os.path.join(c.out_dir, f)) > 0
  table = open(os.path.join(c.out_dir, 'table.md')).read()
  assert 'rtn-int4-g32' in table and 'val ppl' in table
  assert os.path.isfile(os.path.join(c.out_dir, 'points', 'rtn-int8-channel',
                                     'conversion_record.json'))
  logs.clear()
  pipeline.run_ptq_sweep(c, points, log=logs.append)
  assert sum('skipped' in l for l in logs) == 2


def test_override_typo_fails(trained_tiny):
  c = tiny_config(trained_tiny)
  c.quant = quantize_config.quant_config()
  with pytest.raises(ValueError, match="no config field 'bitz'"):
    pipeline.apply_overrides(c, {'quant.bitz': 4})


def test_demo_config_declares_the_required_sweep(repo_root):
  sweep = pipeline.load_sweep(str(repo_root / 'configs' / 'demo.py'))()
  got = {(p['quant.bits'], p['quant.group_size']) for p in sweep}
  assert {(b, g) for b in (8, 4, 3) for g in (0, 128, 32)} <= got


def test_sweep_releases_executables_when_the_map_table_fills(tmp_path, monkeypatch):
  # A long sweep compiles a program per point; past 3/4 of vm.max_map_count jaxlib would
  # segfault on the next compile, so run_sweep drops jax's caches between points.
  from qjax.eval import process  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(process, 'release_executables', lambda: calls.append(1) or True)
  logs = []
  qeval.run_sweep([('a', {}), ('b', {})], lambda name, o: {'v': 1}, str(tmp_path / 'r.jsonl'),
                  log=logs.append)
  assert len(calls) == 2
  assert sum('released compiled executables' in line for line in logs) == 2
