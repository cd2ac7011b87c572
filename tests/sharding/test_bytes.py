"""Per-device bytes of weights and KV cache: what each device holds == what the layout says.

Three independent numbers agree: the bytes in `addressable_shards[0]`, the layout's
prediction from its shardings, and (where it has one) `qjax.costmodel`'s analytic figure.
"""

import jax
import pytest

import sharding_testlib as lib
from qjax import costmodel, sharding
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, axes as ax, quantize_model

LAYOUTS = [str(l) for l in sharding.all_layouts()]


def _held(tree) -> int:
  return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def _kv_shards(rules, mesh):
  used = rules.axes(ax.CACHE_BATCH) + rules.axes(ax.ACT_KV_HEADS)
  n = 1
  for a in used:
    n *= mesh.shape[a]
  return n


@pytest.mark.parametrize('mesh_shape', ['2x2x2', '1x2x4'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_bytes_match_the_layout(eight_devices, layout, mesh_shape):
  k = lib.kv_heads(layout)
  mesh = sharding.make_mesh(mesh_shape)
  sm = sharding.ShardedTransformer(lib.model(k), mesh, prefill=layout)
  for value, s in zip(jax.tree.leaves(sm.state), jax.tree.leaves(sm.state_shardings)):
    assert value.addressable_shards[0].data.nbytes == sharding.shard_bytes(value, s)
  assert _held(sm.state) == sm.weight_bytes_per_device()
  # Every FFN matrix is split over all 8 chips under every layout (stored 2D or 1D).
  ffn = [sm.state['layers'][i]['mlp'][p]['w'].get_value() for i in range(2)
         for p in ('gate_proj', 'up_proj', 'down_proj')]
  m = lib.model_shape(k)
  assert _held(ffn) == m.n_layers * m.ffn_params_per_layer * 4 // mesh.size

  cache = sm.init_cache(lib.B, lib.S)
  c = lib.config(k)
  total = 2 * c.num_layers * lib.B * lib.S * c.num_kv_heads * c.head_dim * 4
  predicted = total // _kv_shards(sm.rules['decode'], mesh)
  lengths = 4 * lib.B  # one int32 per row, replicated
  assert _held(cache) - lengths == sm.kv_bytes_per_device(cache) - lengths == predicted
  if mesh_shape == '2x2x2':  # the cost model rejects degenerate meshes such as 1x2x4 for 2D
    est = costmodel.estimate(m, 'tpu_v4', '2x2x2', layout, costmodel.Workload(
        batch=lib.B, prompt_len=lib.T, gen_len=lib.STEPS, kv_bits=32), phase='decode')
    assert est.memory.kv_bytes == predicted
    assert _kv_shards(sm.rules['decode'], mesh) == est.plan.kv_shards


@pytest.mark.parametrize('fmt', ['int8', 'fp8', 'int4'])
def test_quantized_cache_bytes_divided_by_the_batch_shards(eight_devices, fmt):
  mesh = sharding.make_mesh('2x2x2')
  sm = sharding.ShardedTransformer(lib.model(1), mesh, prefill='2d_ws+mq_batch')
  cache = sm.init_cache(lib.B, lib.S, fmt=fmt)
  c = lib.config(1)
  tokens_heads = 2 * c.num_layers * lib.B * lib.S * c.num_kv_heads
  bits = {'int8': 8, 'fp8': 8, 'int4': 4}[fmt]
  code_bytes = c.head_dim * bits // 8   # int4 packed two codes per byte
  scale_bytes = 4                       # one f32 scale per token and kv head
  total = tokens_heads * (code_bytes + scale_bytes)
  lengths = 4 * lib.B  # one int32 per row, replicated
  assert _held(cache) - lengths == sm.kv_bytes_per_device(cache) - lengths == total // 8
  est = costmodel.estimate(lib.model_shape(1), 'tpu_v4', '2x2x2', '2d_ws+mq_batch',
                           costmodel.Workload(batch=lib.B, prompt_len=lib.T,
                                              gen_len=lib.STEPS, kv_bits=bits),
                           phase='decode')
  assert est.memory.kv_bytes == total // 8  # codes and their float32 scales


def test_quantized_weight_bytes(eight_devices):
  """Packed int4 codes and their scales split like the weight: 1/8 per device each."""
  policy = QuantPolicy((QuantRule('.*mlp.*', int_format(4, group_size=16)),
                        QuantRule('.*', int_format(8))))
  qmodel, _ = quantize_model(lib.model(1), policy)
  for layout in ('2d_ws+mq_batch', '1d_ws+mq_heads', 'wg_xyz+mq_batch'):
    sm = sharding.ShardedTransformer(qmodel, sharding.make_mesh('2x2x2'), prefill=layout)
    assert _held(sm.state) == sm.weight_bytes_per_device()
    gate = sm.state['layers'][0]['mlp']['gate_proj']['w'].get_value()
    assert _held(gate) == gate.nbytes // 8
