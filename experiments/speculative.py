r"""Speculative decoding sweep (draft precision x gamma x temperature); resumable.

  python -m experiments.speculative --config=configs/speculative_gemma3.py [--config.small=True]
      [--config.idle=True]

Writes <out_dir>/results.jsonl and table.md (`qjax.pipeline.speculative_sweep`) and prints the
table.
"""

from absl import app
from ml_collections import config_flags

from configs import speculative_gemma3
from qjax import eval as qeval
from qjax.pipeline import speculative_sweep

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/speculative_gemma3.py',
                                          lock_config=False)


def main(argv):
  del argv
  config = _CONFIG.value
  if config.small:
    config = speculative_gemma3.small(config)
  if config.idle:
    config = speculative_gemma3.idle(config)
  rows = speculative_sweep.run_from_config(config)
  print(qeval.markdown_table(rows, speculative_sweep.COLUMNS))
  later = [r for r in rows if speculative_sweep.BUDGET_SPENT in str(r.get('error', ''))]
  if later:
    print(f'{len(later)} of {len(rows)} points left for the next run (time budget spent); '
          'rerun the same command to continue.')
  qeval.require_success([r for r in rows if r not in later])


if __name__ == '__main__':
  app.run(main)
