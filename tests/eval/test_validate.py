"""qjax.eval.validate on the tiny model: every section present and consistent, the report
linked from a verified conversion record, and the formats it states are the ones that ran;
an LLM.int8() conversion's dynamic trigger rate in the report."""

import json
import os
import sys

import numpy as np
import pytest
from flax import nnx

from qjax import checkpoints as qckpt
from qjax.algorithms.llm_int8 import convert_layer, trigger_rate
from qjax.checkpoints import records
from qjax.core import int_format
from qjax.data import corpus
from qjax.eval import tasks as qtasks
from qjax.eval import validate
from qjax.eval import validation
from qjax.eval.validation import what_ran
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers,
                     quantize_model)
from qjax.train.data import ByteTokenizer

POLICY = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(8))))


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  cfg = TransformerConfig.tiny()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  qmodel, report = quantize_model(model, POLICY)
  out = str(tmp_path_factory.mktemp('point'))
  record = qckpt.conversion_record(
      base_checkpoint={'content_sha256': qckpt.content_sha256(nnx.state(model)),
                       'source': 'random init'},
      tokenizer='bytes', source_dtype='float32', layers=report.layers, group_size=32,
      granularity='channel', method='rtn', scale_method='absmax', zero_point_method='none',
      calibration={}, compute_dtype='float32', compute_path='auto',
      kv_cache_format='float32 (not quantized)', evaluation={})
  qckpt.save_quantized(out, qmodel, POLICY, record)
  tok = ByteTokenizer()
  text = corpus('tinyshakespeare')[:60_000]
  ids = tok.encode(text)
  wins = ids[:4 * 33].reshape(4, 33)
  tasks = qtasks.build(text, tok.encode, bos=None, n_items=6, context_tokens=24)
  # Shapes chosen so that sections share executables: latency (batch 2, prompt 8, 3 steps:
  # a cache of 12) reuses greedy's; the context limit (capped at 32) the memory decode step.
  rep = validate(model, qmodel, name='int8', out_dir=out, prompts=wins[:1, :32],
                 greedy_prompts=wins[1:3, :8], greedy_tokens=4, ppl_windows={'ts': wins},
                 ppl_batch=4, tasks=tasks, policy=POLICY,
                 memory=dict(batch=1, context=32, prompt=8),
                 latency_cfg=dict(prompt_len=8, steps=3, batches=(2,)),
                 context=dict(budget_bytes=1_000_000, batch=1, max_context=32),
                 long_window=ids[None, :33], log=lambda s: None)
  return model, qmodel, out, rep


def test_report_sections_are_present_and_consistent(run):
  _, _, _, r = run
  lg = r['logits']
  assert 0 <= lg['mean_abs_logit_diff'] <= lg['max_abs_logit_diff'] and lg['kl'] > 0
  g = r['greedy']
  assert len(g['per_position']) == 4 and all(0 <= x <= 1 for x in g['per_position'])
  assert np.isclose(np.mean(g['per_position']), g['agreement'])
  assert all(0 <= p <= 4 for p in g['prefix']) and np.isclose(np.mean(g['prefix']),
                                                              g['prefix_mean'])
  p = r['perplexity']['ts']
  assert np.isclose(p['delta'], p['quant'] - p['float']) and p['tokens'] == 4 * 32
  for t in r['tasks'].values():
    assert t['n'] == 6 and 0 <= t['float'] <= 1 and np.isclose(t['delta'],
                                                               t['quant'] - t['float'])
    lo, hi = t['delta_ci']
    assert lo <= t['delta'] <= hi
  assert r['tasks']['cloze']['chance'] == 0.25
  m = r['memory']
  assert m['weights_ratio'] == pytest.approx(1.0, abs=0.05)  # the planner's 5% target
  assert m['kv_ratio'] == pytest.approx(1.0, abs=0.05)
  assert m['measured']['prefill']['temp'] > 0 and m['measured']['decode']['temp'] > 0
  assert m['measured']['weights']['total'] < m['float_weights']['total']
  assert set(r['latency']['quant']['b2']) == {'prefill_tok_s', 'decode_ms_per_token'}
  c = r['context_limit']
  # 1 MB: the int8 model (~0.2 MB) fits the whole 32-token context, the float one (0.46 MB
  # + 32 x 1 KB of cache + its temp) too; both confirmed by compiling and running the step.
  assert c['quant']['confirmed'] and c['quant']['compiled_bytes'] <= 1_000_000
  assert c['quant']['predicted_max_context'] == 32
  assert c['quant']['compiled_bytes'] < c['float']['compiled_bytes']
  for k in ('float', 'quant'):  # the compiled planner predicts the built model's bytes
    assert c[k]['planner'] == 'compiled' and abs(c[k]['prediction_error']) < 0.05, c[k]
  pp = r['ppl_by_position']
  assert pp['tokens'] == 32 and len(pp['quant']) == 1 and pp['quant'][0]['hi'] == 32


def test_report_states_what_ran(run):
  model, _, _, r = run
  ran = r['what_ran']
  assert ran['embed'] == {'weight': 'float32', 'act': 'float'}
  assert ran['layers/0/mlp/up_proj']['weight'].startswith('int8') and (
      ran['layers/0/mlp/up_proj']['act'] == 'float')
  assert r['kv_cache'] == 'float32 (not quantized)'
  w4a8 = QuantPolicy((QuantRule('.*', int_format(4, group_size=32), act=int_format(8)),))
  ran = what_ran(quantize_model(model, w4a8)[0])  # read back from the layers, not the policy
  assert ran['layers/1/attn/o_proj']['weight'].startswith('int4-g32')
  assert ran['layers/1/attn/o_proj']['act'].startswith('int8')


@pytest.mark.plots
def test_files_written_and_linked_from_the_verified_record(run):
  model, _, out, r = run
  d = os.path.join(out, 'validation')
  with open(os.path.join(d, 'validation.json')) as f:
    assert json.load(f)['name'] == 'int8'
  md = open(os.path.join(d, 'validation.md')).read()
  for section in ('Fixed-prompt logits', 'Greedy agreement', 'Perplexity', 'Tasks', 'Memory',
                  'Latency', 'Context limit', 'Perplexity by position', 'What ran'):
    assert f'## {section}' in md
  assert os.path.getsize(os.path.join(d, 'validation.png')) > 10_000
  assert r['base_verified'].startswith('base content_sha256')
  loaded, rec = qckpt.load_quantized(out)  # the amended record still verifies in full
  assert rec['validation']['files']['md'] == 'validation/validation.md'
  assert 'validation/validation.json' in rec['artifacts']
  with open(os.path.join(d, 'validation.md'), 'a') as f:
    f.write('edited\n')
  with pytest.raises(ValueError, match='validation.md'):
    qckpt.load_quantized(out)


def test_another_base_is_refused(run):
  _, _, out, _ = run
  rec = records.read_record(out, verify=False)
  other = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match='converted from another base'):
    records.verify_base(rec, tree=nnx.state(other))


def test_llm_int8_trigger_rate_in_the_report(tmp_path):
  # The record's copy of it is written by the same `write(..., link=True)` that the record
  # test above checks; a second saved checkpoint would cost most of this file's time.
  model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
  qmodel, _ = quantize_model(model, POLICY)
  for _, layer in einsum_layers(qmodel):  # LLM.int8() at threshold 1: some columns, not all
    if layer.quantized:
      convert_layer(layer, 1.0)
  prompts = ByteTokenizer().encode(corpus('tinyshakespeare')[:200])[None, :12]
  r = validate(model, qmodel, name='llm-int8', out_dir=str(tmp_path), prompts=prompts,
               greedy_prompts=prompts[:, :4], greedy_tokens=1, log=lambda s: None)
  t = r['llm_int8_trigger']
  ref = trigger_rate(qmodel, prompts)
  assert t['layers'] == ref['layers'] and t['features'] == ref['features']
  assert 0 < t['features'] < 1 and 0 < t['tokens'] <= 1
  assert r['what_ran']['layers/0/attn/q_proj']['act'].startswith('int8 + float outlier')
  md = open(os.path.join(str(tmp_path), 'validation', 'validation.md')).read()
  assert '## LLM.int8() dynamic trigger rate' in md and 'layers/0/attn/q_proj' in md


def test_without_matplotlib_the_report_is_written_without_its_plot(run, tmp_path, monkeypatch):
  *_, rep = run
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # `import matplotlib` raises
  with pytest.warns(UserWarning, match=r"plot: figure not written: .*'plots' extra"):
    paths = validation.write(rep, str(tmp_path))
  assert sorted(paths) == ['json', 'md']
  assert os.path.exists(paths['md']) and not os.path.exists(tmp_path / 'validation' /
                                                            'validation.png')
