"""The QAT sweep end to end on a tiny trained run: rows, conversion records, resume, table."""

import json
import os

import pytest

from qjax import pipeline

TINY = {'model.d_model': 32, 'model.num_layers': 1, 'model.num_heads': 2,
        'model.num_kv_heads': 1, 'model.head_dim': 32, 'model.d_ff': 64, 'data.seq_len': 32,
        'train.batch': 4, 'train.steps': 8, 'train.warmup': 2, 'train.eval_windows': 4,
        'checkpoint.every': 8}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  from configs import tiny_lm  # pylint: disable=g-import-not-at-top
  c = tiny_lm.get_config()
  for k, v in TINY.items():
    node, leaf = k.split('.')
    c[node][leaf] = v
  wd = tmp_path_factory.mktemp('qat_base')
  pipeline.train(c, str(wd))
  return wd


def _config(workdir, out_dir):
  from configs import qat_sweep  # pylint: disable=g-import-not-at-top
  c = qat_sweep.get_config()
  c.workdir, c.out_dir = str(workdir), str(out_dir)
  c.qat.steps, c.qat.batch, c.qat.warmup = 2, 2, 1
  c.eval.windows, c.eval.batch, c.eval.ref_batch = 4, 4, 2
  c.eval.greedy_prompts, c.eval.prompt_len, c.eval.greedy_tokens = 1, 8, 4
  return c


@pytest.mark.plots
def test_sweep_rows_records_resume_and_table(trained, tmp_path):
  from configs import qat_sweep  # pylint: disable=g-import-not-at-top
  points = [{'quant.bits': 4, 'quant.group_size': 32, 'quant.method': m}
            for m in qat_sweep.METHODS]
  c = _config(trained, tmp_path)
  rows = pipeline.run_qat_sweep(c, points, log=lambda s: None)
  assert [r['name'] for r in rows] == ['float', 'rtn-int4-g32', 'qat-int4-g32',
                                       'qat+distill-int4-g32']
  assert all(r['status'] == 'ok' for r in rows), [r.get('error') for r in rows]
  for r in rows[2:]:
    assert r['train_steps'] == 2 and r['train_seconds'] > 0 and r['rtn_ppl'] == rows[1]['ppl']
    assert r['reload_bit_identical'] and r['weight_bytes'] == rows[1]['weight_bytes']
    assert r['train_serve_max_abs_logit_diff'] <= 1e-5
    assert 'recovered' in r
    record = json.load(open(os.path.join(r['out_dir'], 'conversion_record.json')))
    assert 'quantization-aware training' in record['calibration']['procedure']
  assert 'distillation' in json.load(open(os.path.join(
      rows[3]['out_dir'], 'conversion_record.json')))['calibration']['procedure']
  for name in ('results.jsonl', 'table.md', 'ppl_vs_bytes.png', 'summary.json'):
    assert os.path.isfile(os.path.join(tmp_path, name))
  assert 'recovered' in open(os.path.join(tmp_path, 'table.md')).read()
  # Rerun: every point is skipped, same rows.
  logs = []
  again = pipeline.run_qat_sweep(c, points, log=logs.append)
  assert sum('finished earlier' in l for l in logs) == 3
  assert [r['ppl'] for r in again] == [r['ppl'] for r in rows]


def test_sweep_declares_the_full_grid_and_rejects_one_bit(trained, tmp_path):
  from configs import qat_sweep  # pylint: disable=g-import-not-at-top
  pts = qat_sweep.sweep()
  assert len(pts) == 36 and {p['quant.method'] for p in pts} == set(qat_sweep.METHODS)
  assert {p['quant.bits'] for p in pts} == {8, 4, 3, 2}
  c = _config(trained, tmp_path)
  rows = pipeline.run_qat_sweep(c, [{'quant.bits': 1, 'quant.method': 'qat'}],
                               log=lambda s: None)
  assert rows[1]['status'] == 'error' and 'ValueError' in rows[1]['error']
  assert 'bits=1' in rows[1]['error']


def test_kv_qat_point_serves_and_records_its_cache_format(trained, tmp_path):
  """qat.kv: trained and evaluated with the int4 cache, recorded, reloaded with it."""
  from qjax.checkpoints import load_quantized  # pylint: disable=g-import-not-at-top
  from qjax.nn import kv_format  # pylint: disable=g-import-not-at-top
  c = _config(trained, tmp_path)
  c.qat.kv = 'int4'
  points = [{'quant.bits': 8, 'quant.group_size': 32, 'quant.method': m} for m in ('rtn', 'qat')]
  rows = pipeline.run_qat_sweep(c, points, log=lambda s: None)
  assert [r['name'] for r in rows] == ['float', 'rtn-int8-g32-kvint4', 'qat-int8-g32-kvint4']
  assert all(r['status'] == 'ok' for r in rows), [r.get('error') for r in rows]
  kv = rows[2]
  # The RTN point is served with the same int4 cache, so the QAT point is compared with it.
  assert kv['kv_cache_format'] == rows[1]['kv_cache_format'] == 'int4-ch012'
  assert kv['float_cache_ppl'] != kv['ppl'] and kv['rtn_ppl'] == rows[1]['ppl']
  assert kv['reload_bit_identical']
  record = json.load(open(os.path.join(kv['out_dir'], 'conversion_record.json')))
  assert record['kv_cache_format'].startswith('int4-ch012 (quantized on write')
  assert kv_format(load_quantized(kv['out_dir'])[0]).name == 'int4-ch012'


def test_qat_point_from_gptq_with_pact(trained, tmp_path):
  """qat.init='gptq' starts QAT from a calibrated PTQ result; qat.pact learns W8A8 clips."""
  c = _config(trained, tmp_path)
  c.qat.init, c.qat.pact = 'gptq', 4.0
  c.calib.num_sequences, c.calib.seq_len, c.calib.batch_size = 4, 16, 4
  points = [{'quant.bits': 4, 'quant.group_size': 32, 'quant.act': 'int8',
             'quant.method': 'qat'}]
  rows = pipeline.run_qat_sweep(c, points, log=lambda s: None)
  r = rows[-1]
  assert r['status'] == 'ok', r.get('error')
  assert r['name'] == 'qat-int4-g32-aint8-fromgptq-pact4' and r['reload_bit_identical']
  record = json.load(open(os.path.join(r['out_dir'], 'conversion_record.json')))
  init = record['calibration']['initialisation']
  assert init['method'] == 'gptq' and init['data']['num_sequences'] == 4
  assert r['init_calibration_tokens_sha256'] == init['data']['token_sha256']
  assert any(q['pact'] for q in record['einsum_quant'].values())  # PACT saved, rebuilt on load
  c.qat.init = 'hqq'
  bad = pipeline.run_qat_sweep(c, points, log=lambda s: None)[-1]
  assert bad['status'] == 'error' and "qat.init='hqq'" in bad['error']
