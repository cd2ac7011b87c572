"""The roofline against Pope et al. 2022's measurements, and its internal consistency."""

import dataclasses

from hypothesis import given
from hypothesis import strategies as st
import pytest

from qjax import costmodel

TABLE2 = costmodel.TABLE2


def _estimate(row, **kwargs):
  return costmodel.estimate(row.model, row.chip, row.mesh, row.layout, row.workload, row.phase,
                            **kwargs)


@pytest.mark.parametrize('combine', costmodel.COMBINE_RULES)
@pytest.mark.parametrize('interconnect', costmodel.INTERCONNECTS)
@pytest.mark.parametrize('row', TABLE2, ids=lambda r: r.label)
def test_roofline_is_a_lower_bound_of_every_measured_latency(row, combine, interconnect):
  est = _estimate(row, combine=combine, interconnect=interconnect)
  assert est.latency_s < row.latency_s
  assert est.mfu > row.mfu


@pytest.mark.parametrize('row', TABLE2, ids=lambda r: r.label)
def test_gap_to_measurement_is_bounded(row):
  # Measured / roofline: 1.7, 3.4, 1.2, 2.3 (all-links, serial). A model 4x off or above
  # the measurement would be wrong, not just optimistic.
  ratio = row.latency_s / _estimate(row).latency_s
  assert 1.1 < ratio < 4.0, ratio


def test_regimes_match_the_paper():
  prefill_b1, decode_b64, prefill_b512, decode_b512 = (_estimate(r) for r in TABLE2)
  assert decode_b64.regime == 'memory'    # weight loading dominates small-batch decode
  assert prefill_b512.regime == 'compute'
  assert prefill_b1.regime == 'compute'   # 2048 tokens is far above the critical batch
  assert decode_b512.regime == 'compute'  # 512 > 229 tokens


def test_int8_weights_save_what_pope_et_al_measured():
  # Decode B=64 on 64 chips: 28.5 ms/token int8 vs 36.9 ms bf16, i.e. 8.4 ms saved.
  steps = {}
  for bits in (8, 16):
    w = costmodel.Workload(batch=64, prompt_len=2048, gen_len=64, weight_bits=bits)
    steps[bits] = costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4', '2d_ws+mq_batch', w,
                                     'decode').step_latency_s
  predicted = steps[16] - steps[8]
  measured = 36.9e-3 - 28.5e-3
  assert predicted == pytest.approx(7.04e-3, rel=0.01)  # half the weights: 540B B / 64 / 1.2 TB/s
  assert predicted == pytest.approx(measured, rel=0.20)
  # Each roofline sits below its measurement.
  assert steps[8] < 28.5e-3 and steps[16] < 36.9e-3


def test_totals_are_layers_times_layer_plus_head():
  est = _estimate(TABLE2[1])
  for field in ('compute_s', 'weight_load_s', 'kv_load_s', 'comm_s'):
    assert getattr(est, field) == pytest.approx(
        est.n_layers * getattr(est.layer, field) + getattr(est.head, field))
  assert est.step_latency_s == pytest.approx(max(est.compute_s, est.memory_s) + est.comm_s)
  assert est.latency_s == pytest.approx(64 * est.step_latency_s)


def test_mfu_is_consistent_with_latency():
  for row in TABLE2:
    est = _estimate(row)
    assert est.mfu == pytest.approx(costmodel.model_flops_utilization(
        costmodel.get_model('palm_540b').n_params, est.tokens, 64, 275e12, est.latency_s))


def test_overlap_rule_is_never_slower_than_serial():
  for row in TABLE2:
    assert _estimate(row, combine='overlap').latency_s <= _estimate(row).latency_s


def test_efficiency_scales_the_terms_it_names():
  row = TABLE2[1]
  ideal = _estimate(row)
  slow_hbm = _estimate(row, efficiency=costmodel.Efficiency(hbm=0.5))
  assert slow_hbm.weight_load_s == pytest.approx(2 * ideal.weight_load_s)
  assert slow_hbm.compute_s == pytest.approx(ideal.compute_s)
  latency = _estimate(row, efficiency=costmodel.Efficiency(collective_latency_s=1e-5,
                                                           step_overhead_s=1e-3))
  assert latency.step_latency_s == pytest.approx(
      ideal.step_latency_s + 1e-3 + ideal.n_layers * ideal.layer.n_collectives * 1e-5)
  with pytest.raises(ValueError, match=r'fraction of peak in \(0, 1\]'):
    costmodel.Efficiency(flops=1.5)


def test_one_chip_has_no_communication():
  w = costmodel.Workload(batch=8, prompt_len=512, gen_len=32)
  for layout in costmodel.all_layouts():
    est = costmodel.estimate('gemma3_270m', 'h200', (1, 1, 1), layout, w, 'decode')
    assert est.comm_s == 0
    assert est.memory.fits


def test_memory_per_chip():
  decode_b512 = _estimate(TABLE2[3])
  # Every matrix split over the 64 chips, except the multiquery K/V projections (E x 2H per
  # layer), stored E_x and replicated over y*z: 4 ways, not 64.
  kv_proj = 118 * 18432 * 2 * 256
  assert decode_b512.memory.weights_bytes == pytest.approx(
      ((540.35e9 - kv_proj) / 64 + kv_proj / 4) * 2, rel=1e-3)
  # Batch-sharded multiquery cache: 8 sequences x 2112 tokens x 2 x 256 x 118 x 2 B per chip.
  assert decode_b512.memory.kv_bytes == pytest.approx(8 * 2112 * 2 * 256 * 118 * 2)
  assert decode_b512.memory.fits
  # Head-sharded multiquery replicates the cache: 64x more per chip, and it no longer fits.
  replicated = costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4',
                                  costmodel.Layout('2d_ws', 'mq_heads', True),
                                  TABLE2[3].workload, 'decode')
  assert replicated.memory.kv_bytes == pytest.approx(64 * decode_b512.memory.kv_bytes)
  assert not replicated.memory.fits


def test_weight_gathered_decode_is_communication_bound():
  w = costmodel.Workload(batch=64, prompt_len=2048, gen_len=64)
  est = costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4', 'wg_xyz+mq_batch', w, 'decode')
  assert est.regime == 'communication'


def test_bad_workloads_and_names():
  with pytest.raises(ValueError, match='weight_bits must be between 1 and 32'):
    costmodel.Workload(batch=1, prompt_len=8, weight_bits=0)
  with pytest.raises(ValueError, match='batch must be an int >= 1'):
    costmodel.Workload(batch=0, prompt_len=8)
  w = costmodel.Workload(batch=1, prompt_len=8)
  with pytest.raises(ValueError, match='gen_len >= 1'):
    costmodel.estimate('gemma3_270m', 'h200', (1,), '1d_ws+mq_heads', w, 'decode')
  with pytest.raises(ValueError, match="Did you mean 'prefill'"):
    costmodel.estimate('gemma3_270m', 'h200', (1,), '1d_ws+mq_heads', w, 'prefil')
  with pytest.raises(ValueError, match="Did you mean 'per_axis'"):
    costmodel.estimate('gemma3_270m', 'h200', (1,), '1d_ws+mq_heads', w, 'prefill',
                       interconnect='per-axis')


@given(st.sampled_from([4, 8, 16, 32, 64, 128]), st.sampled_from([4, 8, 16, 32, 64, 128]),
       st.sampled_from(['1d_ws+mq_batch', '2d_ws+mq_batch', '2d_ws+mq_heads']))
def test_decode_step_grows_with_batch(b1, b2, layout):
  lo, hi = sorted((b1, b2))
  w = costmodel.Workload(batch=lo, prompt_len=1024, gen_len=16, weight_bits=8)
  layout = dataclasses.replace(costmodel.as_layout(layout), pad_heads=True)
  est = lambda wl: costmodel.estimate('palm_62b', 'tpu_v5p', '2x2x4', layout, wl, 'decode')  # noqa
  assert est(w).step_latency_s <= est(dataclasses.replace(w, batch=hi)).step_latency_s
