"""The suite's backend setup (tests/conftest.py) behaves on whatever backend runs it: f32
matmuls at 'highest' precision, backend-marked tests skipped elsewhere with their reason, and
the mesh tests on the host's simulated CPU devices even beside a GPU or TPU."""

import jax
import jax.numpy as jnp
import pytest

import qjax_test_backends
from qjax import sharding


def test_f32_matmuls_run_at_highest_precision():
  assert jax.config.jax_default_matmul_precision == 'highest'
  a = jnp.ones((8, 8), jnp.float32)
  text = jax.jit(lambda a, b: a @ b).lower(a, a).as_text()
  assert 'HIGHEST' in text, text


@pytest.mark.backend('cpu', reason='checks the marker on CPU')
def test_a_cpu_test_runs_only_on_cpu():
  assert jax.default_backend() == 'cpu'


@pytest.mark.backend('gpu', 'tpu', reason='checks the marker on accelerators')
def test_an_accelerator_test_runs_only_on_an_accelerator():
  assert jax.default_backend() in ('gpu', 'tpu')


def test_skip_reason_names_the_backends_and_the_reason():
  assert qjax_test_backends.backend_skip_reason(('cpu',), 'why', 'cpu') is None
  why = qjax_test_backends.backend_skip_reason(('gpu', 'tpu'), 'fused attention', 'cpu')
  assert 'gpu / tpu only' in why and 'fused attention' in why and 'cpu' in why
  with pytest.raises(ValueError, match="'cuda'"):
    qjax_test_backends.backend_skip_reason(('cuda',), '', 'gpu')


def test_mesh_tests_get_cpu_devices_and_a_cpu_default_device(eight_devices):
  assert {d.platform for d in eight_devices} == {'cpu'} and len(eight_devices) == 8
  assert jnp.zeros(3).devices() == {eight_devices[0]}
  mesh = sharding.make_mesh('2x2x2')  # no devices given: the default device's platform
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in eight_devices)


def test_default_platform_devices_follow_jax_default_device():
  cpu = jax.devices('cpu')
  with jax.default_device(cpu[0]):
    assert sharding.default_platform_devices() == cpu
  with jax.default_device('cpu'):
    assert sharding.default_platform_devices() == cpu
  assert sharding.default_platform_devices() == jax.devices()
