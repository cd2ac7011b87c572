r"""Post-training quantization of a trained run, with evidence.

  python -m experiments.quantize --config=configs/quantize.py --config.workdir=results/tiny_lm \
      --config.quant.bits=4 --config.quant.group_size=128 [--config.quant.method=gptq]

Loads the latest checkpoint, quantizes through a QuantPolicy with `quant.method` (RTN, or a
calibrated method of `qjax.algorithms.apply_method` fed by the config's calibration set:
`calib.*`, hashed into the record), evaluates the quantized model
against the float one on the same tokens (validation perplexity, logit differences on a fixed
reference batch, greedy agreement, weight bytes), saves the quantized model (Orbax) with a
conversion record, reloads it and checks that its logits reproduce bit for bit
(`qjax.pipeline.quantize_and_evaluate`).
"""

import json
import os

from absl import app
from ml_collections import config_flags

from qjax import pipeline

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/quantize.py', lock_config=True)


def main(argv):
  del argv
  c = _CONFIG.value
  base = pipeline.trained_checkpoint(c.workdir, c.allow_unfinished)  # verified, or refused
  model, _, data = pipeline.load_trained(c.workdir, c.allow_unfinished)
  ref = pipeline.FloatReference(model, data, c.eval)
  out = c.out_dir or os.path.join(c.workdir, 'quantized', pipeline.point_name(c.quant))
  row = pipeline.quantize_and_evaluate(ref, c.quant, out, base, calib=c.calib,
                                       options=c.options)
  print(json.dumps(row, indent=2, default=str))
  print(f'\nfloat ppl {ref.ppl["ppl"]:.4f} -> {row["name"]} ppl {row["ppl"]:.4f}; '
        f'weights {row["weight_bytes"]:,} B ({row["bytes_ratio"]:.3f}x float); '
        f'record: {out}/conversion_record.json')


if __name__ == '__main__':
  app.run(main)
