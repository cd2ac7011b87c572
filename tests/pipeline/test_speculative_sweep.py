"""The speculative sweep on the tiny model: rows, a failing point recorded, resumed."""

import pytest

from configs import speculative_gemma3
from qjax import eval as qeval
from qjax.pipeline import speculative_sweep


@pytest.mark.plots
def test_tiny_sweep_rows_failures_and_resume(tmp_path):
  c = speculative_gemma3.small(speculative_gemma3.get_config())
  c.model, c.out_dir = 'tiny', str(tmp_path)
  c.drafts, c.gammas, c.temperatures, c.max_tokens = 'int4_g128,skip1', '2', '0,1.0', 4
  c.kl_rows = 128
  logs = []
  rows = speculative_sweep.run_from_config(c, log=logs.append)
  by_name = {r['name']: r for r in rows}
  # int4 g128 cannot group the tiny model's D = 64: recorded, and the sweep went on.
  assert by_name['int4_g128/g2/t0.0']['status'] == 'error'
  assert 'group_size=128' in by_name['int4_g128/g2/t0.0']['error']
  greedy, sampled = by_name['skip1/g2/t0.0'], by_name['skip1/g2/t1.0']
  assert greedy['status'] == sampled['status'] == 'ok'
  assert greedy['greedy_agreement'] == 1.0
  for r in (greedy, sampled):
    assert 1 <= r['tokens_per_pass'] <= 3 and 0 <= r['alpha'] <= 1
    assert abs(r['passes_per_token'] * r['tokens_per_pass'] - 1) < 1e-9
    assert r['seconds_spec'] > 0 and r['seconds_plain'] > 0 and r['cost_ratio'] > 0
    assert r['predicted_speedup'] == r['tokens_per_pass'] / (2 * r['cost_ratio'] + 1)
  assert 'delta_mean_logprob' in sampled
  # The KL columns: exact law ~0; the first token's empirical KL within the null's spread.
  assert abs(sampled['kl_exact']) < 1e-5 and greedy['kl_exact'] == 0
  assert sampled['kl_null_std'] > 0 and abs(sampled['kl_z']) < 5, sampled
  assert greedy['kl_spec'] == greedy['kl_plain'] == 0  # one-hot law: every row its argmax
  assert (tmp_path / 'plot.png').stat().st_size > 0
  assert '| skip1/g2/t0.0 | ok |' in (tmp_path / 'table.md').read_text()
  logs.clear()
  rows = speculative_sweep.run_from_config(c, log=logs.append)
  assert sum('finished earlier' in line for line in logs) == 2  # only the failures re-ran
  qeval.require_success(rows)


def test_time_budget_leaves_points_for_a_rerun(tmp_path):
  c = speculative_gemma3.small(speculative_gemma3.get_config())
  c.model, c.out_dir = 'tiny', str(tmp_path)
  c.drafts, c.gammas, c.temperatures, c.max_tokens = 'skip1', '1,2', '0', 4
  c.time_budget_s = 1e-9  # spent before the first point: nothing runs
  rows = speculative_sweep.run_from_config(c, log=lambda s: None)
  assert all(speculative_sweep.BUDGET_SPENT in r['error'] for r in rows), rows
