"""Training manifests, provenance on resume, reruns, base hashes."""

import json
import os

import numpy as np
import pytest

from configs import quantize as quantize_config
from qjax import pipeline

from reliability_lib import (copy_run, flip_byte, rewrite_json, tiny_train_config,  # noqa: F401
                             trained)


def _metric_lines(wd):
  return [json.loads(l) for l in open(os.path.join(wd, 'metrics.jsonl'))]


def test_every_checkpoint_has_a_manifest(trained):
  m = pipeline.read_manifest(str(trained), 8)
  assert m['step'] == 8 and m['files'] and np.isfinite(m['train_loss'])
  assert m['provenance']['data_sha256'] == pipeline.trained_checkpoint(str(trained))[
      'data_sha256']
  assert pipeline.verify_checkpoint(str(trained), 8) == m


def test_flipped_bytes_are_refused_before_restore(copy_run):
  step_dir = os.path.join(copy_run, 'checkpoints', '8')
  files = sorted(os.path.join(d, n) for d, _, ns in os.walk(step_dir) for n in ns
                 if os.path.getsize(os.path.join(d, n)) > 64)
  flip_byte(files[0])
  rel = os.path.relpath(files[0], step_dir)
  with pytest.raises(ValueError, match=rf"file '{rel}' has sha256 .* corrupted"):
    pipeline.load_trained(str(copy_run))
  with pytest.raises(ValueError, match=r'corrupted'):  # and a resume refuses it too
    pipeline.train(tiny_train_config(copy_run), str(copy_run))


def test_resume_with_another_learning_rate_is_refused(copy_run):
  with pytest.raises(ValueError, match=r"train.lr: 0.003 -> 0.01"):
    pipeline.train(tiny_train_config(copy_run, **{'train.lr': 0.01}), str(copy_run))


def test_resume_with_another_data_source_is_refused(copy_run, tmp_path):
  text = tmp_path / 'other.txt'
  text.write_text('another corpus entirely. ' * 400)
  with pytest.raises(ValueError, match=r"data.source: 'pydoc_data.topics' -> '.*other.txt'"):
    pipeline.train(tiny_train_config(copy_run, **{'data.source': str(text)}), str(copy_run))


def test_a_deliberate_change_is_allowed_and_recorded(copy_run):
  c = tiny_train_config(copy_run, **{'train.lr': 0.01})
  c.checkpoint.allow_config_change = True
  pipeline.train(c, str(copy_run))
  lines = [json.loads(l) for l in open(os.path.join(copy_run, 'provenance.jsonl'))]
  assert lines[-1]['resumed_at_step'] == 8 and 'train.lr: 0.003 -> 0.01' in lines[-1]['changes']
  assert json.load(open(os.path.join(copy_run, 'config.json')))['train']['lr'] == 0.01


def test_rerunning_a_finished_run_keeps_loss_and_lines(copy_run):
  before = json.load(open(os.path.join(copy_run, 'final.json')))
  lines = _metric_lines(copy_run)
  again = pipeline.train(tiny_train_config(copy_run), str(copy_run))
  assert again['train_loss'] == before['train_loss'] and np.isfinite(again['train_loss'])
  assert _metric_lines(copy_run) == lines        # no duplicate training or eval line


def test_a_kill_after_the_last_checkpoint_duplicates_nothing(copy_run):
  # As if killed after the eval line but before final.json: the rerun writes it once.
  os.remove(os.path.join(copy_run, 'final.json'))
  with open(os.path.join(copy_run, 'metrics.jsonl'), 'a') as f:
    f.write('{"step": 8, "valid_p')  # and a torn line
  pipeline.train(tiny_train_config(copy_run), str(copy_run))
  lines = _metric_lines(copy_run)
  steps = [l['step'] for l in lines if 'loss' in l]
  assert steps == sorted(set(steps)) and sum('valid_ppl' in l for l in lines) == 1


def test_an_unfinished_run_is_refused_unless_allowed(copy_run):
  rewrite_json(os.path.join(copy_run, 'config.json'), lambda c: c['train'].update(steps=12))
  with pytest.raises(ValueError, match=r'the latest checkpoint is step 8 of 12'):
    pipeline.load_trained(str(copy_run))
  info = pipeline.trained_checkpoint(str(copy_run), allow_unfinished=True)
  assert (info['step'], info['steps'], info['finished']) == (8, 12, False)


def test_checkpoints_without_manifests_are_refused(copy_run):
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(copy_run, 'manifests'))
  with pytest.raises(ValueError, match=r'holds checkpoints \[4, 8\] but no manifests/'):
    pipeline.train(tiny_train_config(copy_run), str(copy_run))


def test_a_rerun_of_a_quantize_point_reproduces_its_content_hash(trained, tmp_path):
  model, _, data = pipeline.load_trained(str(trained))
  e = quantize_config.eval_config()
  e.windows, e.batch, e.ref_batch, e.greedy_prompts, e.prompt_len, e.greedy_tokens = (
      2, 2, 1, 1, 4, 2)
  ref = pipeline.FloatReference(model, data, e)
  q = quantize_config.quant_config()
  q.bits, q.exempt = 4, 'embed'
  base = pipeline.trained_checkpoint(str(trained))
  records = []
  for run in ('a', 'b'):
    row = pipeline.quantize_and_evaluate(ref, q, str(tmp_path / run), base)
    records.append(json.load(open(os.path.join(row['out_dir'], 'conversion_record.json'))))
  a, b = records
  assert a['content_sha256'] == b['content_sha256']
  assert a['base_checkpoint']['content_sha256'] == base['content_sha256']
  assert a['base_checkpoint']['step'] == 8 and a['base_checkpoint']['finished'] is True
  # The file hashes are not what proves it: Orbax's files are not reproducible.
  assert a['logits_fingerprint']['sha256'] == b['logits_fingerprint']['sha256']


def test_quantizing_into_a_file_is_refused_before_any_work(trained, tmp_path):
  target = tmp_path / 'existing_file'
  target.write_text('')
  q = quantize_config.quant_config()
  with pytest.raises(ValueError, match=rf"out_dir '{target}' exists and is a file"):
    pipeline.quantize_and_evaluate(None, q, str(target), 'x')


def test_an_exempt_pattern_that_matches_nothing_is_refused(trained):
  model, _, _ = pipeline.load_trained(str(trained))
  with pytest.raises(ValueError, match=r"quant.exempt='embeding' matches no layer"):
    pipeline.check_exempt(model, 'embeding')
  pipeline.check_exempt(model, 'embed|lm_head')
