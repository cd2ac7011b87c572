"""The paper's closed forms, the MFU identity on Table 2, and the estimator's agreement."""

import math

from hypothesis import given
from hypothesis import strategies as st
import numpy as np
import pytest

from qjax import costmodel

E, F = 18432, 73728  # PaLM 540B, F = 4E


def test_1d_volume_is_independent_of_chip_count():
  assert costmodel.comm_1d_ws(8, 2048, E) == 2 * 8 * 2048 * E


def test_2d_halves_1d_at_64_chips_and_ties_at_16():
  b, l = 64, 1
  one_d = costmodel.comm_1d_ws(b, l, E)
  assert costmodel.comm_2d_ws_optimal(b, l, E, F, 64) == pytest.approx(one_d / 2)
  assert costmodel.comm_2d_ws_optimal(b, l, E, F, 16) == pytest.approx(one_d)
  # The closed form 8 B L E / sqrt(n) when F = 4E.
  for n in (4, 16, 64, 256):
    assert costmodel.comm_2d_ws_optimal(b, l, E, F, n) == pytest.approx(8 * b * l * E / n**0.5)


def test_2d_at_the_mesh_pope_et_al_used():
  # 4x4x4: X = 4 along E, YZ = 16 along F; optimal X = sqrt(64 E / F) = 4 exactly.
  assert costmodel.optimal_2d_x(64, E, F) == pytest.approx(4)
  assert costmodel.comm_2d_ws(1, 1, E, F, 4, 16) == 2 * (E / 4 + F / 16)


def test_weight_gathered_formula_and_optimum():
  n = 64
  assert costmodel.comm_weight_gathered(512, 2048, E, F, n, 16) == pytest.approx(
      2 * E * F * 16 / n + 2 * 512 * 2048 * E / 16)
  n_opt = costmodel.optimal_gather_n(512, 2048, F, n)
  assert n_opt == pytest.approx(math.sqrt(512 * 2048 * 64 / F))  # ~30.2
  # At the optimum: 4 E sqrt(B L F) / sqrt(n) (Pope et al. A.2.2).
  assert costmodel.comm_weight_gathered(512, 2048, E, F, n, n_opt) == pytest.approx(
      4 * E * math.sqrt(512 * 2048 * F) / math.sqrt(n))


@given(st.integers(1, 4096), st.sampled_from([4, 16, 64, 256]),
       st.sampled_from([(1024, 4096), (4096, 16384), (640, 2048), (18432, 73728)]))
def test_optima_minimise_on_a_grid(tokens, n, ef):
  e, f = ef
  grid = np.geomspace(0.05, n, 2000)
  x_opt = costmodel.optimal_2d_x(n, e, f)
  best_2d = min(costmodel.comm_2d_ws(1, tokens, e, f, x, n / x) for x in grid)
  assert costmodel.comm_2d_ws(1, tokens, e, f, x_opt, n / x_opt) <= best_2d * (1 + 1e-9)
  n_opt = costmodel.optimal_gather_n(1, tokens, f, n)
  best_wg = min(costmodel.comm_weight_gathered(1, tokens, e, f, n, g) for g in grid)
  assert costmodel.comm_weight_gathered(1, tokens, e, f, n, n_opt) <= best_wg * (1 + 1e-9)


@pytest.mark.parametrize('row', costmodel.TABLE2, ids=lambda r: r.label)
def test_mfu_latency_identity_on_table2(row):
  # MFU recomputed from the published latency lands within 1.5 points of the published MFU.
  w = row.workload
  tokens = w.batch * (w.prompt_len if row.phase == 'prefill' else w.gen_len)
  mfu = costmodel.model_flops_utilization(costmodel.get_model('palm_540b').n_params, tokens,
                                          64, 275e12, row.latency_s)
  assert abs(mfu - row.mfu) <= 0.015, (mfu, row.mfu)


def test_estimator_collectives_reduce_to_the_paper_formulas():
  # A plain (non-gated) parallel-block FFN: the estimator's per-chip volumes equal the
  # paper's formulas plus exactly the attention projections' widths.
  model = costmodel.ModelShape('toy', n_layers=1, d_model=1024, d_ff=4096, n_heads=64,
                               head_dim=16, n_kv_heads=1, vocab=1000, parallel_block=True)
  mesh, t = costmodel.Mesh(4, 4, 4), 64
  q, kv = 64 * 16, 2 * 16  # query width; K and V of the one kv head (all-reduced)
  volume = {}
  for ffn in ('1d_ws', '2d_ws', 'wg_xy'):
    layout = costmodel.Layout(ffn, 'mq_heads')
    plan = costmodel.shard_plan(model, mesh, layout, batch=t)
    # An all-reduce moves what a reduce-scatter and an all-gather of its tensor move.
    volume[ffn] = sum(c.nbytes * (2 if c.kind == 'all_reduce' else 1)
                      for c in costmodel.layer_collectives(plan, mesh, layout, t, 1, 1))
  assert volume['1d_ws'] == costmodel.comm_1d_ws(t, 1, 1024)  # one all-reduce of B L E
  assert volume['2d_ws'] == pytest.approx(
      costmodel.comm_2d_ws(t, 1, 1024, 4096, 4, 16) + 2 * t * q / 16 + 2 * t * kv)
  # The multiquery K/V projection (E x 2H) is stored E_x only and gathered whole.
  kv_proj = 1024 * kv
  attn_weights = model.attn_params_per_layer - kv_proj
  assert volume['wg_xy'] == pytest.approx(
      costmodel.comm_weight_gathered(t, 1, 1024, 4096, 64, 16) + attn_weights * 16 / 64
      + kv_proj)
