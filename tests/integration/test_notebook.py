"""The quickstart notebook executes end to end with tiny settings."""


import nbformat
from nbclient import NotebookClient


def test_quickstart_notebook_runs(repo_root, tmp_path, monkeypatch):
  monkeypatch.setenv('QJAX_NB_STEPS', '8')
  monkeypatch.setenv('QJAX_NB_WORKDIR', str(tmp_path))
  monkeypatch.setenv('XLA_FLAGS', '')
  nb = nbformat.read(repo_root / 'colab' / 'quickstart.ipynb', as_version=4)
  NotebookClient(nb, timeout=600, kernel_name='python3',
                 resources={'metadata': {'path': str(repo_root / 'colab')}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])]
  text = ''.join(o.get('text', '') for o in outputs)
  assert 'float ppl' in text and 'artifacts verified' in text
  assert any('image/png' in o.get('data', {}) for o in outputs)
  assert (tmp_path / 'sweep' / 'table.md').exists()
