"""colab/speculative.ipynb executes end to end in its small mode (a random tiny model)."""

import pytest


@pytest.mark.plots
def test_speculative_notebook_runs(run_notebook):
  text, outputs = run_notebook('speculative.ipynb', QJAX_NB_SMALL='1')
  assert text.count('identical to greedy: True') == 2, text
  assert 'identical to greedy: False' not in text
  assert 'formula' in text and 'mean logprob' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)
