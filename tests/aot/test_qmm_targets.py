"""The quantized matmul's byte and temp ratios on compile-only TPUs and a GPU (the compilers'
predictions, not measurements): every format of Llama-3.2-1B's shapes against bf16 at decode,
and the MLP matmul alone at groups of 32 and 64. docs/quantized_matmul.md has the table, the
command that makes it and why each expected failure below fails.

The programs compile in a subprocess (`python -m benchmarks.qmm_targets`, JAX_PLATFORMS=cpu):
compile-only TPUs load libtpu, whose machine-wide lock a pytest worker must never take. One
layer of the model on one TPU generation and an H200 by default: the v5e under jax < 0.12, the
v6e under jax 0.12 and later, so CI's two suites (Python 3.11 / jax 0.10 and Python 3.12 /
jax 0.12) together hold all three targets. QJAX_QMM_TARGETS_FULL=1 compiles the docs'
configuration (both TPUs, 2 layers, and a 512-token prefill on every target). Fails naming the
install command where the compile-only toolchains are missing, as the gate does.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from qjax.aot import toolchain

FULL = os.environ.get('QJAX_QMM_TARGETS_FULL') == '1'
# One TPU generation and the GPU in each suite (the v6e runs the v5e's paths and kernels at
# other block sizes); both TPUs in the full configuration, which the docs' table comes from.
_TPU = 'v5e-1' if tuple(int(p) for p in jax.__version__.split('.')[:2]) < (0, 12) else 'v6e-1'
TARGETS = ('v5e-1', 'v6e-1', 'h200') if FULL else (_TPU, 'h200')
TPUS = tuple(t for t in TARGETS if t != 'h200')
QUANTIZED = ('int8', 'int4', 'int4_g128', 'fp8', 'w8a8')
LIMITS = {'int4': 0.30, 'int4_g128': 0.30, 'int8': 0.55, 'fp8': 0.55, 'w8a8': 0.55}
TEMP_OF_WEIGHTS = 0.05
OWN_BYTES = 1.25   # a decode step's HBM bytes over its own weight + KV bytes
ONE_ROW_OWN_BYTES = 1.05  # the same at batch 1
PREFILL = 1.2      # prefill bytes and flops over bf16's
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Known gaps (docs/quantized_matmul.md): not asserted to fail, shown as expected failures.
GAPS = {}
TEMP_GAPS = {}
XLA_TPU = ("XLA:TPU's cost analysis counts a weight prefetched into VMEM about five times and "
           'one read in place once; the HBM model counts each transfer once')


def _have_toolchains() -> bool:
  st = toolchain.status()
  return st['tpu'] and st['gpu']


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
  if not _have_toolchains():
    pytest.fail(f'The compile-only toolchains are not installed in '
                f"{toolchain.status()['folder']}: run `{sys.executable} -m qjax.aot.install` "
                '(`make install-test` does).')
  out = tmp_path_factory.mktemp('qmm_targets') / 'table.json'
  # As the compile-for-target gate (tests/aot/test_aot_gate.py): the compilers' default
  # optimizations, no persistent cache, one CPU device.
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='', JAX_DISABLE_MOST_OPTIMIZATIONS='0',
             JAX_ENABLE_COMPILATION_CACHE='false')
  args = ['--layers=2', '--prefill=512'] if FULL else ['--layers=1']
  run = subprocess.run(
      [sys.executable, '-m', 'benchmarks.qmm_targets', f'--targets={",".join(TARGETS)}',
       '--batches=1,8', '--mlp', f'--json={out}', *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000, check=False)
  assert run.returncode == 0, run.stderr[-4000:]
  return json.loads(out.read_text())['rows']


def _row(rows, target, fmt, program):
  found = [r for r in rows if (r['target'], r['format'], r['program']) == (target, fmt, program)]
  assert found, (target, fmt, program)
  assert found[0]['compiled'], found[0]['error']
  return found[0]


def _cases(gaps):
  return [pytest.param(t, b, f, marks=[pytest.mark.xfail(reason=gaps[(t, b, f)], strict=False)]
                       if (t, b, f) in gaps else [])
          for t in TARGETS for b in (1, 8) for f in QUANTIZED]


@pytest.mark.parametrize('target,batch,fmt', _cases(GAPS))
def test_decode_step_reads_a_fraction_of_bf16s_bytes(rows, target, batch, fmt):
  r = _row(rows, target, fmt, f'decode B={batch}')
  assert r['hbm_ratio'] <= LIMITS[fmt], (r['hbm_ratio'], r['paths'])


@pytest.mark.parametrize('target,batch,fmt', _cases(TEMP_GAPS))
def test_decode_step_temp_is_a_fraction_of_the_weights(rows, target, batch, fmt):
  r = _row(rows, target, fmt, f'decode B={batch}')
  assert r['temp_of_weights'] <= TEMP_OF_WEIGHTS, r['temp_of_weights']


@pytest.mark.parametrize('target', TARGETS)
@pytest.mark.parametrize('batch', [1, 8])
def test_every_format_reads_about_its_own_bytes(rows, target, batch):
  # bf16 included: a ratio against an inflated bf16 would flatter every quantized format
  own = {f: _row(rows, target, f, f'decode B={batch}')['hbm_of_own']
         for f in ('bf16',) + QUANTIZED}
  gaps = [f for f in own if (target, batch, f) in GAPS]
  # One row reads each weight once: XLA:GPU's unfused multiply and reduce of a one-row dot
  # (decode_paths.matrix_einsum pads it to two rows) read a small weight three times.
  bound = ONE_ROW_OWN_BYTES if batch == 1 else OWN_BYTES
  over = {f: v for f, v in own.items() if v > bound and f not in gaps}
  assert not over, over
  assert all(v >= 0.99 for v in own.values()), own  # fewer than its own weights: a gap


@pytest.mark.parametrize('target', TPUS)
@pytest.mark.parametrize('batch', [1, 8])
@pytest.mark.xfail(reason=XLA_TPU)
def test_xla_bytes_accessed_ratios_on_tpu(rows, target, batch):
  ratios = {f: _row(rows, target, f, f'decode B={batch}')['bytes_ratio'] for f in QUANTIZED}
  assert all(ratios[f] <= LIMITS[f] for f in QUANTIZED), ratios


@pytest.mark.parametrize('target', TARGETS)
@pytest.mark.parametrize('fmt', ('int4_g32', 'int4_g64'))
def test_mlp_matmul_alone_at_small_groups(rows, target, fmt):
  for m in (1, 8):
    r = _row(rows, target, fmt, f'mlp M={m}')
    assert r['hbm_ratio'] <= 0.30 and r['temp_of_weights'] <= TEMP_OF_WEIGHTS, (m, r)


@pytest.mark.skipif(not FULL, reason='prefill compiles in the full configuration only')
@pytest.mark.parametrize('target', TARGETS)
@pytest.mark.parametrize('fmt', QUANTIZED)
def test_prefill_costs_what_bf16s_does(rows, target, fmt):
  r = _row(rows, target, fmt, 'prefill T=512 B=1')
  assert r['hbm_ratio'] <= PREFILL, r['hbm_ratio']
  if r['flops_ratio'] is not None:  # XLA:GPU gives no flops
    assert r['flops_ratio'] <= PREFILL, r['flops_ratio']
