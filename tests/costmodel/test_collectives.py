"""Interconnect models: bandwidth per axis group and the time of each collective."""

import pytest

from qjax import costmodel

V4, H200 = costmodel.get_chip('tpu_v4'), costmodel.get_chip('h200')
CUBE = costmodel.Mesh(4, 4, 4)


def test_per_axis_bandwidth_is_two_links_per_torus_axis():
  assert V4.axis_bw == pytest.approx(90e9)  # 6 links x 45 GB/s, 2 per axis
  bw = lambda axes, model: costmodel.group_bandwidth(V4, CUBE, axes, model)  # noqa: E731
  assert bw(('x',), 'per_axis') == pytest.approx(90e9)
  assert bw(('y', 'z'), 'per_axis') == pytest.approx(180e9)
  assert bw(('x', 'y', 'z'), 'per_axis') == pytest.approx(270e9)
  assert bw(('x',), 'all_links') == bw(('x', 'y', 'z'), 'all_links') == 270e9


def test_gpu_groups_leaving_the_nvlink_domain_use_scaleout_bandwidth():
  h100 = costmodel.get_chip('h100')
  mesh = costmodel.Mesh(2, 8, 1)  # 16 GPUs: y stays on one board, x crosses boards
  assert costmodel.group_bandwidth(h100, mesh, ('y',)) == 450e9
  assert costmodel.group_bandwidth(h100, mesh, ('x',)) == 50e9
  assert costmodel.group_bandwidth(h100, mesh, ('x', 'y'), 'per_axis') == 50e9


def _seconds(kind, nbytes, axes, chip=V4, mesh=CUBE, interconnect='all_links'):
  c = costmodel.Collective(kind, nbytes, axes, 'test')
  return costmodel.collective_seconds(c, chip, mesh, interconnect)


def test_gather_and_scatter_keep_the_k_minus_one_over_k_factor():
  assert _seconds('all_gather', 270e9, ('x',)) == pytest.approx(3 / 4)
  assert _seconds('reduce_scatter', 270e9, ('x', 'y', 'z')) == pytest.approx(63 / 64)
  assert _seconds('all_reduce', 270e9, ('x',)) == pytest.approx(2 * 3 / 4)
  assert _seconds('all_gather', 270e9, ('x',), interconnect='per_axis') == pytest.approx(
      3 / 4 * 3)  # one axis: 2 of 6 links
  assert _seconds('all_gather', 1e9, ('x',), mesh=costmodel.Mesh(1, 4, 4)) == 0  # 1 chip


def test_all_to_all_pays_the_mean_ring_distance_on_a_torus():
  # 4-ring: distances 0, 1, 2, 1 -> mean 1 hop per axis; 4x4x4 -> 3 hops over all links.
  assert _seconds('all_to_all', 270e9, ('x', 'y', 'z')) == pytest.approx(3)
  assert _seconds('all_to_all', 90e9, ('z',), interconnect='per_axis') == pytest.approx(1)
  # Through a switch every destination is one hop: (K-1)/K of the shard leaves the chip.
  assert _seconds('all_to_all', 450e9, ('z',), H200, costmodel.Mesh(1, 1, 8)) == pytest.approx(
      7 / 8)


def test_unknown_interconnect_and_kind():
  with pytest.raises(ValueError, match="Did you mean 'all_links'"):
    costmodel.group_bandwidth(V4, CUBE, ('x',), 'all-link')
  with pytest.raises(ValueError, match='collective kind'):
    _seconds('broadcast', 1.0, ('x',))
