"""Sweep rows keyed by what produced them; torn tails; all-failed sweeps."""

import json

import pytest

from qjax import eval as qeval


def _keys(base, config='c1'):
  return {n: {'base': base, 'config': config} for n in 'ab'}


POINTS = [('a', {'x': 1}), ('b', {'x': 2})]


def _run(calls):
  def run(name, ov):
    calls.append(name)
    return {'ppl': float(ov['x'])}
  return run


def test_finished_points_with_the_same_key_are_skipped(tmp_path):
  path, calls = str(tmp_path / 'r.jsonl'), []
  qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base1'))
  rows = qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base1'))
  assert calls == ['a', 'b'] and [r['key']['base'] for r in rows] == ['base1', 'base1']


def test_a_changed_point_config_is_recomputed(tmp_path):
  path, calls = str(tmp_path / 'r.jsonl'), []
  qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base1'))
  qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base1', 'c2'))
  assert calls == ['a', 'b', 'a', 'b']


def test_a_directory_of_another_base_model_is_refused(tmp_path):
  path, calls = str(tmp_path / 'r.jsonl'), []
  qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base1'))
  with pytest.raises(ValueError, match=r"another base model .* base 'base1', this sweep's "
                                       r"base is 'base2'"):
    qeval.run_sweep(POINTS, _run(calls), path, log=lambda s: None, keys=_keys('base2'))
  assert calls == ['a', 'b']


def test_a_torn_last_line_is_repaired_before_appending(tmp_path):
  path = tmp_path / 'r.jsonl'
  qeval.append_result(str(path), {'name': 'a', 'status': 'ok'})
  with open(path, 'a') as f:
    f.write('{"name": "b", "sta')              # a killed writer
  qeval.append_result(str(path), {'name': 'c', 'status': 'ok'})
  lines = path.read_text().splitlines()
  assert [json.loads(l)['name'] for l in lines] == ['a', 'c']   # 'c' was not swallowed


def test_repair_tail_reports_what_it_did(tmp_path):
  path = tmp_path / 'r.jsonl'
  path.write_text('{"name": "a"}\n{"na')
  assert qeval.repair_tail(str(path)) is True and path.read_text() == '{"name": "a"}\n'
  assert qeval.repair_tail(str(path)) is False


def test_a_sweep_whose_every_point_failed_raises():
  rows = [{'name': 'float', 'status': 'ok'},
          {'name': 'int4-g7', 'status': 'error', 'error': 'ValueError: group size 7'},
          {'name': 'int3-g7', 'status': 'error', 'error': 'ValueError: group size 7'}]
  with pytest.raises(RuntimeError, match=r"every point of the sweep failed \(2\): "
                                         r"\['int4-g7', 'int3-g7'\]; first error: ValueError"):
    qeval.require_success(rows)
  rows[1]['status'] = 'ok'
  qeval.require_success(rows)


def test_rows_without_a_key_are_refused_when_keys_are_given(tmp_path):
  path = str(tmp_path / 'r.jsonl')
  qeval.append_result(path, {'name': 'a', 'status': 'ok'})
  with pytest.raises(ValueError, match=r"row 'a' without a key"):
    qeval.run_sweep(POINTS, _run([]), path, log=lambda s: None, keys=_keys('base1'))
