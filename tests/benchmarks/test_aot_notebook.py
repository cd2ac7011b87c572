"""colab/aot.ipynb executes in its small mode: a tiny model compiled for a compile-only TPU v5e
and H200 (in the notebook's own kernel process, with JAX_PLATFORMS=cpu, so the toolchain never
loads in a test worker), and its table of the compiler's predictions."""

import pytest

from qjax.aot import toolchain


@pytest.mark.skipif(not all(toolchain.status()[p] for p in ('tpu', 'gpu')),
                    reason='no compile-only toolchain: python -m qjax.aot.install')
def test_aot_notebook_compiles_for_v5e_and_h200(run_notebook):
  text, outputs = run_notebook('aot.ipynb', QJAX_NB_SMALL='1', JAX_PLATFORMS='cpu',
                               JAX_ENABLE_COMPILATION_CACHE='false')
  assert 'formats: bf16, int4' in text, text
  assert '8 programs compiled: 8' in text, text
  assert 'v5e-1: xla cost analysis' in text and 'h200: hlo ops (upper bound)' in text, text
  assert 'refused by the compiler' not in text, text
  table = next(o['data']['text/markdown'] for o in outputs
               if 'text/markdown' in o.get('data', {}))
  assert "The compiler's prediction for compile-only devices; nothing ran." in table
  rows = [line for line in table.splitlines() if line.startswith('| v5e-1') or
          line.startswith('| h200')]
  assert len(rows) == 8, table
  assert all('| yes | yes |' in line for line in rows), table
  prefill_tpu = next(line for line in rows if line.startswith('| v5e-1 | prefill'))
  assert 'mosaic' in prefill_tpu, prefill_tpu  # the TPU's splash attention kernel
  # the HBM traffic column (qjax.aot.hbm_traffic) is counted for both targets
  traffic = [line.split('|')[8].strip() for line in rows]
  assert all(t.replace(',', '').isdigit() and int(t.replace(',', '')) > 0 for t in traffic), table
