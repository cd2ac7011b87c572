"""Tiny experiment configs shared by the integration tests."""

import os

import pytest

from qjax import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = {
    'model.d_model': 32, 'model.num_layers': 2, 'model.num_heads': 2, 'model.num_kv_heads': 1,
    'model.head_dim': 32, 'model.d_ff': 64, 'data.seq_len': 32, 'train.batch': 4,
    'train.steps': 12, 'train.warmup': 2, 'train.log_every': 4, 'train.eval_windows': 8,
    'train.eval_batch': 8, 'checkpoint.every': 4, 'checkpoint.keep': 2,
}


def tiny_config(workdir, **extra):
  from configs import tiny_lm  # pylint: disable=g-import-not-at-top
  c = pipeline.apply_overrides(tiny_lm.get_config(), {**TINY, **extra})
  c.workdir = str(workdir)
  return c


def tiny_flags(workdir, **extra):
  return [f'--config.{k}={v}' for k, v in {**TINY, **extra}.items()] + [
      f'--config.workdir={workdir}']


@pytest.fixture(scope='session')
def trained_tiny(tmp_path_factory):
  """A finished tiny training run (shared by the PTQ and sweep tests)."""
  wd = tmp_path_factory.mktemp('tiny_run')
  pipeline.train(tiny_config(wd), str(wd))
  return wd


def tiny_reference(workdir, windows, ref_batch, greedy_prompts, prompt_len, greedy_tokens):
  """The pipeline's FloatReference of a finished tiny run, with a small eval."""
  from configs import quantize as quantize_config  # pylint: disable=g-import-not-at-top
  model, _, data = pipeline.load_trained(str(workdir))
  e = quantize_config.eval_config()
  e.windows, e.ref_batch, e.greedy_prompts = windows, ref_batch, greedy_prompts
  e.prompt_len, e.greedy_tokens = prompt_len, greedy_tokens
  return pipeline.FloatReference(model, data, e)
