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
"""

from __future__ import annotations

from typing import Optional

import jax

from qjax.core import QArray
from qjax.nn.einsum_quant import OUTLIER_WEIGHTS
from qjax.nn.layers import Einsum

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
