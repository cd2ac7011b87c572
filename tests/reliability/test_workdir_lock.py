"""One training run per workdir: a second run is refused naming the first, and metrics lines
are keyed by step, so neither two runs nor a rerun can leave a step twice."""

import json
import os
import subprocess
import sys

import pytest

from qjax import pipeline
from qjax.train.workdir import workdir_lock

from reliability_lib import copy_run, tiny_train_config, trained  # noqa: F401

_HOLD = """
import sys, time
from qjax.train.workdir import workdir_lock
with workdir_lock(sys.argv[1], 'the first run'):
  print('held', flush=True)
  time.sleep(120)
"""


def test_a_second_run_on_a_workdir_is_refused_naming_the_first(tmp_path):
  wd = tmp_path / 'run'
  first = subprocess.Popen([sys.executable, '-c', _HOLD, str(wd)], stdout=subprocess.PIPE,
                           text=True)
  try:
    assert first.stdout.readline().strip() == 'held'
    with pytest.raises(RuntimeError, match=rf"workdir '{wd}' is in use by pid {first.pid} on "
                                           r'.* since .* \(the first run\).*Wait for it to '
                                           'finish.*or pass another workdir'):
      pipeline.train(tiny_train_config(wd), str(wd))
    assert not (wd / 'metrics.jsonl').exists()  # refused before any work
  finally:
    first.kill()
    first.wait()
  # The holder died without unlocking: the operating system dropped its lock.
  with workdir_lock(str(wd), 'a later run'):
    assert json.loads((wd / '.lock').read_text())['command'] == 'a later run'


def test_the_lock_is_released_when_a_run_fails(copy_run):
  with pytest.raises(ValueError, match='train.lr'):
    pipeline.train(tiny_train_config(copy_run, **{'train.lr': 0.01}), str(copy_run))
  with workdir_lock(str(copy_run)):
    pass


def test_a_rerun_keeps_one_metrics_line_per_step(copy_run):
  # What two concurrent runs used to leave: every training line twice, interleaved.
  path = os.path.join(copy_run, 'metrics.jsonl')
  lines = open(path).read().splitlines()
  train_lines = [l for l in lines if '"loss"' in l]
  with open(path, 'w') as f:
    f.write('\n'.join(l for l in train_lines for _ in range(2)) + '\n')
  pipeline.train(tiny_train_config(copy_run), str(copy_run))
  rows = [json.loads(l) for l in open(path)]
  steps = [r['step'] for r in rows if 'loss' in r]
  assert steps == sorted(set(steps)) == [json.loads(l)['step'] for l in train_lines]
  assert sum('valid_ppl' in r for r in rows) == 1
