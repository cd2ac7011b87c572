"""colab/validate.ipynb executes end to end in its small mode (a random tiny model)."""

import pytest


@pytest.mark.plots
def test_validate_notebook_runs(run_notebook):
  text, outputs = run_notebook('validate.ipynb', QJAX_NB_SMALL='1')
  assert '| conversion | KL |' in text and '| int8 |' in text and '| mixed-at-int4 |' in text
  assert text.count('weights predicted / measured: 1.0 | KV predicted / measured: 1.0') == 2
  assert '## What ran' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)
