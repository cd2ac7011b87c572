# ruff: noqa: E501  (the HLO lines are as the compiler prints them)
"""Bytes per chip of the collectives in compiled HLO, in the TPU compiler's own forms.

The module below is shaped like what libtpu prints (trimmed): a reduce-scatter lowered to an
`all-reduce-scatter` fusion, an asynchronous all-gather fused as start / progress / done,
an all-reduce inside a `while` loop of 3 trips, and a collective-permute. Each counts once
per run, with D as the cost model defines it (docs/costmodel.md).
"""

import pytest

from qjax import sharding

HLO = """\
HloModule jit_step

%all-reduce-scatter (input: bf16[16,1,4,64]) -> bf16[4,1,4,64] {
  %input = bf16[16,1,4,64]{3,0,2,1} parameter(0)
  %all-reduce.1 = bf16[16,1,4,64]{3,0,2,1} all-reduce(%input), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %dynamic-slice.1 = bf16[8,1,4,64]{3,0,2,1} dynamic-slice(%all-reduce.1, %c, %c, %c, %c), dynamic_slice_sizes={8,1,4,64}
}

%fused_start (p: s8[512,256]) -> (s8[512,256], s8[1024,256]) {
  %p = s8[512,256]{1,0} parameter(0)
  %all-gather.1 = s8[1024,256]{1,0} all-gather(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, metadata={op_name="jit(step)/shard_map/gather_weight/all_gather"}
  ROOT %t = (s8[512,256]{1,0}, s8[1024,256]{1,0}) tuple(%p, %all-gather.1)
}

%async_collective_fusion.1 (p: s8[512,256]) -> s8[1024,256] {
  %p = s8[512,256]{1,0} parameter(0)
  ROOT %all-gather.2 = s8[1024,256]{1,0} all-gather(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}

%fused_done (p: s8[512,256]) -> s8[1024,256] {
  %p = s8[512,256]{1,0} parameter(0)
  ROOT %all-gather.3 = s8[1024,256]{1,0} all-gather(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}

%body (b: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %b = (s32[], f32[8,128]) parameter(0)
  %x = f32[8,128]{1,0} get-tuple-element(%b), index=1
  %all-reduce.2 = f32[8,128]{1,0} all-reduce(%x), channel_id=3, replica_groups=[2,4]<=[2,2,2]T(0,2,1), to_apply=%add
  ROOT %r = (s32[], f32[8,128]) tuple(%i, %all-reduce.2)
}

ENTRY %main (a: bf16[16,1,4,64], w: s8[512,256], s: (s32[], f32[8,128])) -> bf16[4,1,4,64] {
  %a = bf16[16,1,4,64]{3,0,2,1} parameter(0)
  %fusion = bf16[8,1,4,64]{3,0,2,1} fusion(%a), kind=kCustom, calls=%all-reduce-scatter
  %async-collective-start.1 = (s8[512,256]{1,0}, s8[1024,256]{1,0}) fusion(%w), kind=kCustom, calls=%fused_start
  %fusion.2 = s8[1024,256]{1,0} fusion(%w), kind=kOutput, calls=%async_collective_fusion.1
  %async-collective-done.1 = s8[1024,256]{1,0} fusion(%w), kind=kCustom, calls=%fused_done
  %while = (s32[], f32[8,128]) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %cp = bf16[16,1,4,64]{3,0,2,1} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  ROOT %out = bf16[8,1,4,64]{3,0,2,1} copy(%fusion)
}
"""


def test_tpu_forms_count_once_with_the_cost_models_bytes(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  found = sharding.collectives(HLO, mesh)
  got = sorted((c.kind, c.axes, c.nbytes, c.group_size, c.count) for c in found)
  assert got == sorted([
      ('reduce-scatter', ('x',), 16 * 4 * 64 * 2, 2, 1),    # D: the all-reduce's input
      ('all-gather', ('x',), 1024 * 256, 2, 1),             # start only, not progress / done
      ('all-reduce', ('y', 'z'), 8 * 128 * 4, 4, 3),         # once per trip
      ('collective-permute', ('z',), 16 * 4 * 64 * 2, 1, 1),
  ])
  sent = sharding.sent_bytes(found)
  assert sent['reduce-scatter'] == pytest.approx(8192 * 1 / 2)
  assert sent['all-gather'] == pytest.approx(262144 / 2)
  assert sent['all-reduce'] == pytest.approx(3 * 2 * 4096 * 3 / 4)
  assert sent['collective-permute'] == 8192


def test_a_one_chip_group_sends_nothing(eight_devices):
  mesh = sharding.make_mesh('2x2x2')
  line = 'a = f32[8] all-reduce(b), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}'
  (c,) = sharding.collectives(line, mesh)
  assert c.axes == () and c.sent_bytes == 0
