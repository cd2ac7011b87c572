"""colab/serving.ipynb executes end to end in its small mode (a random tiny model)."""

import pytest


@pytest.mark.plots
def test_serving_notebook_runs(run_notebook):
  text, outputs = run_notebook('serving.ipynb', QJAX_NB_SMALL='1')
  assert 'outputs identical with prefix caching: True' in text, text
  # The float pool's 16 usable pages hold 2 of the longest (7-page) requests; int8 pages of
  # 8 slots x 2 kv heads x (32 codes + a 4-byte scale) in the same bytes: 59 usable, 8 fit.
  assert 'kv_int8: sequences that fit in the same bytes / float: 4\n' in text, text
  hit = float(text.split('prefix hit rate: ')[1].split()[0])
  assert 0 < hit <= 1, text
  assert any('image/png' in o.get('data', {}) for o in outputs)
