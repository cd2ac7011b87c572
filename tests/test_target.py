"""qjax.target: where the target is read from, and every path decision following it."""

import dataclasses

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
