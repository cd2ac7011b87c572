"""LLM.int8() integration: an Einsum described to run the mixed-precision decomposition.

`convert_layer` sets a quantized int8 Einsum's description (`EinsumQuant.outlier_threshold`,
`outlier_weights`); the layer's forward (`Einsum.outlier_forward`) then finds, at every call,
the input features (contracted elements of x, e.g. the D of 'BTD' or the (N, H) of 'BTNH')
whose max |x| over the call's tokens exceeds the threshold; those columns are multiplied in
the compute dtype, the rest through `qeinsum`'s int8 x int8 -> int32 path with vector-wise
scales (per token for x, per output channel for the stored int8 weight). It is the einsum
form of `llm_int8_core.llm_int8_matmul`, which the tests compare it with.

The outlier columns multiply either a float copy of the weight (`outlier_weights='float'`,
the paper's fp16 decomposition: threshold 0 reproduces the float layer, and the device
holds int8 + float weights) or the dequantized int8 codes (`'int8'`: what an int8-only
deployment stores, as bitsandbytes does without fp16 weights).

`trigger_rate` measures the decomposition's dynamic fallback on given tokens: per layer, the
share of feature columns (and of multiply-adds) that took the float path and the share of
tokens that triggered it (the counts of `llm_int8_core.outlier_counts`, per call).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.algorithms.calibrate import EinsumView
from qjax.algorithms.llm_int8_core import outlier_counts
from qjax.core import QArray
from qjax.nn import einsum_layers
from qjax.nn.einsum_quant import OUTLIER_WEIGHTS
from qjax.nn.layers import Einsum, tap_inputs

OPTIONS = {'threshold': 6.0, 'outlier_weights': 'float'}


def check_options(opts: dict) -> None:
  t = opts['threshold']
  if not float(t) >= 0:
    raise ValueError(f'llm_int8: threshold={t} must be >= 0 (6.0 in the paper; 0 sends every '
                     "non-zero feature to float, float('inf') none).")
  if opts['outlier_weights'] not in OUTLIER_WEIGHTS:
    raise ValueError(f"llm_int8: outlier_weights={opts['outlier_weights']!r} is unknown; use "
                     f'one of {OUTLIER_WEIGHTS}.')


def check_vector_wise(q: QArray, layer: Einsum, path: str) -> None:
  """LLM.int8() needs int8 codes with one scale per output element and no groups."""
  outputs = {a for a in range(q.ndim) if a not in layer.contracted_axes}
  per_output = [a for a, t in enumerate(q.tile_shape) if t == 1 and q.shape[a] > 1]
  whole = all(t == n for a, (t, n) in enumerate(zip(q.tile_shape, q.shape)) if a not in outputs)
  if q.qtype.is_float or q.bits != 8 or not whole or set(per_output) != {
      a for a in outputs if q.shape[a] > 1}:
    raise ValueError(f'llm_int8: layer {path!r} has weight format {q.layout_name}; LLM.int8() is '
                     "vector-wise int8: use bits=8, no group_size, granularity='channel' "
                     '(4-bit and grouped weights: use gptq or awq).')


def convert_layer(layer: Einsum, threshold: float, w_float: Optional[jax.Array] = None) -> None:
  """Make a quantized int8 Einsum run LLM.int8(), in place (its description, not its class).

  Args:
    layer: an Einsum holding vector-wise int8 weights (`check_vector_wise`).
    threshold: outlier threshold on max |x| of a feature column.
    w_float: the float weight the outlier columns multiply, or None for the dequantized
      codes (`outlier_weights='int8'`).
  """
  quant = layer.quant.replace(outlier_threshold=float(threshold),
                              outlier_weights='int8' if w_float is None else 'float')
  layer.set_quant(quant, **({} if w_float is None else {'w_outlier': w_float}))


def llm_int8_layers(model: nnx.Module) -> dict[str, Einsum]:
  """{path: Einsum} of the layers of `model` that run LLM.int8() (an outlier threshold)."""
  return {p: l for p, l in einsum_layers(model)
          if l.quantized and l.quant.outlier_threshold is not None}


@functools.partial(jax.jit, static_argnums=0)
def _counts(graphdef, state, tokens_BT):
  """One forward on `tokens_BT` = one LLM.int8() call per layer: its outlier counts."""
  model = nnx.merge(graphdef, state)
  layers = llm_int8_layers(model)
  names = {id(l): p for p, l in layers.items()}
  out = {}

  def tap(layer, x):  # sees exactly the x that `Einsum.outlier_forward` thresholds
    p = names.get(id(layer))
    if p is not None and p not in out:
      rows = EinsumView.of(layer).x_rows(x)
      out[p] = outlier_counts(rows, layers[p].quant.outlier_threshold)

  with tap_inputs(tap):
    model(tokens_BT)
  return out


def trigger_rate(model: nnx.Module, tokens_BT, batch_size: int = 1) -> dict:
  """The dynamic fallback of a model's LLM.int8() layers on `tokens_BT`.

  Each batch of `batch_size` rows is one call per layer (outlier columns are chosen per call,
  over the call's tokens), as in serving a prefill of that batch.

  Args:
    model: a Transformer with LLM.int8() layers (`apply_method(..., 'llm_int8')`).
    tokens_BT: [B, T] int token ids.
    batch_size: rows per call.

  Returns:
    {'layers': {path: {'features' (mean over calls of the share of feature columns in
     float), 'tokens' (share of all tokens with some |x| > threshold), 'entries',
     'threshold', 'features_count' (D of the layer)}}, 'features' (multiply-add weighted
     over layers: the share of the decomposed layers' multiply-adds done in float),
     'tokens' (mean over layers), 'calls', 'tokens_seen'}.
  """
  layers = llm_int8_layers(model)
  if not layers:
    raise ValueError('trigger_rate: the model has no LLM.int8() layer (no Einsum with an '
                     "outlier threshold); convert it with apply_method(..., 'llm_int8').")
  tokens_BT = np.asarray(tokens_BT)
  if tokens_BT.ndim != 2 or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f'trigger_rate: tokens of shape {tokens_BT.shape} and batch_size='
                     f'{batch_size!r}; give [B, T] tokens and a positive integer batch.')
  graphdef, state = nnx.split(model)
  per_call = []
  for i in range(0, tokens_BT.shape[0], batch_size):
    per_call.append(jax.device_get(_counts(graphdef, state,
                                           jnp.asarray(tokens_BT[i:i + batch_size]))))
  n_tok = [min(batch_size, tokens_BT.shape[0] - i) for i in range(0, tokens_BT.shape[0],
                                                                    batch_size)]
  out = {}
  for p, layer in layers.items():
    w = np.asarray(n_tok, np.float64) / sum(n_tok)
    out[p] = {'features': float(np.mean([c[p]['features'] for c in per_call])),
              'tokens': float(np.dot(w, [c[p]['tokens'] for c in per_call])),
              'entries': float(np.dot(w, [c[p]['entries'] for c in per_call])),
              'threshold': float(layer.quant.outlier_threshold),
              'features_count': EinsumView.of(layer).rows}
  macs = {p: EinsumView.of(l).rows * EinsumView.of(l).cols for p, l in layers.items()}
  return {'layers': out,
          'features': sum(out[p]['features'] * m for p, m in macs.items()) / sum(macs.values()),
          'tokens': float(np.mean([v['tokens'] for v in out.values()])),
          'calls': len(per_call), 'tokens_seen': int(tokens_BT.size),
          'measured_on': f'{tokens_BT.shape[0]} x {tokens_BT.shape[1]} tokens, {batch_size} '
                         'rows per call (outlier columns are chosen per call)'}
