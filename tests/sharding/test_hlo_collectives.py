"""The compiled HLO of one decoder layer holds the collectives each layout prescribes.

One decode step (B=8, T=1) of `layers[0]` on the 2x2x2 mesh. Counts are of tensors moved:
XLA may combine several all-reduces into one tuple-shaped op, so a tuple counts each of
its elements (all-to-all tuples are the per-peer pieces of one tensor and count once).
"""

import collections

import jax.numpy as jnp
import pytest

import sharding_testlib as lib
from qjax import sharding

XYZ, YZ = ('x', 'y', 'z'), ('y', 'z')
AG, RS, AR, A2A = 'all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all'


def _layer_collectives(layout):
  mesh = sharding.make_mesh('2x2x2')
  sm = sharding.ShardedTransformer(lib.model(lib.kv_heads(layout)), mesh, prefill=layout)
  cache = sm.init_cache(lib.B, lib.S)
  x_BTD = jnp.zeros((lib.B, 1, lib.config(1).d_model))
  text = sm.lower_block('decode', 0, x_BTD, cache).compile().as_text()
  found = sharding.collectives(text, mesh)
  assert all(c.axes is not None for c in found), [c for c in found if c.axes is None]
  counts = collections.Counter()
  for c in found:
    n = 1 if c.kind == A2A or not c.shape.startswith('(') else c.shape.count('f32[')
    weight = 'gather_weight' in c.op_name
    counts[(c.kind, c.axes, 'weight' if weight else 'act')] += n
  return counts, found


# (kind, mesh axes, weight or activation) -> tensors per layer. Per layer: two input
# all-gathers (attention and MLP) except under 1d_ws, and for 2D the x reduce-scatter of
# q(,k,v), gate and up, the x all-gather of the o_proj / down_proj inputs, the yz
# reduce-scatter of their outputs.
# The RMSNorm statistics of the split residual add one tiny [B, 1] all-reduce per norm.
# 1d_ws keeps the residual whole on every chip: one all-reduce per block output and nothing
# else (no input gather, no norm statistics to combine).
EXPECTED = {
    '1d_ws+multihead': {(AR, XYZ, 'act'): 2},
    '1d_ws+mq_batch': {(AR, XYZ, 'act'): 2, (A2A, XYZ, 'act'): 2},
    '2d_ws+multihead': {(AG, YZ, 'act'): 2, (RS, ('x',), 'act'): 5, (AG, ('x',), 'act'): 2,
                        (RS, YZ, 'act'): 2, (AR, XYZ, 'act'): 2},
    '2d_ws+mq_heads': {(AG, YZ, 'act'): 2, (RS, ('x',), 'act'): 3, (AR, ('x',), 'act'): 2,
                       (AG, ('x',), 'act'): 2, (RS, YZ, 'act'): 2, (AR, XYZ, 'act'): 2},
    '2d_ws+mq_batch': {(AG, YZ, 'act'): 2, (RS, ('x',), 'act'): 3, (AR, ('x',), 'act'): 2,
                       (AG, ('x',), 'act'): 2, (RS, YZ, 'act'): 2, (AR, XYZ, 'act'): 2,
                       (A2A, XYZ, 'act'): 2},
    # Weight-gathered: all 7 matrices gathered over the gathered axes (kv projections of
    # multiquery layouts are stored E_x only, so they gather x and nothing else).
    'wg_x+mq_batch': {(AG, ('x',), 'weight'): 7, (AG, YZ, 'act'): 2, (RS, YZ, 'act'): 2,
                      (AR, YZ, 'act'): 2, (A2A, YZ, 'act'): 2},
    'wg_xy+multihead': {(AG, ('x',), 'weight'): 7, (AG, ('y',), 'weight'): 7,
                        (AG, ('z',), 'act'): 2, (RS, ('z',), 'act'): 2, (AR, ('z',), 'act'): 2},
    'wg_xyz+mq_heads': {(AG, ('x',), 'weight'): 7, (AG, YZ, 'weight'): 5},
}


@pytest.mark.parametrize('layout', sorted(EXPECTED))
def test_layer_collectives(eight_devices, layout):
  counts, found = _layer_collectives(layout)
  assert dict(counts) == EXPECTED[layout], '\n'.join(map(str, found))


def test_weight_stationary_never_gathers_weights(eight_devices):
  _, found = _layer_collectives('2d_ws+mq_batch')
  gathers = [c for c in found if c.kind == AG]
  assert gathers and all(c.shape.startswith(f'f32[{lib.B},1,') for c in gathers), gathers
  _, found = _layer_collectives('1d_ws+multihead')
  assert not [c for c in found if c.kind == AG], found


def test_replica_group_formats_are_parsed(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  lines = [
      'a = f32[8] all-gather(b), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}',
      'a = f32[8] all-reduce(b), replica_groups=[2,4]<=[2,2,2]T(0,2,1), to_apply=add',
      "a = f32[8] all-reduce(b), replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=8], "
      "device_ids=([2,2,2]T(0,2,1)) {'axis_2'}, to_apply=add",
      "a = (f32[1], f32[1]) all-to-all(b, c), replica_groups=mesh['a'=4,'b'=2] {'b'}",
  ]
  got = [c.axes for c in sharding.collectives('\n'.join(lines), mesh)]
  assert got == [('x',), YZ, XYZ, ('z',)]


def test_sub_axis_replica_groups_are_parsed(eight_devices):
  # Shardy's sub-axis 'a':(p)s: the s chips after the first p of each block of a's size.
  mesh = sharding.make_mesh('2x2x2')
  line = ("a = f32[8] all-reduce(b), replica_groups=mesh['axis_0'=4,'axis_1'=2] "
          "{'axis_0':(2)2}, to_apply=add")
  (c,) = sharding.collectives(line, mesh)
  assert c.axes == ('y',) and c.group_size == 2
