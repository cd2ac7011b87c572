"""The compile-for-target gate: qjax's programs compiled for a TPU v5e and an NVIDIA H200 that
this machine does not have (`qjax.aot.gate`), checked here.

The compiles run once, in a process of their own (`python -m qjax.aot.gate`, JAX_PLATFORMS=cpu):
with libtpu loaded, a jax process takes a machine-wide lockfile, so no pytest worker may load
the toolchains. The fixture fails, naming the install command, where they are missing (`make
test` installs them). The records and each format's bytes against bf16 are written to
$QJAX_AOT_GATE_OUT (default: a temporary folder; the path is printed). Every figure is the
compiler's prediction.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from qjax import kernels as qjax_kernels
from qjax.aot import gate, programs, toolchain

# Temp budgets: what a program may hold besides its arguments and outputs, as a multiple of
# the model's size before quantization (its weights as bf16) plus its KV cache or page pools;
# for the QAT step and the kernels, a multiple of their argument bytes (the QAT step's are the
# weights and the optimizer state). Each is about 1.5x the largest ratio the compilers gave at
# the gate's shapes (jax 0.10.2 with libtpu 0.0.42 and the CUDA 12 plugin 0.10.2; jax 0.12.1
# with libtpu 0.0.52 and the CUDA 13 plugin 0.12.1; 2026-12-07), rounded up: prefill 2.6 (H200,
# int4 per channel under jax 0.12.1; 1.7 under 0.10.2), decode B=1 0.65, decode B=8 0.6, the
# decode loop 0.5, engine step 0.65 (0.80 at the mixed bucket on the TPU, Llama under jax
# 0.10.2: the step's queries laid out (B, W) for the ragged kernel), engine block 0.45, QAT
# step 2.0, kernels 0.8. A decode program that gained a bf16 copy of every weight, or an f32
# one, or a cache copied instead of updated in place (its donation lost), goes over.
TEMP_BUDGET = {'prefill': 4.0, 'decode_b1': 1.0, 'decode_b8': 1.0, 'decode_loop': 1.0,
               'engine_step': 1.2, 'engine_block': 1.0, 'qat_step': 3.0, 'kernel': 1.5}


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  st = toolchain.status()
  if not (st['tpu'] and st['gpu']):
    pytest.fail(f"The compile-only toolchains are not installed in {st['folder']} "
                f"(TPU: {st['tpu']}, GPU: {st['gpu']}): run `{sys.executable} -m "
                'qjax.aot.install` (`make install-test` does).')
  out = pathlib.Path(os.environ.get('QJAX_AOT_GATE_OUT') or tmp_path_factory.mktemp('aot_gate'))
  # The suite's settings are for fast CPU tests; the gate compiles at the compilers' defaults,
  # loads no persistent cache (compile-only executables are not reused) and needs one CPU
  # device.
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='', JAX_DISABLE_MOST_OPTIMIZATIONS='0',
             JAX_ENABLE_COMPILATION_CACHE='false')
  # One thread: the other pytest worker has the other core (two threads measured slower and
  # costlier beside it); XLA's own threads still use what is idle.
  cmd = [sys.executable, '-m', 'qjax.aot.gate', '--out', str(out), '--threads', '1',
         '--scope', os.environ.get('QJAX_AOT_GATE_SCOPE', 'ci')]
  run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
  path = out / 'gate.json'
  if run.returncode or not path.is_file():
    pytest.fail(f"`{' '.join(cmd)}` failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n"
                f'{run.stderr[-5000:]}')
  summary = [line for line in run.stdout.splitlines() if ' programs in ' in line]
  print(f'{path} and bytes.md: {summary[-1] if summary else run.stdout[-300:]}')
  return json.loads(path.read_text())


def _records(result, **where):
  return [r for r in result['records']
          if all(r['job'][k] == v or (k == 'variant' and r['job'][k].startswith(v))
                 for k, v in where.items())]


def _problems(result, category: str) -> list[str]:
  """`gate.check`'s messages of one category over every record, temp budgets included."""
  out = []
  for r in result['records']:
    held = r['held']
    basis = (held['bf16_weight_bytes'] + held['kv_bytes'] if held
             else r['report']['argument_bytes'] or 0)
    budget = TEMP_BUDGET[r['job']['kind']] * basis
    out += [msg for cat, msg in gate.check(r, budget) if cat == category]
  return out


def test_every_program_compiles_or_is_refused_as_expected(result):
  assert not (problems := _problems(result, 'compile')), '\n'.join(problems)


def test_the_expected_kernels_are_called(result):
  """Splash in TPU prefill, the Mosaic paged kernel in the TPU engine, the Triton one in the
  GPU engine (where this jax has Pallas Triton), and each kernel program its own kernel."""
  assert not (problems := _problems(result, 'kernel')), '\n'.join(problems)
  engine = _records(result, kind='engine_step') + _records(result, kind='engine_block')
  assert {r['job']['target'] for r in engine} == set(gate.TARGETS)
  assert all(r['job']['kernels'] for r in engine if r['job']['target'] == 'v5e-1')
  assert all(r['job']['kernels'] for r in _records(result, kind='prefill', target='v5e-1'))


def test_a_mixed_engine_step_on_one_tpu_calls_the_ragged_kernel_once_per_layer(result):
  """Decodes beside a prompt chunk over int8 pages: every row in one ragged kernel call per
  layer, the decode kernel not at all; on the GPU, Triton (decode rows) once per layer."""
  mixed = _records(result, kind='engine_step', variant='mixed')
  tpu = [r for r in mixed if r['job']['target'] == 'v5e-1']
  assert {r['job']['model'] for r in tpu} == {'llama', 'gemma3'}
  for r in tpu:
    layers = gate.models()[r['job']['model']].num_layers
    names = r['report']['kernel_names']
    assert r['report']['compiled'] and names.get(gate.RAGGED) == layers, (r['program'], names)
    assert not any('qjax_paged_attention' in n for n in names), names
    assert 'kv=int8' in r['program'] and ' C=1 ' in r['program']
  assert {r['job']['target'] for r in mixed} == set(gate.TARGETS)
  for r in mixed:
    if r['job']['target'] == 'h200':
      assert gate.RAGGED not in r['report']['kernel_names']
  [kernel] = _records(result, kind='kernel', variant='ragged int8')
  assert kernel['report']['kernel_names'] == {gate.RAGGED: 1}


def test_no_tpu_or_gpu_program_calls_the_cpu_kernel(result):
  assert not (problems := _problems(result, 'cpu_kernel')), '\n'.join(problems)


def test_no_program_holds_more_temp_than_its_budget(result):
  assert not (problems := _problems(result, 'temp')), '\n'.join(problems)


def test_the_gate_covers_every_model_format_program_and_target(result):
  seen = {(r['job']['target'], r['job']['model'], r['job']['fmt'], r['job']['kind'])
          for r in result['records']}
  for target in gate.TARGETS:
    assert {k for t, m, _, k in seen if t == target and m == 'llama'} == set(gate.KINDS)
    assert {m for t, m, _, _ in seen if t == target and m} == set(gate.models())
    for fmt in programs.FORMATS:  # the Llama decode sweep: the bytes record
      assert (target, 'llama', fmt, 'decode_b1') in seen
    for fmt in gate.WIDE:
      assert {(target, 'llama', fmt, k) for k in ('decode_b8', 'prefill')} <= seen
  assert {k for t, m, _, k in seen if t == 'v5e-1' and m == 'gemma3'} == (
      set(gate.KINDS) - {'qat_step'})
  assert {(m, f) for t, m, f, k in seen if t == 'v5e-1' and k == 'decode_b1'} >= {
      (m, f) for m in ('llama', 'gemma3') for f in programs.FORMATS}
  kernels = {r['job']['variant'] for r in _records(result, kind='kernel')}
  assert {'splash', 'mosaic_rejected', 'paged int8', 'paged int4', 'paged int8 H256 ring',
          'ragged int8', 'qmm int4 g128'} <= kernels


def test_the_negative_control_fails_the_gate_with_the_compilers_message(result):
  """A kernel Mosaic rejects is reported as not compiled, with Mosaic's message: expected
  here, so it passes; as an ordinary program it fails the gate."""
  [record] = _records(result, kind='kernel', variant='mosaic_rejected')
  rep = record['report']
  assert not rep['compiled'] and 'Mosaic failed to compile' in rep['error']
  assert 'infer-vector-layout' in rep['error']
  assert gate.check(record) == []
  ordinary = dict(record, job=dict(record['job'], error=None))
  [(category, problem)] = gate.check(ordinary)
  assert category == 'compile' and 'did not compile' in problem
  assert 'infer-vector-layout' in problem


def test_the_pallas_qmm_g64_refusal_on_tpu_is_the_tiling_rule(result):
  """pallas_qmm's (16, 64) blocks break the TPU (8, 128) rule: a known refusal, recorded as
  one until the kernel tiles for it (then this test fails and the expectation goes)."""
  for record in _records(result, kind='kernel', target='v5e-1', variant='qmm int'):
    if record['job']['variant'].endswith('g64'):
      assert not record['report']['compiled'] and gate.check(record) == []


def test_bytes_against_bf16_are_recorded_for_every_format(result):
  """Recorded, not yet asserted: the quantized-matmul work states what they must be."""
  rows = result['bytes_vs_bf16']
  have = {(r['target'], r['program'], r['format']) for r in rows if r['model'] == 'llama'}
  for target in gate.TARGETS:
    assert {(target, 'decode_b1', f) for f in gate.QUANTIZED} <= have
    for kind in ('decode_b8', 'prefill'):
      assert {(target, kind, f) for f in gate.WIDE if f != 'bf16'} <= have
  assert all(r['ratio'] > 0 for r in rows)


# Every Pallas kernel module qjax ships, and where the gate must see its kernel called:
# (target, 'kernel' for the gate's kernel programs or 'model' for a model's program, a
# substring of the kernel's name). On the TPU a model's '_qmm' is tpu_qmm (the TPU's default
# path, core/paths/pallas_tpu.py); pallas_qmm's is its kernel programs'. A GPU kernel needs
# this jax's Pallas Triton backend.
SHIPPED = {
    'splash': [('v5e-1', 'model', 'splash_mqa_fwd')],
    'paged_attention': [('v5e-1', 'model', 'qjax_paged_attention_mosaic'),
                        ('h200', 'model', 'qjax_paged_attention_triton')],
    'ragged_paged': [('v5e-1', 'model', gate.RAGGED)],
    'pallas_qmm': [('v5e-1', 'kernel', '_qmm'), ('h200', 'kernel', '_qmm')],
    'tpu_qmm': [('v5e-1', 'model', '_qmm')],
    'tpu_gather': [('v5e-1', 'model', '_gather')],
    'gpu_qmm_head': [('h200', 'model', '_qmm_nk')],
}


def test_every_pallas_kernel_qjax_ships_is_compiled_for_its_target(result):
  folder = pathlib.Path(qjax_kernels.__file__).parent
  shipped = {p.stem for p in folder.glob('*.py')  # a Pallas kernel, its own or jax's
             if 'pallas_call' in p.read_text() or 'pallas.ops' in p.read_text()}
  assert shipped == set(SHIPPED), f'a kernel module the gate does not name: {shipped}'
  missing = []
  for module, places in SHIPPED.items():
    for target, where, name in places:
      if target == 'h200' and not gate._triton():  # pylint: disable=protected-access
        continue
      called = [r for r in result['records'] if r['job']['target'] == target and
                (r['job']['kind'] == 'kernel') == (where == 'kernel') and
                any(name in n for n in r['report'].get('kernel_names') or {})]
      if not called:
        missing.append(f'{module}: no {where} program on {target} calls {name!r}')
  assert not missing, '\n'.join(missing)
