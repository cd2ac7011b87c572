r"""Fine-tuning sweep: QLoRA on a frozen quantized base vs the base and a full fine-tune.

  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_gemma3.py
  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_tiny.py

The config's docstring states the points; `qjax.pipeline.finetune` runs them (resumable),
writing <out_dir>/results.jsonl and table.md; each QLoRA point also leaves its adapters
(points/<name>/adapters) and its merged, re-quantized model with a conversion record
(points/<name>/merged).
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax.pipeline import finetune, finetune_runner

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/qlora_gemma3.py', lock_config=True)


def main(argv):
  del argv
  finetune_runner.run_experiment(
      _CONFIG.value, config_flags.get_config_filename(flags.FLAGS['config']),
      finetune.point_name, finetune.run_finetune_sweep, finetune.COLUMNS)


if __name__ == '__main__':
  app.run(main)
