"""Meshes, layout names, and where each layout shards heads, batch and the KV cache."""

import pytest

from qjax import costmodel

PALM = costmodel.get_model('palm_540b')
CUBE = costmodel.Mesh(4, 4, 4)


def test_mesh_parsing():
  assert costmodel.as_mesh('4x4x4') == CUBE
  assert costmodel.as_mesh((8,)) == costmodel.Mesh(8, 1, 1)
  assert CUBE.n == 64 and str(CUBE) == '4x4x4'
  with pytest.raises(ValueError, match='"4x4x4"'):
    costmodel.as_mesh('4by4')
  with pytest.raises(ValueError, match='axis y must be a positive int'):
    costmodel.Mesh(4, 0, 4)


@pytest.mark.parametrize('bad, suggestion', [
    (('2d-ws', 'mq_batch'), "'2d_ws'"), (('wg_xz', 'mq_batch'), "'wg_x"),
    (('2d_ws', 'mq_bach'), "'mq_batch'"), (('1d_ws', 'multi_head'), "'multihead'"),
])
def test_layout_typos_suggest_the_closest_name(bad, suggestion):
  with pytest.raises(ValueError, match='Did you mean ' + suggestion):
    costmodel.Layout(*bad)


def test_layout_from_string():
  assert costmodel.as_layout('wg_xyz+mq_heads') == costmodel.Layout('wg_xyz', 'mq_heads')


def test_heads_that_do_not_divide_the_mesh_name_the_axis_and_the_fixes():
  with pytest.raises(ValueError) as err:
    costmodel.shard_plan(PALM, CUBE, costmodel.Layout('2d_ws', 'mq_heads'), batch=1)
  message = str(err.value)
  assert 'x*y*z=64' in message and '48' in message           # which axis, which count
  assert '[1, 2, 4, 8, 16]' in message and 'pad_heads=True' in message  # what would work


def test_padding_heads_as_pope_et_al_did():
  plan = costmodel.shard_plan(PALM, CUBE, costmodel.Layout('2d_ws', 'mq_heads', True), 1)
  assert plan.model.n_heads == 64 and plan.kv_shards == 1  # K/V replicated on every chip


def test_multihead_layout_refuses_to_invent_kv_heads():
  with pytest.raises(ValueError, match="1 kv heads.*'mq_batch'"):
    costmodel.shard_plan(PALM, CUBE, costmodel.Layout('1d_ws', 'multihead', True), 64)


def test_batch_that_mq_batch_cannot_split():
  with pytest.raises(ValueError) as err:
    costmodel.shard_plan(PALM, CUBE, costmodel.Layout('2d_ws', 'mq_batch'), batch=2)
  message = str(err.value)
  assert 'batch=2' in message and 'z=4' in message and 'multiple of 4' in message
  assert "'mq_heads'" in message


def test_batch_that_weight_gathering_cannot_split():
  with pytest.raises(ValueError) as err:
    costmodel.shard_plan(PALM, CUBE, costmodel.Layout('wg_xyz', 'mq_heads'), batch=8)
  message = str(err.value)
  assert 'x*y*z=64' in message and 'batch=8' in message and 'multiple of 64' in message
  assert "'wg_x'" in message  # x=4 divides 8


def test_degenerate_meshes_are_named_as_the_simpler_layout():
  with pytest.raises(ValueError, match="which is '1d_ws'"):
    costmodel.shard_plan(PALM, costmodel.Mesh(1, 8, 8), costmodel.Layout('2d_ws'), 64)
  with pytest.raises(ValueError, match='has y=1'):
    costmodel.shard_plan(PALM, costmodel.Mesh(8, 1, 8), costmodel.Layout('wg_xy'), 64)


@pytest.mark.parametrize('batch, kv_shards, a2a', [
    (64, 64, ('x', 'y', 'z')), (16, 16, ('y', 'z')), (4, 4, ('z',))])
def test_mq_batch_uses_the_largest_group_dividing_the_batch(batch, kv_shards, a2a):
  plan = costmodel.shard_plan(PALM, CUBE, costmodel.Layout('2d_ws', 'mq_batch'), batch)
  assert plan.kv_shards == kv_shards and plan.a2a_axes == a2a


def test_weight_gathered_splits_batch_over_the_gathered_axes():
  plan = costmodel.shard_plan(PALM, CUBE, costmodel.Layout('wg_xy', 'mq_heads'), 512)
  assert plan.gather_axes == ('x', 'y') and plan.model_axes == ('z',)
  assert plan.kv_shards == 16  # cache split over the batch, replicated over z
  plan = costmodel.shard_plan(PALM, CUBE, costmodel.Layout('wg_xy', 'mq_batch'), 512)
  assert plan.kv_shards == 64 and plan.a2a_axes == ('z',)


def test_one_chip_accepts_every_layout():
  one = costmodel.Mesh(1, 1, 1)
  for layout in costmodel.all_layouts(pad_heads=False):
    assert costmodel.shard_plan(PALM, one, layout, batch=3).kv_shards == 1
