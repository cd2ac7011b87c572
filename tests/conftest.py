"""Test setup, the same on every backend (CPU, GPU, TPU).

* 8 simulated CPU devices (set before jax is imported) for the mesh tests; they run on CPU
  devices even where a GPU or TPU is the default backend (`eight_devices`).
* f32 matmuls at 'highest' precision: XLA runs f32 dots in TF32 on recent NVIDIA GPUs and in
  bf16 passes on TPUs by default, so a test comparing f32 results to CPU tolerances would
  fail there for reasons that are not qjax's numerics. On CPU the setting changes nothing.
* `@pytest.mark.backend('cpu', reason=...)`: a test of one backend's property (XLA:CPU's
  fusion decisions, the CPU kernel) runs there and is skipped elsewhere, with the reason.
* `@pytest.mark.plots`: a test of a figure, skipped with the reason where matplotlib (the
  optional 'plots' extra, in the test extra) is not installed, e.g. on an accelerator image.
* On an accelerator, no process preallocates the device memory (`make test-gpu` runs
  several pytest workers on one GPU).
"""

import importlib.util
import os

from importlib import metadata as _metadata  # noqa: E402

_JAXLIB = tuple(int(p) for p in _metadata.version('jaxlib').split('.')[:2])
# The suite compiles for a fast suite, not for fast programs: three quarters of its CPU time is
# XLA compiling small programs (14,600 compilations in one run, eager op-by-op dispatch
# included), which run in milliseconds. `jax_disable_most_optimizations` compiles at LLVM
# level 0 and, under jaxlib 0.10, the legacy fusion emitters with one codegen partition
# compile each program in about half the time (a loop of 240 small compilations: 42.9 s at the
# defaults, 26.9 s at level 0, 12.9 s with both). The HLO (what qjax emits: fusions, buffer
# assignment, the compiled-memory numbers the tests read) is the same; only the machine code
# differs, so numerics can differ in the last bits of a reduction. The one test whose
# tolerance is that tight asks for `full_optimization`. jaxlib 0.12 has neither XLA flag (an
# unknown flag aborts the process) and gains nothing from it (22.2 s vs 22.8 s), so it gets
# level 0 only. JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite at the defaults.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The mesh tests need the CPU backend beside an accelerator: JAX_PLATFORMS=cuda alone would
# not initialise it. The first platform listed stays the default backend.
if 'cpu' not in os.environ['JAX_PLATFORMS'].split(','):
  os.environ['JAX_PLATFORMS'] += ',cpu'
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
_FAST_COMPILE = os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'].lower() in ('1', 'true')
_FAST_COMPILE_FLAGS = (' --xla_cpu_use_fusion_emitters=false'
                       ' --xla_cpu_parallel_codegen_split_count=1'
                       if _JAXLIB < (0, 11) and _FAST_COMPILE else '')


def _with_flags(xla_flags, extra):
  """`xla_flags` plus each flag of `extra` whose name it does not already set."""
  have = {f.split('=')[0] for f in xla_flags.split()}
  return ' '.join([*xla_flags.split(), *(f for f in extra.split() if f.split('=')[0] not in have)])


# Added to what the caller set, whether or not XLA_FLAGS is set: `make test` exports
# XLA_FLAGS=--xla_force_host_platform_device_count=8, and the fast-compile flags apply there
# too (their effect on the suite's time: docs/testing.md).
os.environ['XLA_FLAGS'] = _with_flags(os.environ.get('XLA_FLAGS', ''),
                                      '--xla_force_host_platform_device_count=8' +
                                      _FAST_COMPILE_FLAGS)
# A compilation cache shared by the xdist workers and the subprocesses the tests start (they
# inherit the environment): much of the suite's CPU time is XLA compiling the same small
# programs again in another process. It is fresh for every run (a temporary folder made by the
# controller, removed at its exit), so an entry written by an earlier run with other flags or
# another jaxlib, or one torn by a crash, can never be read back. Set JAX_COMPILATION_CACHE_DIR
# yourself to keep one across runs, or JAX_ENABLE_COMPILATION_CACHE=false to turn it off.
# Off under jaxlib 0.12: in a full 3.12 run (jaxlib 0.12.0.1) a worker segfaulted inside
# jaxlib, once while writing an entry (`executable.serialize()` in
# compilation_cache.put_executable_and_time) and, with the cache off, once in
# backend_compile_and_load, both in tests/integration/test_ptq_methods_pipeline.py, which
# passes alone: a native crash in jaxlib that depends on the process's history; jaxlib 0.10
# reads and writes the cache fine. Off, one of the two crash sites is gone.
if _JAXLIB >= (0, 12):
  os.environ.setdefault('JAX_ENABLE_COMPILATION_CACHE', 'false')
if ('PYTEST_XDIST_WORKER' not in os.environ and 'JAX_COMPILATION_CACHE_DIR' not in os.environ
    and os.environ.get('JAX_ENABLE_COMPILATION_CACHE', 'true').lower() not in ('0', 'false')):
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  _CACHE_DIR = tempfile.mkdtemp(prefix='qjax-test-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE_DIR
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # noqa: E402
import pytest  # noqa: E402

# One setting for the whole suite (see the module docstring); a test that measures the default
# precision's own behaviour sets another inside `jax.default_matmul_precision(...)`.
jax.config.update('jax_default_matmul_precision', 'highest')

from qjax.eval import process as qprocess  # noqa: E402
from qjax_test_backends import backend_skip_reason  # noqa: E402

from hypothesis import settings  # noqa: E402

settings.register_profile('qjax', max_examples=40, deadline=None)
settings.load_profile('qjax')


def pytest_configure(config):
  config.addinivalue_line('markers', "backend(name, ..., reason=''): a test of a property of "
                          "these backends only ('cpu', 'gpu', 'tpu'); skipped on the others.")
  config.addinivalue_line('markers', "plots: needs matplotlib (the 'plots' extra); skipped "
                          'where it is not installed.')


def pytest_runtest_setup(item):
  for mark in item.iter_markers('backend'):
    why = backend_skip_reason(mark.args, mark.kwargs.get('reason', ''), jax.default_backend())
    if why:
      pytest.skip(why)
  if item.get_closest_marker('plots') and importlib.util.find_spec('matplotlib') is None:
    pytest.skip("needs matplotlib, the optional 'plots' extra (pip install 'qjax[plots]')")


@pytest.fixture
def eight_devices():
  """The 8 simulated CPU devices, whatever the default backend; the CPU is the default device
  for the test, so models, caches and `qjax.sharding.make_mesh()` land on them."""
  devs = jax.devices('cpu')
  assert len(devs) == 8, f'expected 8 simulated CPU devices (XLA_FLAGS), got {len(devs)}'
  with jax.default_device(devs[0]):
    yield devs


@pytest.fixture
def full_optimization():
  """Compile this test's programs at XLA's full optimization level (the suite compiles at
  level 0, above), for a tolerance tighter than the last-bit differences between the two (the
  jaxlib 0.10 emitter flags are process-wide and stay: the tolerance holds with them). jax's
  caches are dropped on the way in and out, so no executable crosses the boundary."""
  jax.clear_caches()
  jax.config.update('jax_disable_most_optimizations', False)
  yield
  jax.clear_caches()
  jax.config.update('jax_disable_most_optimizations',
                    os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'].lower() in ('1', 'true'))


@pytest.fixture
def abstract_gpu():
  """An abstract NVIDIA GPU for lowering to Triton on a machine without one: Pallas' Triton
  lowering reads the target GPU from the device (jax >= 0.12: from an abstract mesh's device
  when none is attached)."""
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H100 80GB HBM3', num_cores=None,
                                    platform='cuda')
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ('x',),
                                                                abstract_device=gpu)):
    yield gpu


@pytest.fixture(scope='session')
def repo_root():
  import pathlib  # pylint: disable=g-import-not-at-top
  return pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session')
def subprocess_xla_flags():
  """XLA_FLAGS for a subprocess that chooses its own device count: this suite's flags (the
  fast compiles) without the 8 simulated devices."""
  return ' '.join(f for f in os.environ['XLA_FLAGS'].split()
                  if not f.startswith('--xla_force_host_platform_device_count'))


@pytest.fixture
def run_notebook(repo_root, monkeypatch):
  """Execute colab/<name> with nbclient under `env`; returns (printed text, all outputs)."""
  def run(name, **env):
    import nbformat  # pylint: disable=g-import-not-at-top
    from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top
    for key, value in {'XLA_FLAGS': _FAST_COMPILE_FLAGS.strip(), **env}.items():
      monkeypatch.setenv(key, value)
    nb = nbformat.read(repo_root / 'colab' / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name='python3',
                   resources={'metadata': {'path': str(repo_root / 'colab')}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])]
    return ''.join(o.get('text', '') for o in outputs), outputs
  return run


# Each live compiled XLA CPU executable holds ~9 entries of the process's memory-map table, and
# jax's caches keep every executable a test compiled alive: one process running the whole suite
# reached vm.max_map_count after ~550-630 tests, and jaxlib segfaults on the failed mmap
# (docs/py312_crash.md). After each test, past 3/4 of the limit, jax's caches are dropped
# (`qjax.eval.process.release_executables`, which long sweeps call too); below it this is one
# read of /proc/self/maps per test and nothing else.
@pytest.fixture(autouse=True)
def _stay_below_the_map_limit():
  yield
  qprocess.release_executables()
