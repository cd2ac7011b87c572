"""qjax.target: where the target is read from, and every path decision following it."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax import kernels
from qjax import target as qjax_target
from qjax.core import decode_paths, layouts, qarray
from qjax.core import QFormat, choose_path, qeinsum, quantize
from qjax.infer import paged_kernel
from qjax.nn.attention_forms import choose_form

TPU = qjax_target.Target('tpu', 'TPU v5 lite', compile_only=True, source='test')
H200 = qjax_target.Target('nvidia', 'NVIDIA H200', compute_capability=(9, 0), compile_only=True,
                          source='test')


def test_the_default_is_the_host_backend():
  t = qjax_target.current()
  assert t.platform == 'cpu' and t.backend == 'cpu' and not t.accelerator
  assert t.source == 'default backend' and t.device_count == jax.device_count()
  assert not t.compile_only


def test_use_nests_and_restores():
  with qjax_target.use(TPU) as outer:
    assert qjax_target.current() is outer and qjax_target.platform() == 'tpu'
    with qjax_target.use(H200):
      assert qjax_target.current().backend == 'gpu'
    assert qjax_target.current() is outer
  assert qjax_target.on_cpu()


def test_use_takes_platforms_devices_and_meshes():
  with qjax_target.use('tpu') as t:
    assert t.platform == 'tpu'
  devices = jax.devices('cpu')[:4]
  with qjax_target.use(devices) as t:
    assert t.device_count == 4 and t.platform == 'cpu'
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ('x', 'y'))
  with qjax_target.use(mesh) as t:
    assert t.device_count == 4
  with pytest.raises(ValueError, match="'v5e-1'.*qjax.aot"):
    with qjax_target.use('v5e-1'):
      pass
  with pytest.raises(TypeError, match='not a Target'):
    with qjax_target.use(3):
      pass


def test_mesh_abstract_mesh_and_default_device_are_read_in_that_order():
  devices = jax.devices('cpu')[:2]
  with jax.set_mesh(jax.sharding.Mesh(np.array(devices), ('x',))):
    t = qjax_target.current()
    assert t.source == 'mesh in context' and t.device_count == 2
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H100 80GB HBM3', num_cores=None,
                                    platform='cuda')
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ('x',),
                                                                abstract_device=gpu)):
    t = qjax_target.current()
    assert (t.platform, t.compute_capability, t.source) == ('nvidia', (9, 0), 'abstract mesh')
    with qjax_target.use(TPU):  # an explicit use wins over the mesh
      assert qjax_target.platform() == 'tpu'
  with jax.default_device(jax.devices('cpu')[1]):
    t = qjax_target.current()
    assert t.source == 'jax.default_device' and t.device_count == 1


def test_path_decisions_follow_the_target():
  int8 = QFormat(bits=8)
  assert choose_path(int8) == 'tiled' and layouts.default_layout() == 'packed'
  for t in (TPU, H200):
    with qjax_target.use(t):
      assert layouts.default_layout() == 'native'
      assert choose_path(int8) == 'native'
      assert not decode_paths.cpu_kernel() and not decode_paths.widens_low_floats()
      assert qarray.int4_bits() == 4  # compile-only accelerators pack s4
      facts = layouts.layout_facts()
      assert facts['device_kind'] == t.device_kind and facts['layout'] == 'native'


def test_kernel_info_names_the_target_before_the_kernel_is_asked_for(monkeypatch):
  monkeypatch.setattr(kernels, '_STATE', {})
  with qjax_target.use(TPU):
    assert kernels.info()['status'] == 'not used (target tpu)'


def test_paged_kernel_form_follows_the_target():
  pool = jnp.zeros((4, 16, 1, 64), jnp.bfloat16)
  assert paged_kernel.attention_form(pool, 1).name == 'scan'
  with qjax_target.use(TPU):
    form = paged_kernel.attention_form(pool, 1)
    assert (form.name, form.backend) == ('kernel', 'mosaic'), form
  with qjax_target.use(qjax_target.Target('tpu', 'TPU v5 lite', device_count=8)):
    assert paged_kernel.attention_form(pool, 1).name == 'scan'  # sharded pools: the scan


def _custom_calls(fn, *args) -> str:
  return str(jax.jit(fn).lower(*args).as_text())


def test_an_int8_program_traced_for_a_tpu_never_calls_the_cpu_kernel():
  """The host has the CPU kernel; a program for a TPU must not call it (it has no TPU
  emitter: compiling such a program for a TPU fails)."""
  w = quantize(jax.random.normal(jax.random.key(0), (256, 512)), QFormat(bits=8, channel_axes=(1,)))
  x = jnp.ones((1, 256), jnp.float32)
  f = lambda x, w: qeinsum('md,df->mf', x, w)
  host = _custom_calls(f, x, w)
  if kernels.available():
    assert 'qjax_gemv' in host
  for act in (None, QFormat(bits=8)):
    g = lambda x, w, act=act: qeinsum('md,df->mf', x, w, act_fmt=act)
    with qjax_target.use(TPU):
      assert 'qjax_gemv' not in _custom_calls(g, x, w)


def test_a_compile_only_gpu_names_the_cudnn_stand_in():
  """jax checks cuDNN against a local GPU: a compile-only H200 cannot compile the call, and
  the form says what stands in for it (a real H200 takes cuDNN)."""
  with qjax_target.use(H200):
    form = choose_form('auto', t=512, dtype='bfloat16', head_dim=128)
    assert form.name == 'dense' and 'compile-only' in form.reason
  with qjax_target.use(dataclasses.replace(H200, compile_only=False)):
    assert choose_form('auto', t=512, dtype='bfloat16', head_dim=128).name == 'cudnn'


# ------------------------------------------------------------ no path reads the host backend
# Who may name the host's backend: qjax.target (its last resort) and records that state it
# beside the target (`hardware_info`). Any other read in qjax/ is a path decision that would
# follow the host, not the target: a program traced for a compile-only TPU on a CPU host
# would take the CPU's path.
_BACKEND_READERS = {('qjax/target.py', 'current'), ('qjax/checkpoints/records.py', 'hardware_info')}
_BACKEND_CALLS = ('default_backend', 'get_backend')


def _backend_reads(source: str) -> list[tuple[int, str]]:
  """(line, enclosing function) of every `default_backend` / `get_backend` named in code
  (an attribute, a name or an import; comments and strings are not code)."""
  found = []

  def visit(node, func):
    for child in ast.iter_child_nodes(node):
      inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
      name = (child.attr if isinstance(child, ast.Attribute) else
              child.id if isinstance(child, ast.Name) else None)
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        name = next((a.name.rsplit('.', 1)[-1] for a in child.names
                     if a.name.rsplit('.', 1)[-1] in _BACKEND_CALLS), None)
      if name in _BACKEND_CALLS:
        found.append((child.lineno, func))
      visit(child, inner)

  visit(ast.parse(source), '<module>')
  return found


def test_the_scan_finds_a_backend_read_in_code_only():
  src = ('import jax\nfrom jax.extend.backend import get_backend\n'
         "def path():\n  # jax.default_backend() in a comment is no read\n"
         "  '''nor in a docstring: jax.default_backend()'''\n"
         "  return 'tpu' if jax.default_backend() == 'tpu' else jax.lib.xla_bridge.get_backend()\n")
  assert _backend_reads(src) == [(2, '<module>'), (6, 'path'), (6, 'path')]


def test_no_path_decision_in_qjax_reads_the_default_backend():
  """Only qjax.target reads `jax.default_backend()` (and jax's get_backend); a record may
  state it. Every other reader must ask `qjax.target.current()`, so that a program compiled
  for a TPU or GPU this host does not have takes that device's paths."""
  root = pathlib.Path(qjax_target.__file__).resolve().parents[1]
  readers = set()
  for path in sorted((root / 'qjax').rglob('*.py')):
    rel = path.relative_to(root).as_posix()
    for line, func in _backend_reads(path.read_text()):
      assert (rel, func) in _BACKEND_READERS, (
          f'{rel}:{line} ({func}) reads the host backend; decide from qjax.target.current()')
      readers.add((rel, func))
  assert readers == _BACKEND_READERS  # the allowed readers are still where this test says
  # The record that states the host's backend states the target beside it.
  from qjax.checkpoints import records  # pylint: disable=g-import-not-at-top
  hw = records.hardware_info()
  assert hw['backend'] == jax.default_backend() and hw['target'] == qjax_target.current().facts()
