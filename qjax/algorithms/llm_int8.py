"""LLM.int8() integration: an Einsum layer that runs the mixed-precision decomposition.

`LLMInt8Einsum` replaces a quantized Einsum in place. At every call it finds the input
features (contracted elements of x, e.g. the D of 'BTD' or the (N, H) of 'BTNH') whose max
|x| over the call's tokens exceeds `threshold`; those columns are multiplied in the compute
dtype, the rest through `qeinsum`'s int8 x int8 -> int32 path with vector-wise scales
(per token for x, per output channel for the stored int8 weight). It is the einsum form of
`llm_int8_core.llm_int8_matmul`, which the tests compare it with.

The outlier columns multiply either a float copy of the weight (`outlier_weights='float'`,
the paper's fp16 decomposition: threshold 0 reproduces the float layer, and the device
holds int8 + float weights) or the dequantized int8 codes (`'int8'`: what an int8-only
deployment stores, as bitsandbytes does without fp16 weights).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QArray, dequantize, qeinsum
from qjax.core.formats import normalize_axis
from qjax.core.qdot import INT8_ACT
from qjax.nn.layers import Einsum, parse_spec

OPTIONS = {'threshold': 6.0, 'outlier_weights': 'float'}
OUTLIER_WEIGHTS = ('float', 'int8')


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
  ch = {normalize_axis(a, q.ndim, 'channel_axes') for a in q.fmt.channel_axes}
  if q.fmt.is_float or q.fmt.bits != 8 or q.fmt.group_size is not None or ch != outputs:
    raise ValueError(f'llm_int8: layer {path!r} has weight format {q.fmt.name}; LLM.int8() is '
                     "vector-wise int8: use bits=8, no group_size, granularity='channel' "
                     '(4-bit and grouped weights: use gptq or awq).')


class LLMInt8Einsum(Einsum):
  """An Einsum whose forward is LLM.int8() (module docstring).

  Attributes (beyond `Einsum`'s, copied from the layer it replaces):
    threshold: outlier threshold on max |x| of a feature column.
    w_outlier: `nnx.Param` float copy of the weight for the outlier columns, or None (use
      the dequantized int8 codes).
  """

  def __init__(self, layer: Einsum, threshold: float, w_float: Optional[jax.Array] = None):
    for k, v in vars(layer).items():  # spec, axes, w, act_fmt, compute path, ...
      if not k.startswith('_'):
        setattr(self, k, v)
    self.threshold = float(threshold)
    self.w_outlier = None if w_float is None else nnx.Param(
        w_float, out_sharding=self.axes, eager_sharding=False)  # the float weight's axes

  def apply(self, x: jax.Array, w, out_dtype=None) -> jax.Array:
    return self.forward(x, w, out_dtype)[0]

  def forward(self, x: jax.Array, qw: QArray, out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(y, fraction of input features multiplied in int8) for one call with weight `qw`."""
    out_dtype = out_dtype or x.dtype
    xs = parse_spec(self.spec)[0]
    tokens = tuple(i for i, c in enumerate(xs) if c not in self.contracted_letters)
    outlier = jnp.max(jnp.abs(x), axis=tokens, keepdims=True) > self.threshold
    x_int8 = jnp.where(outlier, jnp.zeros((), x.dtype), x)
    x_float = jnp.where(outlier, x, jnp.zeros((), x.dtype))
    y = qeinsum(self.spec, x_int8, qw, act_fmt=INT8_ACT, path='int8', out_dtype=out_dtype)
    wf = dequantize(qw, x.dtype) if self.w_outlier is None else self.w_outlier[...]
    # The float part is the float layer's own einsum, so threshold 0 reproduces it exactly.
    y = y + jnp.einsum(self.spec, x_float, wf.astype(x.dtype), preferred_element_type=out_dtype)
    return y, 1.0 - jnp.mean(outlier.astype(jnp.float32))
