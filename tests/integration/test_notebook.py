"""The quickstart notebook executes end to end with tiny settings."""

import pytest


@pytest.mark.plots
def test_quickstart_notebook_runs(run_notebook, tmp_path):
  text, outputs = run_notebook('quickstart.ipynb', QJAX_NB_STEPS='8',
                               QJAX_NB_WORKDIR=str(tmp_path))
  assert 'float ppl' in text and 'artifacts verified' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)
  assert (tmp_path / 'sweep' / 'table.md').exists()
