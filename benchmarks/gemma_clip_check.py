r"""Why MSE clipping loses to absmax on Gemma 3 270M at int4 g128: weight vs output error.

  XLA_FLAGS= .venv/bin/python -m benchmarks.gemma_clip_check [--windows=8] [--bits=4]

For every quantized Einsum (the tied embedding stays float) the weight is RTN-quantized with
absmax ranges and with the MSE clip search (`QFormat(calibration='mse')`), and two errors are
compared: the relative weight error ||dW|| / ||W|| (what the MSE search minimises) and the
relative output error tr(dW^T H dW) / tr(W^T H W), H = 2 X^T X / n from the float model's
inputs of that layer on `--windows` 512-token WikiText-2 windows after the evaluated ones
(the Gemma PTQ sweep's calibration split, `qjax.pipeline.gemma`). Prints, per GGUF source
type, the mean of both errors for both methods and the fraction of layers where MSE lowers the
weight error but raises the output error. A last column checks that the file's Q4_K tensors already
sit on a 4-bit grid per 32 weights (so 4-bit group-32 re-quantization looks unrealistically good
on them; docs/ptq.md reports the Gemma sweep per source type for that reason): the relative
weight error of asymmetric int4 with groups of 32 (Q4_K's own block
size), which should be near zero on them alone. Run time: ~5 min on 2 cores.
"""

import collections
import os

from absl import app
from absl import flags
import jax.numpy as jnp
import numpy as np

from qjax.algorithms.apply import _block_fwd, _embed_fwd
from qjax.algorithms.awq_core import output_error
from qjax.algorithms.calibrate import (EinsumView, calibration_batches, collect_stats,
                                       forward)
from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import dequantize, int_format
from qjax.data import corpus
from qjax.nn import QuantPolicy, QuantRule, einsum_layers, quantize_model
from qjax.pipeline.gemma import bos_windows

_WINDOWS = flags.DEFINE_integer('windows', 8, 'calibration windows of 512 tokens')
_BITS = flags.DEFINE_integer('bits', 4, 'integer bits')
_GROUP = flags.DEFINE_integer('group_size', 128, 'group size')


def main(argv):
  del argv
  print(f'load average: {os.getloadavg()}', flush=True)
  model, tok, info = load_gemma3_270m()
  bos = tok.token_to_id('<bos>')
  ids = np.asarray(tok.encode(corpus('wikitext2_valid')).ids, np.int32)
  calib = bos_windows(ids[8 * 512:], bos, 512, _WINDOWS.value)
  batches = calibration_batches(calib, model.config.vocab_size, model.config.max_len, 2)
  fmts = {m: int_format(_BITS.value, group_size=_GROUP.value, calibration=m)
          for m in ('absmax', 'mse')}
  fmts['asym_g32'] = int_format(4, group_size=32, symmetric=False, calibration='minmax')
  # The policy resolves each layer's channel and group axes; keep the codes, not float copies.
  quantized = {m: quantize_model(model, QuantPolicy((QuantRule('embed', exempt=True),
                                                     QuantRule('.*', f))))[0]
               for m, f in fmts.items()}
  rows = []
  xs = [forward(model, _embed_fwd, b) for b in batches]
  for i, block in enumerate(model.layers):
    layers = [p for p, _ in einsum_layers(block)]
    stats = collect_stats(block, _block_fwd, xs, layers, ('hessian',))
    for p, layer in einsum_layers(block):
      w = layer.w.get_value()
      view = EinsumView.of(layer)
      w2, h = view.to_2d(w), stats[p].hessian
      base = float(output_error(w2, h))
      r = {'path': f'layers/{i}/{p}', 'type': info['tensor_types'][f'layers/{i}/{p}/w']}
      for m, qm in quantized.items():
        qw = dict(einsum_layers(qm.layers[i]))[p].w.get_value()
        dw = dequantize(qw, jnp.float32) - w
        r[f'w_{m}'] = float(jnp.linalg.norm(dw) / jnp.linalg.norm(w))
        r[f'out_{m}'] = float(output_error(view.to_2d(dw), h)) / base
      rows.append(r)
    xs = [forward(block, _block_fwd, x) for x in xs]
    print(f'block {i}: done', flush=True)
  by = collections.defaultdict(list)
  for r in rows:
    by[r['type']].append(r)
    by['all'].append(r)
  print(f'\nint{_BITS.value} g{_GROUP.value}, {calib.shape[0]} x 512 calibration tokens; '
        'relative errors (mean over layers)\n')
  print('| source type | layers | weight err absmax | weight err MSE | output err absmax | '
        'output err MSE | MSE lower weight err, higher output err | weight err int4 asym g32 |')
  print('|---|---|---|---|---|---|---|---|')
  for kind, rs in sorted(by.items()):
    mean = lambda k, rs=rs: np.mean([r[k] for r in rs])
    flip = np.mean([(r['w_mse'] < r['w_absmax']) and (r['out_mse'] > r['out_absmax'])
                    for r in rs])
    print(f"| {kind} | {len(rs)} | {mean('w_absmax'):.4f} | {mean('w_mse'):.4f} | "
          f"{mean('out_absmax'):.4g} | {mean('out_mse'):.4g} | {flip:.2f} | "
          f"{mean('w_asym_g32'):.4f} |")
  worst = sorted(rows, key=lambda r: r['out_mse'] / r['out_absmax'])[-5:]
  print('\nlayers where MSE hurts the output most (output err MSE / absmax):')
  for r in worst:
    print(f"  {r['path']} ({r['type']}): {r['out_mse'] / r['out_absmax']:.2f}x, weight err "
          f"{r['w_mse'] / r['w_absmax']:.2f}x")


if __name__ == '__main__':
  app.run(main)
