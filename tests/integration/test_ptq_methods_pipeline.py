"""qjax.pipeline's PTQ point with calibrated methods: calibration set in the record, reload."""

import hashlib
import json
import os

import numpy as np
import pytest

from conftest import tiny_reference

from configs import ptq_algorithms
from configs import quantize as quantize_config
from qjax import checkpoints as qckpt
from qjax import nn as qnn
from qjax import pipeline
from qjax.algorithms.apply import METHOD_OPTIONS
from qjax.train import data as qdata


@pytest.fixture(scope='module')
def ref(trained_tiny):
  return tiny_reference(trained_tiny, 4, 2, 2, 8, 4)


def _calib(**kw):
  c = quantize_config.calib_config()
  c.num_sequences, c.seq_len, c.batch_size = 6, 16, 3
  c.update(kw)
  return c


def _quant(**kw):
  q = quantize_config.quant_config()
  q.update(kw)
  return q


def test_method_options_defaults_are_the_algorithms_defaults():
  o = quantize_config.method_options()
  for method, opts in o.items():
    for k, v in opts.items():
      assert METHOD_OPTIONS[method][k] == v, (method, k)


def test_gptq_point_records_its_calibration_set_and_reloads(ref, tmp_path):
  calib = _calib(seed=3)
  out = str(tmp_path / 'gptq')
  row = pipeline.quantize_and_evaluate(ref, _quant(method='gptq', bits=3), out, 'base',
                                   calib=calib, options=quantize_config.method_options())
  assert row['reload_bit_identical'] and row['name'] == 'gptq-int3-channel'
  # The record's hash is of exactly the windows the config describes (int32 little-endian).
  tokens = qdata.random_windows(ref.data.train, 6, 16, 3)
  want = hashlib.sha256(np.ascontiguousarray(tokens, '<i4').tobytes()).hexdigest()
  record = qckpt.read_record(out)
  cal = record['calibration']
  assert cal['method'] == 'gptq' and cal['data']['token_sha256'] == want
  assert cal['data']['num_sequences'] == 6 and cal['data']['seq_len'] == 16
  assert cal['data']['seed'] == 3 and 'training split' in cal['data']['source']
  assert cal['options']['damp'] == 0.01 and cal['sequential'] is True
  assert 'GPTQ' in cal['procedure'] and record['method'] == 'gptq'
  assert row['calibration_tokens_sha256'] == want
  # A different seed is a different calibration set, hence a different model.
  row2 = pipeline.quantize_and_evaluate(ref, _quant(method='gptq', bits=3), str(tmp_path / 'g2'),
                                    'base', calib=_calib(seed=4), reload_check=False)
  assert row2['calibration_tokens_sha256'] != want and row2['ppl'] != row['ppl']


@pytest.mark.parametrize('method,quant,options', [
    ('llm_int8', {'bits': 8}, {}),
    ('awq', {'bits': 4, 'group_size': 32}, {'fold_linear': False, 'alpha_grid': 4}),
    ('smoothquant', {'bits': 8, 'act': 'int8'}, {'fold_linear': False}),
])
def test_swapped_modules_are_rebuilt_on_load(ref, tmp_path, method, quant, options):
  opts = quantize_config.method_options()
  opts[method].update(options)
  out = str(tmp_path / method)
  row = pipeline.quantize_and_evaluate(ref, _quant(method=method, **quant), out, 'base',
                                   calib=_calib(), options=opts)
  assert row['reload_bit_identical']  # load_quantized rebuilt the structure, logits equal
  record = qckpt.read_record(out)
  assert record['calibration']['structure']  # something was swapped, and recorded
  loaded, _ = qckpt.load_quantized(out)
  layers = dict(qnn.einsum_layers(loaded))
  for path, kind in record['calibration']['structure'].items():
    quant = layers[path].quant  # rebuilt from the record's description
    assert qnn.EinsumQuant.from_dict(record['einsum_quant'][path]) == quant, path
    if kind == 'llm_int8':
      assert quant.outlier_threshold is not None, path
    else:
      assert kind == 'explicit_scale' and quant.input_scale, path
  if method == 'llm_int8':
    assert 0.0 < row['int8_fraction'] <= 1.0
    assert record['evaluation']['int8_fraction'] == row['int8_fraction']


def test_calibration_from_a_text_file(ref, tmp_path):
  path = tmp_path / 'calib.txt'
  path.write_text('calibration text, repeated. ' * 40)
  tokens, desc = pipeline.calibration_set(_calib(source=str(path)), ref.data)
  assert tokens.shape == (6, 16) and str(path) in desc
  assert set(np.unique(tokens)) <= set(ref.data.tokenizer.encode(path.read_text()).tolist())


def test_bad_calibration_config(ref, tmp_path):
  with pytest.raises(ValueError, match='needs a calibration set'):
    pipeline.quantize(ref, _quant(method='gptq', bits=4))
  with pytest.raises(ValueError, match=r'seq_len=10000000.*calib.num_sequences'):
    pipeline.calibration_set(_calib(seq_len=10000000), ref.data)
  with pytest.raises(ValueError, match="method='hqq' is unknown"):
    pipeline.quantize(ref, _quant(method='hqq'), calib=_calib())
  short = tmp_path / 'short.txt'
  short.write_text('tiny')
  with pytest.raises(ValueError, match='short.txt'):
    pipeline.calibration_set(_calib(source=str(short)), ref.data)


def test_method_sweep_names_points_and_keeps_going(trained_tiny, tmp_path):
  c = ptq_algorithms.get_config()
  c.workdir = str(trained_tiny)
  c.out_dir = str(tmp_path / 'sweep')
  c.warm_repeat = False
  c.calib.update(num_sequences=4, seq_len=16, batch_size=4)
  c.options.awq.alpha_grid = 3
  c.eval.windows, c.eval.ref_batch, c.eval.greedy_prompts = 3, 1, 1
  c.eval.prompt_len, c.eval.greedy_tokens = 8, 2
  # The config's own points, cut to one method each and an ablation, plus one bad point.
  points = [p for p in ptq_algorithms.sweep() if p.get('quant.bits') == 3 and
            p.get('quant.group_size') == 0][:5] + [
                {'quant.method': 'smoothquant', 'quant.bits': 4}]   # no act format: fails
  rows = pipeline.run_ptq_sweep(c, points, log=lambda s: None)
  names = [r['name'] for r in rows]
  assert names[:4] == ['float', 'rtn-int3-channel', 'gptq-int3-channel', 'awq-int3-channel']
  assert 'gptq-int3-channel+calib.sequential=False' in names
  assert [r['status'] for r in rows[:-1]] == ['ok'] * (len(rows) - 1)
  assert rows[-1]['status'] == 'error' and 'act' in rows[-1]['error']
  by = {r['name']: r for r in rows}
  # The papers' ordering at 3 bits, on the output the record was evaluated on.
  assert by['gptq-int3-channel']['kl'] < by['rtn-int3-channel']['kl']
  rec = json.load(open(os.path.join(c.out_dir, 'points', 'gptq-int3-channel',
                                    'conversion_record.json')))
  assert rec['calibration']['data']['num_sequences'] == 4


def test_ptq_point_served_with_a_quantized_kv_cache(ref, tmp_path):
  out = str(tmp_path / 'kv')
  row = pipeline.quantize_and_evaluate(ref, _quant(bits=8, kv='int4'), out, 'base')
  plain = pipeline.quantize_and_evaluate(ref, _quant(bits=8), str(tmp_path / 'plain'), 'base',
                                     reload_check=False)
  assert row['name'] == 'rtn-int8-channel-kvint4' and row['kv_cache_format'] == 'int4-ch012'
  assert plain['kv_cache_format'] is None and row['ppl'] != plain['ppl']
  assert row['reload_bit_identical']  # the KV format comes back from the record
  record = qckpt.read_record(out)
  assert record['kv_cache_format'].startswith('int4-ch012')
  with pytest.raises(ValueError, match="quant.kv.*'int3'"):
    pipeline.quantize_and_evaluate(ref, _quant(bits=8, kv='int3'), str(tmp_path / 'bad'), 'base')
