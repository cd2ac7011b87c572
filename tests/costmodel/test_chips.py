"""Chip presets, peaks per format and critical batch sizes."""

import pytest

from qjax import costmodel


@pytest.mark.parametrize('name, expected', [
    # peak FLOP/s / HBM bytes/s, from each preset's spec sheet numbers.
    ('tpu_v4', 275e12 / 1200e9),     # 229.2, the number Pope et al.'s setting implies
    ('tpu_v5e', 197e12 / 819e9),     # 240.5
    ('tpu_v5p', 459e12 / 2765e9),    # 166.0
    ('h100', 989.5e12 / 3.35e12),    # 295.4
    ('h200', 989.5e12 / 4.8e12),     # 206.1
])
def test_critical_batch_bf16(name, expected):
  assert costmodel.critical_batch(name) == pytest.approx(expected, rel=1e-9)


def test_critical_batch_tpu_v4_is_about_229():
  assert costmodel.critical_batch('tpu_v4') == pytest.approx(229, abs=0.5)


def test_int8_weights_halve_critical_batch_when_matmuls_stay_bf16():
  # Weight-only int8 on v4 (no int8 speedup): half the bytes per FLOP, so half the batch.
  assert costmodel.critical_batch('tpu_v4', weight_bits=8) == pytest.approx(229.17 / 2, rel=1e-3)
  # W8A8 on v5e runs at the int8 peak (2x): the critical batch stays ~240.
  assert costmodel.critical_batch('tpu_v5e', weight_bits=8, compute_bits=8) == pytest.approx(
      393e12 / (2 * 819e9))


def test_peak_flops_per_format():
  v4, h200 = costmodel.get_chip('tpu_v4'), costmodel.get_chip('h200')
  assert v4.peak_flops(16) == v4.peak_flops(8) == 275e12  # v4: "bf16 or int8" 275 T
  assert h200.peak_flops(16) == 989.5e12
  assert h200.peak_flops(8) == 1979e12
  assert h200.peak_flops(4) == 1979e12  # no 4-bit matmul path: the 8-bit one


def test_unknown_chip_names_the_valid_presets():
  with pytest.raises(ValueError) as err:
    costmodel.get_chip('tpu_v3')
  message = str(err.value)
  assert "'tpu_v3'" in message
  for name in costmodel.CHIPS:
    assert name in message
  assert "Did you mean 'tpu_v4'" in message or "Did you mean 'tpu_v5" in message


def test_lookup_tolerates_case_and_dashes():
  assert costmodel.get_chip('TPU-v4').name == 'tpu_v4'
