"""AWQ (Lin et al. 2023), the array math: activation-aware per-channel scales and their search.

A weight row j (input channel) that meets large activations matters more to the output, so
AWQ multiplies it by s_j > 1 before rounding (shrinking its relative rounding error) and
divides the input by s_j to keep the product: y = (x / s) @ Q(diag(s) w). The scales are
s = mean|x|^alpha, normalised by sqrt(max s * min s) so they straddle 1; alpha is chosen on a
grid to minimise the layer's output error, measured here through the input Gram/Hessian
H = 2 X^T X / n of `gptq_core.hessian_update`:

    mean over tokens of ||x (W - W_hat)||^2 = 1/2 trace(dW^T H dW),  dW = W - W_hat,

so calibration streams two statistics (mean|x| and H) instead of keeping activations.
alpha = 0 gives s = 1 exactly, i.e. plain round-to-nearest, and it is always on the grid, so the
search never does worse than RTN on the calibration data. An optional clipping search then
shrinks each scale group's range (llm-awq's `auto_clip`) on the already scaled weight.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from qjax.algorithms import _checks
from qjax.core.calibration import compute_range
from qjax.core.formats import QFormat
from qjax.core.numerics import fake_round, scale_and_zero_point, scale_shape
from qjax.core.qarray import QArray, dequantize, quantize

_HI = lax.Precision.HIGHEST
_MIN_REL_ACT = 1e-5  # floor on mean|x| relative to its max: dead channels get finite scales


class AWQResult(NamedTuple):
  """What `awq_search` found.

  Attributes:
    qweight: `quantize(diag(s) w, fmt)` (with the searched clip range, if any).
    s_D: per-input-channel scales; the layer computes `(x / s_D) @ dequantize(qweight)`, or
      folds 1 / s_D into whatever produces x (a norm's gain, the previous linear's columns).
    alpha: the chosen exponent.
    error: mean squared output error per token, 1/2 tr(dW^T H dW), of the returned weight.
    errors: the error of every alpha on the grid (no clipping), shape (n_grid,).
  """
  qweight: QArray
  s_D: jax.Array
  alpha: float
  error: float
  errors: jax.Array


def absmean_update(stat_D: Optional[jax.Array], x_MD: jax.Array, count) -> tuple[jax.Array, object]:
  """Fold one batch into the running per-channel mean |x|.

  Args:
    stat_D: running mean |x| per input channel, or None to start.
    x_MD: layer inputs, shape (..., D).
    count: tokens already in `stat_D` (0 when it is None).

  Returns:
    (stat_D, count) after this batch.
  """
  x = jnp.asarray(x_MD)
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  if x.shape[0] == 0:
    raise ValueError('absmean_update: got an empty batch (0 tokens); skip it instead.')
  _checks.check_finite(x, 'absmean_update: x_MD')
  if stat_D is None:
    stat_D, count = jnp.zeros(x.shape[-1], jnp.float32), 0
  if stat_D.shape != x.shape[-1:]:
    raise ValueError(f'absmean_update: stat_D has shape {stat_D.shape} but the inputs have '
                     f'D={x.shape[-1]}; keep one statistic per layer input.')
  total = count + x.shape[0]
  return stat_D * (count / total) + jnp.sum(jnp.abs(x), axis=0) / total, total


def awq_scales(act_absmean_D: jax.Array, alpha) -> jax.Array:
  """s = mean|x|^alpha / sqrt(max * min); exactly 1 everywhere at alpha = 0."""
  a = jnp.maximum(act_absmean_D, _MIN_REL_ACT * jnp.max(act_absmean_D))
  s = a ** alpha
  return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


def output_error(dw_DF: jax.Array, h_DD: jax.Array) -> jax.Array:
  """Mean squared output error per token of a weight perturbation: 1/2 tr(dW^T H dW)."""
  return 0.5 * jnp.sum(dw_DF * jnp.dot(h_DD, dw_DF, precision=_HI))


@functools.partial(jax.jit, static_argnames=('fmt',))
def _alpha_errors(w_DF, act_D, h_DD, alphas, *, fmt: QFormat):
  def one(alpha):
    s = awq_scales(act_D, alpha)[:, None]
    return output_error(w_DF - dequantize(quantize(w_DF * s, fmt)) / s, h_DD)
  return lax.map(one, alphas)


@functools.partial(jax.jit, static_argnames=('fmt', 'n_grid'))
def _clip_range(ws_DF, hs_DD, *, fmt: QFormat, n_grid: int, max_shrink):
  """Per-scale clip range of the scaled weight minimising each group's own output error."""
  d, f = ws_DF.shape
  g = fmt.group_size or d
  n = d // g
  lo0, hi0 = compute_range(ws_DF, fmt)
  # Diagonal G x G blocks of H: the search scores each group on its own inputs (as auto_clip
  # does), ignoring the cross-group terms, so groups can be chosen independently.
  hb = jnp.diagonal(hs_DD.reshape(n, g, n, g), axis1=0, axis2=2).transpose(2, 0, 1)
  best = None
  for r in jnp.linspace(1.0, 1.0 - max_shrink, n_grid):
    lo, hi = lo0 * r, hi0 * r
    scale, zp = scale_and_zero_point(lo, hi, fmt)
    dw = (ws_DF - fake_round(ws_DF, scale, zp, fmt)).reshape(n, g, f)
    e = jnp.einsum('ngf,ngh,nhf->nf', dw, hb, dw, precision=_HI)
    e = e if fmt.channel_axes else jnp.sum(e, axis=1, keepdims=True)
    e = e.reshape(lo.shape)  # the scale layout: (n, F|1) with groups, (1, F|1) without
    if best is None:
      best = (e, lo, hi)
    else:
      better = e < best[0]
      best = tuple(jnp.where(better, new, old) for new, old in zip((e, lo, hi), best))
  return best[1], best[2]


def awq_search(w_DF: jax.Array, act_absmean_D: jax.Array, h_DD: jax.Array, fmt: QFormat, *,
               n_grid: int = 20, alpha: Optional[float] = None, clip_search: bool = False,
               clip_grid: int = 20, max_shrink: float = 0.5) -> AWQResult:
  """Search AWQ's scale exponent (and optionally clip ranges) for one linear layer.

  Args:
    w_DF: weight of `y = x @ w`, D input channels by F output channels.
    act_absmean_D: mean |x| per input channel, from `absmean_update`.
    h_DD: input Hessian 2 X^T X / n from `gptq_core.hessian_update` (a subsample of the
      calibration tokens is enough; it only scores candidates).
    fmt: integer weight format (groups along D, per-channel along F).
    n_grid: alphas tried, evenly spaced in [0, 1] (0 = RTN is always one of them).
    alpha: a fixed exponent in [0, 1] instead of the search.
    clip_search: also search a per-scale clip ratio of the scaled weight (kept only if it
      lowers the total output error).
    clip_grid: clip ratios tried, evenly spaced in [1 - max_shrink, 1].
    max_shrink: the largest fraction of the range the clip search may cut.

  Returns:
    An `AWQResult`; with `alpha=0.0` and no clip search, `qweight` equals
    `quantize(w_DF, fmt)` code for code and `s_D` is all ones.
  """
  _checks.check_2d(w_DF, 'awq_search')
  _checks.check_int_weight_format(fmt, 'awq_search')
  d, f = w_DF.shape
  if act_absmean_D.shape != (d,) or h_DD.shape != (d, d):
    raise ValueError(f'awq_search: expected act_absmean_D of shape ({d},) and h_DD of shape '
                     f'({d}, {d}) for w_DF of shape {w_DF.shape}; got {act_absmean_D.shape} '
                     f'and {h_DD.shape}.')
  for x, what in ((w_DF, 'w_DF'), (act_absmean_D, 'act_absmean_D'), (h_DD, 'h_DD')):
    _checks.check_finite(x, f'awq_search: {what}')
  _checks.check_nonnegative(act_absmean_D, 'awq_search: act_absmean_D')
  if _checks.is_concrete(act_absmean_D) and not float(jnp.max(act_absmean_D)) > 0:
    raise ValueError('awq_search: act_absmean_D is all zeros, so the layer never saw an input; '
                     'check that the calibration hook is attached to this layer.')
  if alpha is not None:
    _checks.check_alpha(alpha, 'awq_search')
  if n_grid < 1 or clip_grid < 1:
    raise ValueError(f'awq_search: n_grid={n_grid} and clip_grid={clip_grid} must be >= 1.')
  if not 0.0 <= max_shrink < 1.0:
    raise ValueError(f'awq_search: max_shrink={max_shrink} must be in [0, 1) (0.5 lets the '
                     'clip search cut up to half of each range).')
  scale_shape(w_DF.shape, fmt)  # group_size must divide D

  w = jnp.asarray(w_DF, jnp.float32)
  act = jnp.asarray(act_absmean_D, jnp.float32)
  h = jnp.asarray(h_DD, jnp.float32)
  grid = jnp.linspace(0.0, 1.0, n_grid) if alpha is None else jnp.asarray([alpha], jnp.float32)
  errors = _alpha_errors(w, act, h, grid, fmt=fmt)
  i = int(jnp.argmin(errors))
  best_alpha = float(grid[i])
  s = awq_scales(act, grid[i])
  ws = w * s[:, None]
  q = quantize(ws, fmt)
  err = float(errors[i])
  if clip_search:
    hs = h / (s[:, None] * s[None, :])  # the scaled weight meets inputs x / s
    qc = quantize(ws, fmt, calibration=_clip_range(ws, hs, fmt=fmt, n_grid=clip_grid,
                                                   max_shrink=max_shrink))
    err_c = float(output_error(w - dequantize(qc) / s[:, None], h))
    if err_c < err:
      q, err = qc, err_c
  q = q.with_dtype(w_DF.dtype)
  return AWQResult(q, s, best_alpha, err, errors)
