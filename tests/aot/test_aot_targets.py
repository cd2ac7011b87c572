"""qjax.aot's named targets and its Report, with the compile-only toolchains: every name builds
its devices (a multi-chip name a mesh of its slice's shape), and a program compiled for one
reports each figure a compile check needs: compiled or the compiler's error, argument / output /
temp / generated-code bytes, whether it fits the chip's HBM (`qjax.costmodel`'s table), flops
and bytes accessed, the custom calls (Mosaic, Triton), compile seconds, and the roofline time
beside the cost model's estimate. Nothing is materialised: a 16 GB argument compiles here.

The compiles run in a subprocess with JAX_PLATFORMS=cpu (libtpu takes a machine-wide lockfile
in any process that loads it: `qjax.aot.toolchain`). Without the toolchains the test fails
naming the install command (`make test` installs them). About 10 s of CPU.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from qjax import costmodel
from qjax.aot import TARGETS, toolchain

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The names qjax.aot must know, with what each must be: (platform, device kind, mesh shape).
NAMED = {
    'v5e-1': ('tpu', 'TPU v5 lite', [1]), 'v5e-8': ('tpu', 'TPU v5 lite', [2, 4]),
    'v6e-1': ('tpu', 'TPU v6 lite', [1]), 'v6e-8': ('tpu', 'TPU v6 lite', [2, 4]),
    'v5p-8': ('tpu', 'TPU v5', [2, 2]), 'v4-8': ('tpu', 'TPU v4', [2, 4]),
    'h100': ('nvidia', 'NVIDIA H100 80GB HBM3', [1]), 'h200': ('nvidia', 'NVIDIA H200', [1]),
}
ESTIMATE_S = 1.5e-5

CODE = r'''
import json, sys
from qjax.aot import toolchain
status = toolchain.status()
if not (status['tpu'] and status['gpu']):
  print('NO_TOOLCHAIN', status['folder'])
  sys.exit(3)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from qjax import aot
from qjax.aot import _programs_kernels as kp
out = {'targets': {}, 'reports': {}}
for name in aot.TARGETS:
  mesh, t = aot.mesh(name), aot.target(name)
  out['targets'][name] = dict(shape=list(mesh.devices.shape), axes=list(mesh.axis_names),
                              platform=t.platform, kind=t.device_kind, count=t.device_count,
                              compile_only=t.compile_only)
mlp = lambda x, w: jnp.tanh(x @ w) @ w.T
x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
split = NamedSharding(aot.mesh('v5e-8'), P(None, ('x', 'y')))
# Never materialised: 16.4 GB (Llama-3-8B's bf16 weights) and 20 GiB of bf16.
big = jax.ShapeDtypeStruct((8192, 1_000_000), jnp.bfloat16)
huge = jax.ShapeDtypeStruct((2**15, 10 * 2**15), jnp.bfloat16)
est = float(sys.argv[1])
jobs = {'mlp v5e-1': (mlp, (x, w), 'v5e-1'),
        'mlp v5e-8': (mlp, (x, jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=split)), 'v5e-8'),
        'mlp h200': (mlp, (x, w), 'h200'),
        'big v5e-1': (jnp.sum, (big,), 'v5e-1'), 'big h200': (jnp.sum, (big,), 'h200'),
        'huge v5e-1': (jnp.sum, (huge,), 'v5e-1')}
for label, (fn, args, target) in jobs.items():
  out['reports'][label] = aot.compile_for(fn, *args, target=target, program=label,
                                          estimate_s=est).to_dict()
for label, prog, target in (('splash v5e-1', kp.splash_attention(), 'v5e-1'),
                            ('qmm h200', kp.qmm(8, None), 'h200'),
                            ('rejected v5e-1', kp.mosaic_rejected(), 'v5e-1')):
  out['reports'][label] = prog.compile(target).to_dict()
print('RESULT ' + json.dumps(out, default=str))
'''


@pytest.fixture(scope='module')
def result():
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='', PYTHONPATH=str(ROOT),
             JAX_ENABLE_COMPILATION_CACHE='false')
  run = subprocess.run([sys.executable, '-c', CODE, str(ESTIMATE_S)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  if run.returncode == 3:
    pytest.fail(f'The compile-only toolchains are not installed in {toolchain.status()["folder"]}'
                f': run `{sys.executable} -m qjax.aot.install` (`make install-test` does).')
  assert run.returncode == 0, run.stderr[-3000:]
  line = next(x for x in run.stdout.splitlines() if x.startswith('RESULT '))
  return json.loads(line[len('RESULT '):])


def test_every_named_target_builds_its_devices_and_a_multi_chip_name_a_mesh(result):
  assert set(NAMED) <= set(TARGETS) == set(result['targets'])
  for name, (platform, kind, shape) in NAMED.items():
    got = result['targets'][name]
    assert (got['platform'], got['kind'], got['shape']) == (platform, kind, shape), name
    assert got['count'] == TARGETS[name].n_devices and got['compile_only'], name
    assert len(got['axes']) == len(shape), name


def test_a_report_has_every_figure_of_a_compiled_program(result):
  for label in ('mlp v5e-1', 'mlp v5e-8', 'mlp h200'):
    r = result['reports'][label]
    assert r['compiled'] and r['error'] is None, r['error']
    for field in ('argument_bytes', 'output_bytes', 'alias_bytes', 'temp_bytes',
                  'generated_code_bytes', 'peak_bytes', 'hbm_traffic'):
      assert isinstance(r[field], int) and r[field] >= 0, (label, field)
    assert r['argument_bytes'] > 0 and r['output_bytes'] == 64 * 1024 * 2
    assert r['peak_bytes'] == (r['argument_bytes'] + r['output_bytes'] - r['alias_bytes'] +
                               r['temp_bytes'])
    assert r['fits'] is True and r['bytes_accessed'] > 0 and r['compile_s'] > 0
    assert r['estimate_s'] == ESTIMATE_S and r['toolchain']['jax']
    # The roofline: max(HBM traffic over the chip's bandwidth, flops over its peak).
    chip = costmodel.get_chip(TARGETS[r['target']].chip)
    want = max(r['hbm_traffic'] / chip.hbm_bw, (r['flops'] or 0) / chip.peak_flops(16))
    assert r['roofline_s'] == pytest.approx(want, rel=1e-9) and r['roofline_s'] > 0
  tpu, sharded, gpu = (result['reports'][k] for k in ('mlp v5e-1', 'mlp v5e-8', 'mlp h200'))
  assert tpu['flops'] >= 2 * 2 * 64 * 1024 * 4096 and tpu['bytes_source'] == 'xla cost analysis'
  assert tpu['generated_code_bytes'] > 0
  # XLA:GPU gives a compile-only device no cost analysis: the bytes are the HLO's, no flops.
  assert gpu['flops'] is None and gpu['bytes_source'] == 'hlo ops (upper bound)'
  # Over the v5e-8 mesh each chip holds an eighth of the weight and sums its share.
  assert sharded['argument_bytes'] < tpu['argument_bytes'] / 4
  assert sharded['collectives'] and not tpu['collectives']


def test_fits_follows_the_chip_table_without_materialising_the_argument(result):
  """16.4 GB of bf16 arguments (Llama-3-8B's weights): over a v5e's 16 GB, within an H200's
  141 GB; 20 GiB the TPU compiler itself refuses, and the report carries its message."""
  tpu, gpu = result['reports']['big v5e-1'], result['reports']['big h200']
  assert tpu['compiled'] and gpu['compiled']
  assert tpu['argument_bytes'] == gpu['argument_bytes'] == 8192 * 1_000_000 * 2
  assert tpu['hbm_bytes'] == costmodel.get_chip('tpu_v5e').hbm_bytes
  assert gpu['hbm_bytes'] == costmodel.get_chip('h200').hbm_bytes
  assert tpu['fits'] is False and gpu['fits'] is True
  huge = result['reports']['huge v5e-1']
  assert not huge['compiled'] and 'RESOURCE_EXHAUSTED' in huge['error'], huge['error']


def test_custom_calls_name_the_mosaic_and_triton_kernels(result):
  splash, qmm = result['reports']['splash v5e-1'], result['reports']['qmm h200']
  assert splash['kernels'] == ['mosaic'] and splash['custom_calls'].get('tpu_custom_call')
  assert any('splash' in n for n in splash['kernel_names'])
  assert 'triton' in qmm['kernels'] and qmm['kernel_names'] == {'_qmm': 1}
  assert not result['reports']['mlp v5e-1']['kernels']


def test_a_refused_program_reports_the_compilers_error(result):
  r = result['reports']['rejected v5e-1']
  assert not r['compiled'] and 'Mosaic failed to compile' in r['error']
  assert r['compile_s'] > 0 and r['peak_bytes'] is None and r['fits'] is None
  assert r['device_kind'] == 'TPU v5 lite'
