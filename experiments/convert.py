r"""Convert a HF checkpoint directory or a Gemma 3 GGUF into a quantized qjax checkpoint.

  python -m experiments.convert --config=configs/convert.py --config.source=DIR_OR_GGUF \
      --config.method=gptq --config.bits=4 --config.group_size=128 --config.out=OUT

See the config's docstring for what is written and how calibration and evaluation are done
(`qjax.pipeline.convert`); `python -m experiments.serve --config.checkpoint=OUT` serves it.
"""

import json
import os

from qjax.pipeline import cli, convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.define_config(os.path.join(ROOT, 'configs', 'convert.py'), ROOT,
                            lock_config=True, prog='experiments.convert')


def main(argv):
  del argv
  c = _CONFIG.value
  with c.unlocked():  # the shortcuts win over the quant section's defaults
    c.quant.method, c.quant.bits, c.quant.group_size = c.method, c.bits, c.group_size
  row = convert.convert(c, log=lambda s: print(s, flush=True))
  print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}, indent=1,
                   default=str))
  print(f'\n{convert.headline(row)}\nwritten: {c.out} (serve it: python -m '
        f'experiments.serve --config.checkpoint={c.out})')


if __name__ == '__main__':
  cli.run(main, 'experiments.convert')
