"""Every public core function: with and without jit, on 1 device and on 8 with a sharded weight."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import qjax

W = jax.random.normal(jax.random.key(0), (64, 128))
X = jax.random.normal(jax.random.key(1), (4, 64))
F4 = qjax.int_format(4, group_size=16, channel_axes=(1,), symmetric=False)

CASES = {
    'quantize+dequantize': lambda w, x: qjax.dequantize(qjax.quantize(w, F4)),
    'quantize fp8': lambda w, x: qjax.dequantize(qjax.quantize(w, qjax.fp8_format(
        'e5m2', channel_axes=(1,)))),
    'pack/unpack': lambda w, x: qjax.unpack(qjax.pack(qjax.quantize(
        w, qjax.int_format(3)).codes(), 3), 3, 128),
    'range absmax': lambda w, x: qjax.compute_range(w, F4, 'absmax')[1],
    'range percentile': lambda w, x: qjax.compute_range(
        w, F4.replace(calibration='percentile', calibration_arg=99.0))[1],
    'range mse': lambda w, x: qjax.compute_range(w, F4, 'mse')[1],
    'fake_quant': lambda w, x: qjax.fake_quant(w, F4),
    'fake_quant grad': lambda w, x: jax.grad(lambda w: jnp.sum(qjax.fake_quant(w, F4)))(w),
    'qdot dequant': lambda w, x: qjax.qdot(x, qjax.quantize(w, F4), path='dequant'),
    'qdot int8': lambda w, x: qjax.qdot(x, qjax.quantize(w, F4), path='int8'),
    'qdot w8a8': lambda w, x: qjax.qdot(x, qjax.quantize(w, qjax.int_format(
        8, channel_axes=(1,))), act_fmt=qjax.int_format(8)),
    'qdot fp8': lambda w, x: qjax.qdot(x, qjax.quantize(w, qjax.fp8_format(
        channel_axes=(1,))), act_fmt=qjax.fp8_format()),
    'metrics': lambda w, x: jnp.stack([qjax.sqnr_db(w, w * 1.01), qjax.mse(w, w * 1.01),
                                       qjax.max_abs_error(w, w * 1.01)]),
}


@functools.lru_cache(maxsize=None)
def _eager(name):
  return np.asarray(CASES[name](W, X))


@pytest.mark.backend(
    'cpu',
    reason=(
        'XLA:CPU runs these ops unfused; XLA:GPU fuses the jitted form (FMA contraction),'
        ' so a rounding tie can land one code apart'))
@pytest.mark.parametrize('name', sorted(CASES))
def test_jit_equals_eager(name):
  np.testing.assert_allclose(jax.jit(CASES[name])(W, X), _eager(name), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize('name', sorted(CASES))
def test_eight_devices_with_sharded_weight(name, eight_devices):
  mesh = jax.make_mesh((8,), ('model',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=eight_devices)
  w = jax.device_put(W, NamedSharding(mesh, P(None, 'model')))
  x = jax.device_put(X, NamedSharding(mesh, P()))
  out = jax.jit(CASES[name])(w, x)
  np.testing.assert_allclose(out, _eager(name), rtol=2e-6, atol=1e-6)
