r"""Train a small language model: config -> data -> model -> optax loop -> Orbax checkpoints.

  python -m experiments.train --config=configs/tiny_lm.py --config.workdir=/tmp/lm \
      --config.train.steps=200

Killing it and running the same command again resumes from the latest checkpoint (the
batches are a pure function of (seed, step), so the resumed run ends on the same loss).
Writes to workdir: checkpoints/ (Orbax), metrics.jsonl, config.json, final.json
(`qjax.pipeline.train`).
"""

from absl import app
from ml_collections import config_flags

from qjax import pipeline

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_lm.py', lock_config=True)


def main(argv):
  del argv
  config = _CONFIG.value
  pipeline.train(config, config.workdir)


if __name__ == '__main__':
  app.run(main)
