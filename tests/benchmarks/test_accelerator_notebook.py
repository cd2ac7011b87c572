"""colab/accelerator.ipynb executes end to end in its small mode: the path decisions of this
backend, a device check of three formats, its table and plot, and the speedups over bf16."""

import pytest


@pytest.mark.plots
def test_accelerator_notebook_runs(run_notebook, tmp_path):
  text, outputs = run_notebook('accelerator.ipynb', QJAX_NB_SMALL='1',
                               QJAX_NB_WORKDIR=str(tmp_path))
  # On CPU: packed codes, the row tiles, dense prefill attention, the paged scan.
  assert 'quantized weights are stored packed' in text, text
  assert "matmul path, int4 g128, weight-only: 'tiled'" in text, text
  assert "matmul path, W8A8: 'int8'" in text, text
  assert 'prefill attention, Gemma 3 270M (head_dim 256): dense' in text, text
  assert 'paged decode attention: scan' in text, text
  assert 'device check: 3 rows' in text and 'not run: none' in text, text
  for fmt in ('int4', 'w8a8'):
    line = next(x for x in text.splitlines() if x.startswith(f'gemma3_270m {fmt} vs bf16'))
    assert 'b1: ' in line and 'b2: ' in line, line
  assert (tmp_path / 'device_check.json').exists() and (tmp_path / 'device_check.md').exists()
  assert any('text/markdown' in o.get('data', {}) for o in outputs)
  assert any('image/png' in o.get('data', {}) for o in outputs)
