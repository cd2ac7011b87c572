r"""QAT + distillation on the real model, against plain fine-tuning of the float model.

  XLA_FLAGS= .venv/bin/python -m experiments.qat_gemma3 --config=configs/qat_gemma3.py
  XLA_FLAGS= .venv/bin/python -m experiments.qat_gemma3 --config=configs/qat_gemma3.py:tiny

The config's docstring states the points; `qjax.pipeline.finetune_qat` runs them
(resumable), writing <out_dir>/results.jsonl and table.md with the fraction of the PTQ
start's perplexity gap each QAT point recovers.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax.pipeline import finetune_qat, finetune_runner

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/qat_gemma3.py', lock_config=True)


def main(argv):
  del argv
  finetune_runner.run_experiment(
      _CONFIG.value, config_flags.get_config_filename(flags.FLAGS['config']),
      finetune_qat.point_name, finetune_qat.run_qat_gemma_sweep, finetune_qat.COLUMNS)


if __name__ == '__main__':
  app.run(main)
