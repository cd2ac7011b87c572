"""Entry points: thin absl mains over `qjax.pipeline`, run from the repository root as
`python -m experiments.<name> --config=configs/<file>.py` (train, quantize, sweep, demo, qat,
gemma_ptq, plan). Nothing imports this package; reusable code lives in `qjax`.

Logging is quiet by default: absl, Orbax and jax log at WARNING and above, so a run prints its
own progress lines and results only. absl's `--verbosity` flag brings the rest back
(`--verbosity=0` for INFO, `--verbosity=1` for DEBUG).
"""

from absl import app
from absl import flags
from absl import logging


def _quiet_unless_asked() -> None:
  """absl raises verbosity to INFO after parsing unless `--verbosity` was given: undo that."""
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)


# Runs after app.run() has parsed the flags, before main().
app.call_after_init(_quiet_unless_asked)
