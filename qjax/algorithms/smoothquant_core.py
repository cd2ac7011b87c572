"""SmoothQuant (Xiao et al. 2022), the array math: migrate activation outliers into weights.

Per-token int8 activations fail when a few input channels carry values 10-100x larger than
the rest: each token's scale is set by its outlier channels, and every other channel rounds
to a handful of codes. SmoothQuant divides input channel j by

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

and multiplies weight row j by the same s_j, so x @ w = (x / s) @ (diag(s) w) exactly in real
arithmetic, while both factors now have flatter ranges. Then both are int8: the smoothed
weight per output channel, the smoothed activations per token (dynamic), multiplied with an
int32-accumulating dot by `qjax.core.qdot(..., path='int8')`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax.algorithms import _checks
from qjax.core.formats import int_format
from qjax.core.qarray import QArray, quantize
from qjax.core.qdot import qdot

W8_FMT = int_format(8, channel_axes=(1,))  # one scale per output channel F
A8_FMT = int_format(8)  # activations: qdot quantizes them per token, symmetric
_MIN_STAT = 1e-5  # SmoothQuant's clamp: dead channels / rows must not give 0 or inf scales


def absmax_update(amax_D: Optional[jax.Array], x_MD: jax.Array) -> jax.Array:
  """Fold one batch into the running per-channel max |x|.

  Args:
    amax_D: running max |x| per input channel, or None to start.
    x_MD: layer inputs, shape (..., D).

  Returns:
    The updated max |x|, shape (D,).
  """
  x = jnp.asarray(x_MD)
  _checks.check_finite(x, 'absmax_update: x_MD')
  m = jnp.max(jnp.abs(x.reshape(-1, x.shape[-1]).astype(jnp.float32)), axis=0)
  if amax_D is None:
    return m
  if amax_D.shape != m.shape:
    raise ValueError(f'absmax_update: amax_D has shape {amax_D.shape} but the inputs have '
                     f'D={m.shape[0]}; keep one statistic per layer input.')
  return jnp.maximum(amax_D, m)


def smooth_scales(act_absmax_D: jax.Array, w_DF: jax.Array, alpha: float = 0.5) -> jax.Array:
  """SmoothQuant's per-input-channel scales s_j = max|X_j|^alpha / max|W_j|^(1 - alpha).

  Args:
    act_absmax_D: max |x| per input channel over the calibration set (`absmax_update`).
    w_DF: the weight the inputs feed (concatenate q/k/v weights along F when one input
      feeds several layers, so they share s).
    alpha: migration strength in [0, 1]; 0.5 suits most models, ~0.75 ones with harsher
      activation outliers.

  Returns:
    s_D, positive and finite.
  """
  _checks.check_2d(w_DF, 'smooth_scales')
  _checks.check_alpha(alpha, 'smooth_scales')
  if act_absmax_D.shape != (w_DF.shape[0],):
    raise ValueError(f'smooth_scales: act_absmax_D has shape {act_absmax_D.shape} but w_DF '
                     f'has D={w_DF.shape[0]} input channels; pass max |x| of this layer input.')
  _checks.check_finite(act_absmax_D, 'smooth_scales: act_absmax_D')
  _checks.check_nonnegative(act_absmax_D, 'smooth_scales: act_absmax_D')
  _checks.check_finite(w_DF, 'smooth_scales: w_DF')
  a = jnp.maximum(act_absmax_D.astype(jnp.float32), _MIN_STAT)
  w = jnp.maximum(jnp.max(jnp.abs(w_DF.astype(jnp.float32)), axis=1), _MIN_STAT)
  return jnp.maximum(a ** alpha / w ** (1.0 - alpha), _MIN_STAT)


def smooth(x_MD: jax.Array, w_DF: jax.Array, s_D: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x / s, diag(s) w): the same product, with activation outliers moved into the weight."""
  return x_MD / s_D, w_DF * s_D[:, None]


def smoothquant_weight(w_DF: jax.Array, s_D: jax.Array) -> QArray:
  """The smoothed weight diag(s) w quantized to int8, one scale per output channel."""
  _checks.check_2d(w_DF, 'smoothquant_weight')
  if s_D.shape != (w_DF.shape[0],):
    raise ValueError(f'smoothquant_weight: s_D has shape {s_D.shape}; expected '
                     f'({w_DF.shape[0]},), one scale per input channel of w_DF.')
  return quantize(w_DF.astype(jnp.float32) * s_D[:, None], W8_FMT)


def w8a8_matmul(x_MD: jax.Array, qw: QArray, s_D: Optional[jax.Array] = None) -> jax.Array:
  """y = Q8(x / s) @ qw with int32 accumulation; `s_D=None` is plain (unsmoothed) W8A8.

  Args:
    x_MD: float inputs, shape (..., D).
    qw: int8 weight, e.g. `smoothquant_weight(w, s)` (or `quantize(w, W8_FMT)` unsmoothed).
    s_D: the smoothing scales the weight was multiplied by, or None.

  Returns:
    The product, shape (..., F), in x's dtype.
  """
  _checks.check_last_dim(x_MD, qw.shape[0], 'w8a8_matmul')
  if s_D is not None:
    x_MD = x_MD / s_D.astype(x_MD.dtype)
  return qdot(x_MD, qw, act_fmt=A8_FMT, path='int8')
