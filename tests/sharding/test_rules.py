"""Layouts as data: the rules tables, their checks, and the jax APIs they rely on."""

import dataclasses

import jax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import sharding_testlib as lib
from qjax import costmodel, sharding
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, axes as ax, quantize_model


def test_jax_apis_this_package_uses(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  assert mesh.axis_names == ('x', 'y', 'z')
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert callable(jax.shard_map) and callable(jax.set_mesh)
  with jax.set_mesh(mesh):
    f = jax.shard_map(lambda a: jax.lax.psum(a, ('x', 'y', 'z')), mesh=mesh,
                      in_specs=P(('x', 'y', 'z')), out_specs=P())
    assert float(f(jax.numpy.ones(8))[0]) == 8.0


def test_every_layout_has_a_full_table():
  names = {v for k, v in vars(ax).items() if k.isupper() and isinstance(v, str)}
  for layout in sharding.all_layouts():
    rules = sharding.layout_rules(layout)
    assert set(rules.as_dict) == names, layout
    assert str(rules) == str(layout)


def test_tables_say_what_pope_et_al_say():
  r = sharding.layout_rules('1d_ws+multihead')
  assert r.spec(ax.WEIGHT_AXES['DF']) == P(None, ('x', 'y', 'z'))
  r = sharding.layout_rules('2d_ws+mq_batch')
  assert r.spec(ax.WEIGHT_AXES['DF']) == P('x', ('z', 'y'))
  assert r.spec((ax.BATCH, ax.LENGTH, ax.ACT_EMBED)) == P(None, None, ('x', 'z', 'y'))
  assert r.spec(ax.KV_CACHE_AXES) == P(('z', 'y', 'x'), None, None, None)
  assert r.spec(ax.WEIGHT_AXES['DKH']) == P('x', None, None)   # the kv head replicated
  r = sharding.layout_rules('wg_xy+mq_heads')
  assert r.gather == ('x', 'y')
  assert r.compute_axes(ax.MLP) == ('z',) and r.compute_axes(ax.EMBED) == ()
  assert r.spec(ax.KV_CACHE_AXES) == P(('x', 'y'), None, None, None)
  r = sharding.layout_rules(costmodel.Layout('2d_ws', 'multihead'))
  assert r.spec(ax.KV_CACHE_AXES) == P(None, None, ('z', 'y', 'x'), None)


def test_prefill_and_decode_layouts_share_stored_weights():
  two_d = sharding.layout_rules('2d_ws+mq_batch')
  for ffn in ('wg_x', 'wg_xy', 'wg_xyz'):
    assert sharding.same_stored_weights(two_d, sharding.layout_rules(f'{ffn}+mq_batch'))
  assert not sharding.same_stored_weights(two_d, sharding.layout_rules('1d_ws+mq_batch'))


def test_colliding_axes_are_rejected():
  r = sharding.layout_rules('2d_ws+mq_batch')
  table = dict(r.table)
  table[ax.BATCH] = ('x',)   # batch and the residual's D both on x
  with pytest.raises(ValueError, match=r"colliding axes.*'batch'.*'act_embed'|colliding"):
    dataclasses.replace(r, table=tuple(sorted(table.items())))
  with pytest.raises(ValueError, match='distinct mesh axes'):
    dataclasses.replace(r, table=r.table + (('foo', ('x', 'x')),))


def test_a_missing_rule_is_an_error_not_replication():
  r = sharding.layout_rules('1d_ws+multihead')
  with pytest.raises(ValueError, match="no rule for logical axis 'experts'"):
    r.spec(('experts', ax.EMBED), 'a MoE weight')
  assert 'experts' in str(pytest.raises(ValueError, r.axes, 'experts').value)
  assert r.unused({ax.EMBED, ax.MLP}) and ax.EMBED not in r.unused({ax.EMBED})


def test_unknown_layout_names_suggest_the_closest():
  with pytest.raises(ValueError, match="Did you mean '2d_ws'"):
    sharding.layout_rules('2d_wz+mq_batch')
  with pytest.raises(ValueError, match="mq_batch"):
    sharding.layout_rules('2d_ws+mq_bach')


def test_weights_left_unsharded_by_mistake(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  m = lib.model(1)
  r = sharding.layout_rules('2d_ws+mq_batch')
  table = dict(r.table)
  table[ax.MLP] = ()   # forgot to shard F: the MLP matrices become replicated
  bad = dataclasses.replace(r, table=tuple(sorted(table.items())))
  with pytest.raises(ValueError, match=r"unsharded.*mlp/gate_proj.*over \['y', 'z'\]"):
    sharding.state_shardings(nnx.state(m), bad, mesh)
  # On purpose: the same table with the MLP matrices declared replicated passes.
  ok = dataclasses.replace(bad, replicated_ok=bad.replicated_ok | {
      ax.WEIGHT_AXES['DF'], ax.WEIGHT_AXES['FD']})
  sharding.state_shardings(nnx.state(m), ok, mesh)


def test_mesh_too_small_for_heads_or_batch(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  six_heads = lib.config(1).replace(num_heads=6)
  with pytest.raises(ValueError, match=r'attn/[qo]_proj/w dim [02] \(size 6\).*z\*y=4'):
    sharding.ShardedTransformer(Transformer(six_heads, rngs=nnx.Rngs(0)), mesh, '2d_ws+mq_heads')
  sm = sharding.ShardedTransformer(lib.model(1), mesh, '2d_ws+mq_batch')
  with pytest.raises(ValueError, match=r'KV cache k\[0\] dim 0 \(size 4\).*x\*y\*z=8|z\*y\*x=8'):
    sm.init_cache(batch=4, max_len=8)
  with pytest.raises(ValueError, match='num_kv_heads=8'):
    sharding.ShardedTransformer(lib.model(8), mesh, '1d_ws+mq_heads')
  with pytest.raises(ValueError, match='store weights differently'):
    sharding.ShardedTransformer(lib.model(1), mesh, '1d_ws+mq_batch', '2d_ws+mq_batch')
  with pytest.raises(ValueError, match='needs 4 devices'):
    sharding.make_mesh('1x2x2')


def test_quantized_weight_leaves_follow_the_logical_axes(eight_devices):
  """Codes keep the weight's dims (last one packed); scales have the same rank and axes."""
  fmt = int_format(4, group_size=16)
  qm, _ = quantize_model(lib.model(1), QuantPolicy((QuantRule('.*mlp.*', fmt),)))
  q = qm.layers[0].mlp.gate_proj.w.get_value()   # (64, 256) -> data (64, 128), scale (4, 256)
  assert q.data.shape == (64, 128) and q.scale.shape == (4, 256)
  logical = sharding.qarray_logical(ax.WEIGHT_AXES['DF'], q)
  assert logical == [(ax.EMBED, ax.MLP), (ax.EMBED, ax.MLP)]
  r = sharding.layout_rules('2d_ws+mq_batch')
  assert sharding.leaf_mesh_axes(r, ax.WEIGHT_AXES['DF'], q, 'gate') == [
      (('x',), ('z', 'y')), (('x',), ('z', 'y'))]
  mesh = sharding.make_mesh('2x2x2')
  sm = sharding.ShardedTransformer(qm, mesh, '2d_ws+mq_batch')
  w = sm.state['layers'][0]['mlp']['gate_proj']['w'].get_value()
  assert w.data.sharding.spec == P('x', ('z', 'y'))
  assert w.data.addressable_shards[0].data.shape == (32, 32)   # 64/2 rows, 128/4 bytes
  assert w.scale.sharding.spec == P('x', ('z', 'y'))
  assert w.scale.addressable_shards[0].data.shape == (2, 64)   # 4/2 groups, 256/4 columns
  # One scale for a whole axis (groups of 64 over 64 rows) is replicated along it: every
  # shard holds its rows' scale. A group that straddles shards is an error: 64 rows split 4
  # ways into shards of 16, groups of 32.
  whole, _ = quantize_model(lib.model(1), QuantPolicy((QuantRule(
      '.*mlp/(gate|up)_proj', int_format(4, group_size=64)),)))
  w = sharding.ShardedTransformer(whole, mesh, '2d_ws+mq_batch').state[
      'layers'][0]['mlp']['gate_proj']['w'].get_value()
  assert w.scale.shape == (1, 256) and w.scale.sharding.spec == P(None, ('z', 'y'))
  coarse, _ = quantize_model(lib.model(1), QuantPolicy((QuantRule(
      '.*mlp/(gate|up)_proj', int_format(4, group_size=32)),)))
  with pytest.raises(ValueError,
                     match=r'gate_proj/w scales dim 0 \(size 2\) is split over mesh axes x=4'):
    sharding.ShardedTransformer(coarse, sharding.make_mesh('4x2x1'), '2d_ws+mq_batch')
