r"""Run a config's PTQ sweep on a trained model; resumable, keeps going past failures.

  python -m experiments.sweep --config=configs/demo.py

The config file declares `sweep()` returning a list of override dicts (e.g.
{'quant.bits': 4, 'quant.group_size': 128}); each point quantizes the trained model in
`config.workdir` and appends its result to `<out_dir>/results.jsonl`. Rerunning skips the
points already finished. Writes table.md and ppl_vs_bytes.png next to the results
(`qjax.pipeline.run_ptq_sweep`).
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/demo.py', lock_config=True)


def main(argv):
  del argv
  config = _CONFIG.value
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  rows = pipeline.run_ptq_sweep(config, pipeline.load_sweep(path)())
  print(qeval.markdown_table(rows))
  qeval.require_success(rows)  # every point failed: exit non-zero


if __name__ == '__main__':
  app.run(main)
