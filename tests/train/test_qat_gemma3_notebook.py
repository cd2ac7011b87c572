"""colab/qat_gemma3.ipynb executes in its small mode (a random tiny model, RTN start): the
QAT + distillation sweep finishes, trains without the frozen embedding and reports the
served (converted) model's perplexity next to the fake-quantized one."""

import re


def test_qat_gemma3_notebook_runs(run_notebook):
  text, _ = run_notebook('qat_gemma3.ipynb', QJAX_NB_SMALL='1')
  assert 'QAT points finished: True' in text, text
  n = int(re.search(r'trainable params \(embedding frozen\): (\d+)', text).group(1))
  # 1 layer of d=64, d_ff=128, 2 heads x 64, 1 kv head: projections q 8192 + k, v 4096 each
  # + o 8192 + gate, up, down 8192 each = 49152 weights, plus norms (64 each) and one LSQ
  # scale per 64-weight group (768); without the 257 x 64 = 16448-weight embedding.
  assert 49152 + 768 < n < 49152 + 768 + 64 * 8, n
  served, fake = map(float, re.search(r'served \(real codes\) ppl ([\d.]+) \| fake-quant ppl '
                                      r'([\d.]+)', text).groups())
  assert abs(served - fake) / fake < 0.05, (served, fake)
