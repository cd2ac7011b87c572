"""Every layout on a 2x2x2 and a 1x2x4 mesh equals the single-device model (f32, 1e-5).

Prefill of a 6-token prompt, then 16 teacher-forced decode steps, batch 8; K=8 kv heads for
'multihead', K=1 for the multiquery layouts. On 1x2x4 the x axis has one chip, so 2d_ws and
wg_x degenerate to smaller layouts; they must still be exact.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import sharding_testlib as lib
from qjax import sharding
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, quantize_model

LAYOUTS = [str(l) for l in sharding.all_layouts()]


@functools.lru_cache(maxsize=None)
def _reference(num_kv_heads):
  return lib.model(num_kv_heads), lib.reference(lib.model(num_kv_heads), lib.tokens())


def _assert_close(got, want, atol=1e-5):
  assert len(got) == len(want) == lib.STEPS + 1
  for step, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f'step {step}')


@pytest.mark.parametrize('mesh_shape', ['2x2x2', '1x2x4'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_layout_equals_single_device(eight_devices, layout, mesh_shape):
  model, want = _reference(lib.kv_heads(layout))
  sm = sharding.ShardedTransformer(model, sharding.make_mesh(mesh_shape), prefill=layout)
  got, cache = lib.sharded(sm, lib.tokens())
  _assert_close(got, want)
  assert cache.k[0].sharding.is_equivalent_to(sm.cache_shardings(cache).k[0], 4)


def test_prefill_and_decode_layouts_differ_over_the_same_weights(eight_devices):
  """Pope et al. Table 2: prefill weight-gathered XYZ, decode 2D weight-stationary."""
  model, want = _reference(1)
  sm = sharding.ShardedTransformer(model, sharding.make_mesh('2x2x2'),
                                   prefill='wg_xyz+mq_batch', decode='2d_ws+mq_batch')
  assert sm.state_shardings == sharding.state_shardings(
      sm.state, sm.rules['decode'], sm.mesh)          # no weight moves between phases
  got, cache = lib.sharded(sm, lib.tokens())
  _assert_close(got, want)
  assert cache.k[0].sharding.is_equivalent_to(sm.cache_shardings(cache, 'decode').k[0], 4)
  assert sm.record(cache) == {
      'mesh': '2x2x2', 'prefill_layout': 'wg_xyz+mq_batch', 'decode_layout': '2d_ws+mq_batch',
      'weight_bytes_per_device': sm.weight_bytes_per_device(), 'kv_format': 'float32',
      'kv_bytes_per_device': 2 * 2 * lib.B * lib.S * 16 * 4 // 8 + 4 * lib.B}


@pytest.mark.parametrize('layout', ['2d_ws+mq_batch', 'wg_xy+mq_heads', '1d_ws+multihead'])
def test_quantized_weights_shard_exactly(eight_devices, layout):
  """int4 (group 16, packed) and int8 per-channel weights, weight-only (dequant path)."""
  policy = QuantPolicy((QuantRule('.*mlp.*', int_format(4, group_size=16)),
                        QuantRule('.*', int_format(8))), path='dequant')
  qmodel, _ = quantize_model(lib.model(lib.kv_heads(layout)), policy)
  want = lib.reference(qmodel, lib.tokens(), steps=4)
  sm = sharding.ShardedTransformer(qmodel, sharding.make_mesh('2x2x2'), prefill=layout)
  got, _ = lib.sharded(sm, lib.tokens(), steps=4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_w8a8_keeps_its_global_activation_scales(eight_devices):
  """int8 x int8 products with a split contraction run under GSPMD (see `_hooks`), so the
  per-token activation scales are those of the whole row; only rounding ties can differ."""
  qmodel, _ = quantize_model(lib.model(1), QuantPolicy((QuantRule('.*', int_format(8),
                                                                  act=int_format(8)),)))
  want = lib.reference(qmodel, lib.tokens(), steps=2)
  sm = sharding.ShardedTransformer(qmodel, sharding.make_mesh('2x2x2'), '2d_ws+mq_batch')
  got, _ = lib.sharded(sm, lib.tokens(), steps=2)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=0.02 * np.abs(w).max())


@pytest.mark.parametrize('fmt', ['int8', 'fp8'])
def test_quantized_cache_sharded_over_batch(eight_devices, fmt):
  """Quantize on write, dequantize on read, cache split over the batch: same codes."""
  model = lib.model(1)
  want = lib.reference(model, lib.tokens(), steps=4, fmt=fmt)
  sm = sharding.ShardedTransformer(model, sharding.make_mesh('2x2x2'), '2d_ws+mq_batch')
  got, cache = lib.sharded(sm, lib.tokens(), steps=4, fmt=fmt)
  assert cache.format == {'int8': 'int8-ch012', 'fp8': 'fp8e4m3-ch012'}[fmt]
  assert cache.k[0].data.sharding.is_equivalent_to(cache.k[0].scale.sharding, 4)
  assert cache.k[0].data.addressable_shards[0].data.shape == (1, lib.S, 1, 16)
  # A float difference of 1 ulp upstream may flip one rounding; anything more is a bug.
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-3)


def test_cache_free_forward_under_a_layout(eight_devices):
  """`model(tokens)` (scoring, no cache) traced inside `use_layout`: same logits."""
  model, toks = lib.model(1), lib.tokens()
  want = np.asarray(model(toks))
  sm = sharding.ShardedTransformer(model, sharding.make_mesh('1x2x4'), '2d_ws+mq_batch')

  @jax.jit
  def score(state, toks):
    with sharding.use_layout(sm.rules['prefill'], sm.mesh):
      return nnx.merge(sm.graphdef, state)(toks)
  np.testing.assert_allclose(np.asarray(score(sm.state, toks)), want, rtol=0, atol=1e-5)
