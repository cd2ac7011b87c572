"""colab/qlora.ipynb executes in its small mode: the adapter API on an int4 model (training
lowers the loss, the base hash is unchanged, adapters reload onto the same base and a wrong
base is refused) and the fine-tuning pipeline (QLoRA beats the quantized base; the merged,
re-quantized model reloads bit for bit with a record stating the adapters and their merge)."""

import re


def test_qlora_notebook_runs(run_notebook):
  text, _ = run_notebook('qlora.ipynb', QJAX_NB_SMALL='1')
  for fact in ('loss went down: True', 'base unchanged (content hash): True',
               'adapters reloaded onto the same base: True', 'wrong base refused: True',
               'QLoRA improves on the quantized base: True',
               'merged + re-quantized reloads bit-identical: True',
               'adapter_merge_status: merged: ', "'before_merge_ppl'", "'after_merge_ppl'",
               'plot written: True'):
    assert fact in text, (fact, text)
  assert 'trained on base' in text  # the refusal names the mismatch
  # Reloaded adapters, merged and re-quantized again by RTN: the same model, the same ppl;
  # the merged float model scores like the adapted one.
  assert 'export reproduces the merged ppl: True' in text, text
  assert 'export scores the unadapted base: True' in text, text
  merged, adapted = map(float, re.search(r'merged float ppl ([\d.]+) vs adapted ([\d.]+)',
                                         text).groups())
  assert abs(merged - adapted) / adapted < 0.02, (merged, adapted)
