"""python -m experiments.train: a killed run resumes from its latest checkpoint to the same loss."""

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_flags


@pytest.fixture
def env(subprocess_xla_flags):
  """One device (no simulated mesh); the suite's other XLA flags (fast compiles) kept."""
  return dict(os.environ, XLA_FLAGS=subprocess_xla_flags, JAX_PLATFORMS='cpu',
              PYTHONUNBUFFERED='1')


def _train(env, workdir, *extra, timeout=300):
  cmd = [sys.executable, '-m', 'experiments.train',
         '--config=' + os.path.join(ROOT, 'configs', 'tiny_lm.py')] + tiny_flags(workdir) + list(
             extra)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def _final(workdir):
  with open(os.path.join(workdir, 'final.json')) as f:
    return json.load(f)


def test_kill_and_restart_gives_the_same_final_loss(env, tmp_path):
  steps = ['--config.train.steps=24', '--config.checkpoint.every=6']
  # Uninterrupted reference run.
  ref = _train(env, tmp_path / 'ref', *steps)
  assert ref.returncode == 0, ref.stderr[-2000:]
  # A run killed (SIGKILL) after its first checkpoints, then restarted with the same command.
  wd = tmp_path / 'killed'
  cmd = [sys.executable, '-m', 'experiments.train',
         '--config=' + os.path.join(ROOT, 'configs', 'tiny_lm.py')] + tiny_flags(wd) + steps + [
             '--config.train.log_every=1']
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  killed_at = None
  for line in proc.stdout:
    if line.startswith('step') and int(line.split()[1].split('/')[0]) >= 14:
      killed_at = int(line.split()[1].split('/')[0])
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert killed_at is not None and not (wd / 'final.json').exists()
  again = _train(env, wd, *steps)
  assert again.returncode == 0, again.stderr[-2000:]
  # Orbax saves asynchronously: the latest *finalized* checkpoint (6 or 12) is resumed.
  resumed = [l for l in again.stdout.splitlines() if l.startswith('resumed from checkpoint')]
  assert resumed and int(resumed[0].split()[-1]) in (6, 12), again.stdout[:500]
  a, b = _final(tmp_path / 'ref'), _final(wd)
  assert a['train_loss'] == b['train_loss']
  assert a['valid_ppl'] == b['valid_ppl']


def test_unknown_config_key_and_bad_type_fail_loudly(env, tmp_path):
  r = _train(env, tmp_path, '--config.train.stepz=3')
  assert r.returncode != 0 and 'stepz' in r.stderr
  r = _train(env, tmp_path, '--config.train.steps=many')
  assert r.returncode != 0 and 'many' in r.stderr
