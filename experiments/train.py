r"""Train a small language model: config -> data -> model -> optax loop -> Orbax checkpoints.

  python -m experiments.train --config=configs/tiny_lm.py --config.workdir=/tmp/lm \
      --config.train.steps=200

Killing it and running the same command again resumes from the latest checkpoint (the
batches are a pure function of (seed, step), so the resumed run ends on the same loss).
Writes to workdir: checkpoints/ (Orbax), metrics.jsonl, config.json, final.json
(`qjax.pipeline.train`).
"""

import os

from qjax import pipeline
from qjax.pipeline import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.define_config(os.path.join(ROOT, 'configs', 'tiny_lm.py'), ROOT,
                            lock_config=True, prog='experiments.train')


def main(argv):
  del argv
  config = _CONFIG.value
  pipeline.train(config, config.workdir)


if __name__ == '__main__':
  cli.run(main, 'experiments.train')
