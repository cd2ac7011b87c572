r"""LLM.int8()'s dynamic trigger rate on Gemma 3 270M: features and tokens in float, per layer.

    XLA_FLAGS= .venv/bin/python -m benchmarks.llm_int8_trigger [--threshold=6] [--windows=1]

Every projection but the tied embedding / head as int8 per channel, run with the LLM.int8()
decomposition (`qjax.algorithms.llm_int8.convert_layer`, outlier columns multiply the
dequantized int8 codes); `trigger_rate` on the first `--windows` BOS-first 512-token
WikiText-2 windows, one call per window (a 512-token prefill). Prints the overall share of
the decomposed multiply-adds done in float, the mean share of tokens that triggered, and the
layers with the most float columns; writes `--out`. ~3 min on 2 loaded cores, peak RSS ~4 GB.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags
import numpy as np

from qjax.algorithms.llm_int8 import convert_layer, trigger_rate
from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import int_format
from qjax.data import corpus
from qjax.nn import QuantPolicy, QuantRule, einsum_layers, quantize_model

_THRESHOLD = flags.DEFINE_float('threshold', 6.0, 'outlier threshold on |x| (the paper: 6)')
_WINDOWS = flags.DEFINE_integer('windows', 1, '512-token WikiText-2 windows (one call each)')
_OUT = flags.DEFINE_string('out', 'results/llm_int8_trigger/trigger.json', 'JSON written')


def main(_):
  model, tok, _ = load_gemma3_270m()
  policy = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(8))))
  qmodel = quantize_model(model, policy)[0]
  del model
  for _, layer in einsum_layers(qmodel):
    if layer.quantized:
      convert_layer(layer, _THRESHOLD.value)
  ids = np.asarray(tok.encode(corpus('wikitext2_valid')).ids, np.int32)
  n = _WINDOWS.value
  windows = ids[:n * 512].reshape(n, 512).copy()
  windows[:, 0] = tok.token_to_id('<bos>')
  rate = trigger_rate(qmodel, windows, batch_size=1)
  top = sorted(rate['layers'].items(), key=lambda kv: -kv[1]['features'])[:8]
  print(f"threshold {_THRESHOLD.value:g}, {rate['measured_on']}: {rate['features']:.4%} of the "
        f"decomposed multiply-adds in float; tokens that triggered, mean over layers "
        f"{rate['tokens']:.2%}")
  print('| layer | features in float | tokens that triggered |\n|---|---|---|')
  for p, v in top:
    print(f"| {p} | {v['features']:.3%} of {v['features_count']} | {v['tokens']:.2%} |")
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(rate | {'threshold': _THRESHOLD.value}, indent=1))
  print(f'wrote {out}')


if __name__ == '__main__':
  app.run(main)
