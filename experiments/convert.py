r"""Convert a HF checkpoint directory or a Gemma 3 GGUF into a quantized qjax checkpoint.

  python -m experiments.convert --config=configs/convert.py --config.source=DIR_OR_GGUF \
      --config.method=gptq --config.bits=4 --config.group_size=128 --config.out=OUT

See the config's docstring for what is written and how calibration and evaluation are done
(`qjax.pipeline.convert`); `python -m experiments.serve --config.checkpoint=OUT` serves it.
"""

import json

from absl import app
from ml_collections import config_flags

from qjax.pipeline import convert

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/convert.py', lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  with c.unlocked():  # the shortcuts win over the quant section's defaults
    c.quant.method, c.quant.bits, c.quant.group_size = c.method, c.bits, c.group_size
  row = convert.convert(c, log=lambda s: print(s, flush=True))
  print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}, indent=1,
                   default=str))
  print(f"\n{row['name']}: perplexity {row['float_ppl']:.3f} (float) -> {row['ppl']:.3f}; "
        f"weights {row['weight_bytes']:,} B ({row['bytes_ratio']:.3f}x float); greedy "
        f"agreement {row.get('greedy_agreement', float('nan')):.3f}\nwritten: {c.out} "
        f'(serve it: python -m experiments.serve --config.checkpoint={c.out})')


if __name__ == '__main__':
  app.run(main)
