"""The core on 8 simulated CPU devices with a sharded weight."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import qjax
from qjax import int_format, qdot, quantize


def _mesh(devices):
  return jax.make_mesh((8,), ('model',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)


def test_quantize_and_qdot_with_weight_sharded_over_8_devices(eight_devices):
  mesh = _mesh(eight_devices)
  w = jax.random.normal(jax.random.key(0), (256, 512))
  x = jax.random.normal(jax.random.key(1), (4, 256))
  fmt = int_format(4, group_size=64, channel_axes=(1,), symmetric=False)
  col = NamedSharding(mesh, P(None, 'model'))
  w_sharded = jax.device_put(w, col)
  q = jax.jit(lambda w: quantize(w, fmt))(w_sharded)
  # Shard the QArray's leaves along the output axis (packed codes pair neighbours along the
  # last axis, so each shard unpacks locally).
  q = jax.device_put(q, jax.tree.map(lambda _: NamedSharding(mesh, P(None, None, 'model'))
                                     if _.ndim == 3 else col, q))
  assert q.data.sharding.spec == P(None, 'model')
  assert len(q.data.addressable_shards) == 8
  assert q.data.addressable_shards[0].data.shape == (256, 32)
  y = jax.jit(lambda x, q: qdot(x, q, path='int8'))(x, q)
  ref = qdot(x, quantize(w, fmt), path='int8')
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(jax.jit(qjax.dequantize)(q), qjax.dequantize(quantize(w, fmt)))
  yd = jax.jit(lambda x, q: qdot(x, q, path='dequant'))(x, q)
  assert float(qjax.sqnr_db(yd, y)) > 35


def test_native_int4_codes_shard_and_multiply_like_packed(eight_devices):
  mesh = _mesh(eight_devices)
  w = jax.random.normal(jax.random.key(0), (256, 512))
  x = jax.random.normal(jax.random.key(1), (4, 256))
  packed = quantize(w, int_format(4, group_size=32, channel_axes=(1,)))  # 8 groups: 8 shards
  native = qjax.to_layout(packed, 'native')
  col = NamedSharding(mesh, P(None, 'model'))
  for spec in (P(None, 'model'), P('model', None)):  # output axis, contraction axis
    q = jax.device_put(native, jax.tree.map(lambda _, s=spec: NamedSharding(mesh, s), native))
    assert q.data.dtype == jnp.int4 and len(q.data.addressable_shards) == 8
    y = jax.jit(lambda x, q: qdot(x, q, path='native'), out_shardings=col)(x, q)
    np.testing.assert_allclose(y, qdot(x, packed, path='dequant'), rtol=1e-5, atol=1e-5)


def test_sharded_fake_quant_gradient(eight_devices):
  mesh = _mesh(eight_devices)
  w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 128)),
                     NamedSharding(mesh, P(None, 'model')))
  fmt = int_format(8, channel_axes=(1,))
  g = jax.jit(jax.grad(lambda w: jnp.sum(qjax.fake_quant(w, fmt) ** 2)))(w)
  assert g.sharding.is_equivalent_to(w.sharding, 2)
  np.testing.assert_allclose(g, 2 * qjax.fake_quant(w, fmt), rtol=1e-6)
