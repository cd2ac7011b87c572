r"""The demo (`make demo`): train on the embedded corpus, then a PTQ sweep, then the table.

  python -m experiments.demo --config=configs/demo.py

Everything lands in config.out_dir (results/demo/): train/ (checkpoints, metrics.jsonl),
points/<name>/ (quantized model + conversion_record.json), results.jsonl, table.md, and
ppl_vs_bytes.png where matplotlib (the 'plots' extra) is installed; the last line lists what
was written. Rerunning resumes training and skips finished sweep points.
`--stop_after=train` ends after the first stage (the README's transcript test runs it).
Logging is quiet unless `--verbosity` is given (experiments/__init__.py).
"""

import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/demo.py', lock_config=True)
_STOP_AFTER = flags.DEFINE_enum('stop_after', 'results', ['train', 'results'],
                                'The last stage to run: train, or the whole demo.')


def _mtime(path: str):
  """The file's modification time in ns, or None where there is no file."""
  return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def main(argv):
  del argv
  config = _CONFIG.value
  t0 = time.perf_counter()
  print('== 1. train', flush=True)
  final = pipeline.train(config, config.workdir)
  print(f'float model: validation perplexity {final["valid_ppl"]:.3f} vs unigram baseline '
        f'{final["unigram_ppl"]:.2f} ({final["params"]:,} parameters, '
        f'{final["data"]["train_tokens"]:,} training bytes of {final["data"]["source"]})')
  if _STOP_AFTER.value == 'train':
    return
  print('\n== 2. PTQ sweep (round-to-nearest)', flush=True)
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  figure = os.path.join(config.out_dir, 'ppl_vs_bytes.png')
  before = _mtime(figure)
  rows = pipeline.run_ptq_sweep(config, pipeline.load_sweep(path)())
  # The figure is optional (written only with matplotlib): name it only if this run wrote it.
  plotted = _mtime(figure) not in (None, before)
  written = ['results.jsonl', 'table.md'] + (['ppl_vs_bytes.png'] if plotted else [])
  print('\n== 3. results\n')
  print(qeval.markdown_table(rows))
  failed = [r['name'] for r in rows if r.get('status') not in ('ok', None)]
  print(f'\nunigram baseline perplexity {final["unigram_ppl"]:.2f}; float '
        f'{final["valid_ppl"]:.3f}. Written to {config.out_dir}/ ({", ".join(written)}, '
        f'points/*/conversion_record.json). Total {time.perf_counter() - t0:.0f}s.'
        + (f' Failed points: {failed}' if failed else ''))
  qeval.require_success(rows)  # every point failed: exit non-zero


if __name__ == '__main__':
  app.run(main)
