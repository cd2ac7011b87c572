"""colab/speculative.ipynb executes end to end in its small mode (a random tiny model)."""

import nbformat
from nbclient import NotebookClient


def test_speculative_notebook_runs(repo_root, monkeypatch):
  monkeypatch.setenv('QJAX_NB_SMALL', '1')
  monkeypatch.setenv('XLA_FLAGS', '')
  nb = nbformat.read(repo_root / 'colab' / 'speculative.ipynb', as_version=4)
  NotebookClient(nb, timeout=600, kernel_name='python3',
                 resources={'metadata': {'path': str(repo_root / 'colab')}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])]
  text = ''.join(o.get('text', '') for o in outputs)
  assert text.count('identical to greedy: True') == 2, text
  assert 'identical to greedy: False' not in text
  assert 'formula' in text and 'mean logprob' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)
