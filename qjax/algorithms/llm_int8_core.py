"""LLM.int8() (Dettmers et al. 2022), the array math: vector-wise int8 with outlier features.

Vector-wise quantization gives every row of X (token) and every column of W (output channel)
its own absmax scale, multiplies the int8 codes with int32 accumulation and rescales by the
outer product of the two scale vectors. Past ~6.7B parameters a few hidden *features* (input
channels D) reach magnitudes of 20-60 in most tokens; a token's scale then follows its
outliers and its ordinary values collapse to few codes. The mixed-precision decomposition
takes the feature columns of X whose max |x| (over the batch) exceeds `threshold`, and the
matching rows of W, out of the int8 product and multiplies them in float32:

    y = Q8(x * not_outlier) @ Q8(w)  +  (x * outlier) @ w.

Columns are selected with masks, not boolean indexing, so shapes are static and the function
jits; zeroed columns add nothing to the int8 dot. The weight is quantized once over all its
rows (as a stored int8 weight would be): the outlier rows it holds meet zero activations.

The reported 8-bit fraction counts input features (columns of X). Because whole columns are
moved, it is also the fraction of X's entries and of the multiply-adds done in int8.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from qjax.algorithms import _checks
from qjax.core.qarray import QArray, dequantize, quantize
from qjax.core.qdot import qdot
from qjax.core.formats import int_format

W8_FMT = int_format(8, channel_axes=(1,))  # column-wise (per output channel) absmax
A8_FMT = int_format(8)  # qdot quantizes activations row-wise (per token) absmax


def outlier_features(x_MD: jax.Array, threshold) -> jax.Array:
  """Boolean mask over D of the feature columns whose max |x| exceeds `threshold`."""
  x = x_MD.reshape(-1, x_MD.shape[-1])
  return jnp.max(jnp.abs(x), axis=0) > threshold


def outlier_counts(x_MD: jax.Array, threshold) -> dict:
  """What one LLM.int8() call sends to the float path: the dynamic trigger rate.

  Args:
    x_MD: one call's inputs, (..., D): every leading axis is a token of the call.
    threshold: the outlier threshold on |x|.

  Returns:
    {'features': share of the D feature columns with some |x| > threshold (the columns the
     decomposition multiplies in float: `outlier_features`), 'tokens': share of the tokens
     holding at least one such entry (the tokens that triggered it), 'entries': share of
     the entries above the threshold}, float32 scalars.
  """
  big_MD = jnp.abs(x_MD.reshape(-1, x_MD.shape[-1])) > threshold
  return {'features': jnp.mean(jnp.any(big_MD, axis=0).astype(jnp.float32)),
          'tokens': jnp.mean(jnp.any(big_MD, axis=1).astype(jnp.float32)),
          'entries': jnp.mean(big_MD.astype(jnp.float32))}


def llm_int8_matmul(x_MD: jax.Array, w: Union[jax.Array, QArray],
                    threshold: float = 6.0) -> tuple[jax.Array, jax.Array]:
  """LLM.int8() matmul `x @ w` with mixed-precision decomposition.

  Args:
    x_MD: float inputs, shape (..., D); NaN/Inf rejected when concrete.
    w: the weight, (D, F): a float array (outlier rows multiply in float with it, so
      `threshold=0` reproduces `x @ w`), or an int8 `QArray` in `W8_FMT` (outlier rows use its
      dequantized values, as a deployed int8-only weight would).
    threshold: a feature column is an outlier when its max |x| exceeds this (the paper's
      6.0); 0 puts every non-zero column in float, `inf` is plain vector-wise int8.

  Returns:
    (y, frac_int8): y of shape (..., F) in x's dtype, and the fraction of input features
    (= of X entries = of multiply-adds) computed in int8, a float32 scalar.
  """
  d = w.shape[0]
  if len(w.shape) != 2:
    raise ValueError(f'llm_int8_matmul: expected a 2-d weight w_DF, got shape {w.shape}.')
  _checks.check_last_dim(x_MD, d, 'llm_int8_matmul')
  _checks.check_finite(x_MD, 'llm_int8_matmul: x_MD')
  if _checks.is_concrete(threshold) and not float(threshold) >= 0:
    raise ValueError(f'llm_int8_matmul: threshold={threshold} must be >= 0 (6.0 in the paper; '
                     "float('inf') disables the decomposition).")
  if isinstance(w, QArray):
    per_column = w.scale.shape == (1, w.shape[1])  # one scale per column of (D, F)
    if w.qtype.is_float or w.bits != 8 or not per_column:
      raise ValueError(f'llm_int8_matmul: weight format {w.layout_name} is not vector-wise int8; '
                       'quantize it with llm_int8_core.W8_FMT (int8, channel_axes=(1,)).')
    qw, w_float = w, dequantize(w, jnp.float32)
  else:
    _checks.check_finite(w, 'llm_int8_matmul: w')
    w_float = w.astype(jnp.float32)
    qw = quantize(w_float, W8_FMT)
  outlier_D = outlier_features(x_MD, threshold)
  x = x_MD.astype(jnp.float32)
  x_int8 = jnp.where(outlier_D, 0.0, x)
  x_float = jnp.where(outlier_D, x, 0.0)
  y = qdot(x_int8, qw, act_fmt=A8_FMT, path='int8', out_dtype=jnp.float32)
  y = y + jnp.matmul(x_float, w_float, precision=jax.lax.Precision.HIGHEST)
  frac_int8 = 1.0 - jnp.mean(outlier_D.astype(jnp.float32))
  return y.astype(x_MD.dtype), frac_int8
