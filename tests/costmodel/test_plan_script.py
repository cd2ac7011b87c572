"""python -m experiments.plan end to end on both configs (subprocesses, a two-point plot sweep)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(config: str, *flags: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  return subprocess.run(
      [sys.executable, '-m', 'experiments.plan', f'--config={ROOT / config}',
       '--config.plot_batches=(1, 64)', *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.plots
def test_palm_config_prints_the_table_and_writes_the_plot(tmp_path):
  out = _run('configs/plan_palm540b.py', f'--config.out_dir={tmp_path}')
  assert out.returncode == 0, out.stderr[-2000:]
  text = out.stdout
  for column in ('compute', 'weights', 'KV', 'comm', 'MFU', 'mem/chip', 'fits', 'regime'):
    assert column in text
  assert 'best: 2d_ws+mq_heads on 4x4x4' in text  # prefill B=1
  assert 'best: 2d_ws+mq_batch on 4x4x4' in text  # decode B=64
  assert 'Table 2' in text and 'measured/roofline' in text
  assert (tmp_path / 'latency_vs_batch.png').stat().st_size > 10_000
  assert (tmp_path / 'table.txt').read_text().startswith('== prefill')


def test_gemma_config_runs_on_one_h200(tmp_path):
  out = _run('configs/plan_gemma3_h200.py', f'--config.out_dir={tmp_path}')
  assert out.returncode == 0, out.stderr[-2000:]
  assert '(+14 same)' in out.stdout and 'memory bound' in out.stdout


def test_bad_config_fails_with_the_fix(tmp_path):
  out = _run('configs/plan_palm540b.py', f'--config.out_dir={tmp_path}', '--config.chip=tpu_v3')
  assert out.returncode != 0
  assert "Did you mean 'tpu_v4'" in out.stderr + out.stdout


def test_a_slice_of_other_chips_fails_with_the_fix(tmp_path):
  out = _run('configs/plan_palm540b.py', f'--config.out_dir={tmp_path}',
             '--config.slice=v5e:2x4')
  assert out.returncode != 0
  assert 'set --config.chip=tpu_v5e' in out.stderr + out.stdout
  out = _run('configs/plan_palm540b.py', f'--config.out_dir={tmp_path}',
             '--config.slice=v4:2x2')
  assert out.returncode != 0
  assert 'v4:2x2x2' in out.stderr + out.stdout  # a 3-D torus names three axes


def test_costmodel_imports_neither_jax_nor_the_rest_of_qjax():
  # Load qjax.costmodel under a bare parent package so qjax/__init__ (which imports jax via
  # qjax.core) does not run; then nothing may have pulled jax or another subpackage in.
  code = (
      'import sys, types\n'
      f'pkg = types.ModuleType("qjax"); pkg.__path__ = [{str(ROOT / "qjax")!r}]\n'
      'sys.modules["qjax"] = pkg\n'
      'import qjax.costmodel as cm\n'
      'cm.plan("palm_540b", "tpu_v4", cm.Workload(64, 2048, 64), 64, "decode")\n'
      'bad = [m for m in sys.modules if m == "jax" or m.startswith("jax.")\n'
      '       or (m.startswith("qjax.") and not m.startswith("qjax.costmodel"))]\n'
      'assert not bad, bad\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
