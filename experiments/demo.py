r"""The demo (`make demo`): train on the embedded corpus, then a PTQ sweep, then the table.

  python -m experiments.demo --config=configs/demo.py

Everything lands in config.out_dir (results/demo/): train/ (checkpoints, metrics.jsonl),
points/<name>/ (quantized model + conversion_record.json), results.jsonl, table.md,
ppl_vs_bytes.png. Rerunning resumes training and skips finished sweep points.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qjax import eval as qeval  # noqa: E402

from experiments import sweep as sweep_lib  # noqa: E402
from experiments import train as train_lib  # noqa: E402


def main(argv):
  del argv
  config = _CONFIG.value
  t0 = time.perf_counter()
  print('== 1. train', flush=True)
  final = train_lib.train(config, config.workdir)
  print(f'float model: validation perplexity {final["valid_ppl"]:.3f} vs unigram baseline '
        f'{final["unigram_ppl"]:.2f} ({final["params"]:,} parameters, '
        f'{final["data"]["train_tokens"]:,} training bytes of {final["data"]["source"]})')
  print('\n== 2. PTQ sweep (round-to-nearest)', flush=True)
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  rows = sweep_lib.run_ptq_sweep(config, sweep_lib.load_sweep(path)())
  print('\n== 3. results\n')
  print(qeval.markdown_table(rows))
  failed = [r['name'] for r in rows if r.get('status') not in ('ok', None)]
  print(f'\nunigram baseline perplexity {final["unigram_ppl"]:.2f}; float '
        f'{final["valid_ppl"]:.3f}. Written to {config.out_dir}/ (results.jsonl, table.md, '
        f'ppl_vs_bytes.png, points/*/conversion_record.json). Total '
        f'{time.perf_counter() - t0:.0f}s.' + (f' Failed points: {failed}' if failed else ''))


if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/demo.py', lock_config=True)
  app.run(main)
