"""GPTQ (Frantar et al. 2022), the array math: Hessian accumulation and the column sweep.

GPTQ quantizes the input rows of `w_DF` (the "columns" of the paper's W, which is stored
(F, D)) one at a time and spreads each row's rounding error over the rows not yet quantized,
weighted by the inverse Hessian of the layer's output error, H = 2 X^T X / n. With U the upper
Cholesky factor of H^-1 (H^-1 = U^T U), quantizing row j with error e_j = (w_j - q_j) / U_jj
updates every later row k by w_k -= U_jk e_j. Rows are swept in blocks of `block_size`: inside
a block each row's current value is rebuilt from the block-start value and the block's
errors so far, and the rows after the block receive the whole block's update in one matmul
(the paper's "lazy batch" update), which is where the time goes.

Scales follow one rule, with or without act-order: a group's scale is fixed when the sweep
reaches the group's first row, from the *current* (error-updated) values of all the group's
rows, by the same `compute_range` + `scale_and_zero_point` that `qjax.core.quantize` uses.
Hence H = identity reproduces `quantize(w, fmt)` code for code. Groups are always contiguous
runs of `group_size` rows in the original order (qjax's QArray layout), so with act-order
(rows swept by decreasing H_jj) a group's rows are visited out of order; this is AutoGPTQ's
`static_groups` bookkeeping, except that the scale is taken at the group's first visit rather
than from the unmodified weight (the two agree when no row of the group has been updated).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qjax.algorithms import _checks
from qjax.core.calibration import compute_range
from qjax.core.formats import QFormat
from qjax.core.numerics import fake_round, scale_and_zero_point, scale_shape
from qjax.core.qarray import QArray, quantize

_HI = lax.Precision.HIGHEST  # TF32 on GPU would blur the error feedback


def hessian_update(h_DD: Optional[jax.Array], x_MD: jax.Array, count) -> tuple[jax.Array, object]:
  """Fold one batch of layer inputs into the running Hessian H = 2 X^T X / n.

  Memory stays O(D^2) however many batches are streamed; the running mean (rather than a
  running sum) keeps H at the scale of one token, so float32 does not overflow.

  Args:
    h_DD: the running Hessian, or None to start from zero.
    x_MD: this batch's inputs to the layer, shape (..., D); leading axes are tokens.
    count: tokens folded into `h_DD` so far (0 when `h_DD` is None).

  Returns:
    (h_DD, count) after this batch.
  """
  x = jnp.asarray(x_MD)
  if x.ndim < 1 or x.shape[-1] == 0:
    raise ValueError(f'hessian_update: x_MD has shape {x.shape}; expected (..., D) inputs.')
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  d, m = x.shape[1], x.shape[0]
  if m == 0:
    raise ValueError('hessian_update: got an empty batch (0 tokens); skip it instead.')
  _checks.check_finite(x, 'hessian_update: x_MD')
  if h_DD is None:
    h_DD, count = jnp.zeros((d, d), jnp.float32), 0
  if h_DD.shape != (d, d):
    raise ValueError(f'hessian_update: h_DD has shape {h_DD.shape} but the inputs have D={d}; '
                     'keep one Hessian per layer input.')
  total = count + m
  xtx = jnp.matmul(x.T, x, precision=_HI)
  return h_DD * (count / total) + xtx * (2.0 / total), total


def _upper_cholesky_of_inverse(h_PP: jax.Array, damp: float) -> jax.Array:
  """Upper U with H^-1 = U^T U; raises when the damped H is not positive definite."""
  what = (f'gptq_quantize: the damped Hessian (D={h_PP.shape[0]}, damp={damp}) is not '
          'positive definite, usually because the calibration set has fewer independent '
          'tokens than input channels; raise damp (e.g. 0.1) or calibrate on more tokens.')
  low = jnp.linalg.cholesky(h_PP)
  if not np.isfinite(np.asarray(low)).all():
    raise ValueError(what)
  eye = jnp.eye(h_PP.shape[0], dtype=h_PP.dtype)
  hinv = jax.scipy.linalg.cho_solve((low, True), eye)
  u = jnp.linalg.cholesky((hinv + hinv.T) / 2).T
  if not np.isfinite(np.asarray(u)).all():
    raise ValueError(what)
  return u


@functools.partial(jax.jit, static_argnames=('fmt', 'block_size', 'n_groups'))
def _sweep(w_PF, u_PP, gid_P, first_P, rows_of_group, *, fmt: QFormat, block_size: int,
           n_groups: int):
  """The jitted column sweep in permuted order; returns pre-rounding rows and group ranges."""
  p, f = w_PF.shape
  b = block_size
  range_fmt = fmt.replace(group_size=None)  # one group's rows, as a whole
  # Row n_groups of the range tables is a dummy for padding rows: range 0 -> scale 1, code 0.
  tabs0 = (jnp.zeros((n_groups + 1, f)), jnp.zeros((n_groups + 1, f)))

  def block(bi, carry):
    w, rec, (lo_t, hi_t) = carry
    i1 = bi * b
    w1 = lax.dynamic_slice(w, (i1, 0), (b, f))      # block-start values
    u_rows = lax.dynamic_slice(u_PP, (i1, 0), (b, p))
    u1 = lax.dynamic_slice(u_rows, (0, i1), (b, b))

    def row(j, c):
      err1, rec1, (lo_t, hi_t) = c
      pos = i1 + j
      wj = w1[j] - jnp.dot(u1[:, j], err1, precision=_HI)
      g = gid_P[pos]

      def set_range(tabs):
        idx = rows_of_group[jnp.minimum(g, n_groups - 1)]
        cur = w[idx] - jnp.dot(u_rows[:, idx].T, err1, precision=_HI)
        lo, hi = compute_range(cur, range_fmt)
        return (tabs[0].at[g].set(jnp.broadcast_to(lo, (1, f))[0]),
                tabs[1].at[g].set(jnp.broadcast_to(hi, (1, f))[0]))

      lo_t, hi_t = lax.cond(first_P[pos], set_range, lambda t: t, (lo_t, hi_t))
      scale, zp = scale_and_zero_point(lo_t[g], hi_t[g], fmt)
      err = (wj - fake_round(wj, scale, zp, fmt)) / u1[j, j]
      return err1.at[j].set(err), rec1.at[j].set(wj), (lo_t, hi_t)

    err1, rec1, tabs = lax.fori_loop(0, b, row, (jnp.zeros((b, f)), jnp.zeros((b, f)),
                                                 (lo_t, hi_t)))
    # Lazy update of every later row at once. Rows before the block see U's zeros (upper
    # triangular); the block's own rows are already recorded, so their stale update is moot.
    w = w - jnp.dot(u_rows.T, err1, precision=_HI)
    return w, lax.dynamic_update_slice(rec, rec1, (i1, 0)), tabs

  _, rec, (lo_t, hi_t) = lax.fori_loop(0, p // b, block, (w_PF, jnp.zeros_like(w_PF), tabs0))
  return rec, lo_t[:n_groups], hi_t[:n_groups]


def _group_tables(perm: np.ndarray, group: int, padded: int):
  """Group id, first-visit flag and member positions of every swept (permuted) row."""
  d = perm.size
  n = d // group
  inv = np.argsort(perm)
  members = inv.reshape(n, group)  # positions (in sweep order) of each group's rows
  gid = np.full(padded, n, np.int32)
  gid[:d] = perm // group
  first = np.zeros(padded, bool)
  first[members.min(axis=1)] = True
  return gid, first, members.astype(np.int32)


def gptq_quantize(w_DF: jax.Array, h_DD: jax.Array, fmt: QFormat, *, damp: float = 0.01,
                  block_size: int = 128, act_order: bool = False) -> QArray:
  """Quantize a weight with GPTQ's error feedback.

  Not jit-able as a whole (it checks the Cholesky factorisation eagerly); the sweep inside is
  jitted and runs as `lax.fori_loop`s over blocks and rows.

  Args:
    w_DF: weight of `y = x @ w`, D input channels by F output channels.
    h_DD: Hessian of the layer input from `hessian_update` (any positive multiple of X^T X
      gives the same result).
    fmt: integer weight format, e.g. `int_format(4, group_size=128, channel_axes=(1,))`;
      groups run along D, per-channel scales along F.
    damp: added to H's diagonal as a fraction of its mean diagonal (GPTQ's percdamp).
    block_size: rows per lazy-update block (speed only: the math does not depend on it,
      up to float rounding).
    act_order: sweep rows by decreasing H_jj (most active input first); groups stay the
      contiguous runs of the original order, see the module docstring.

  Returns:
    A QArray in the same layout as `qjax.core.quantize(w_DF, fmt)`. Input channels whose H_jj
    is 0 (never active) are quantized as zero weights.
  """
  _checks.check_2d(w_DF, 'gptq_quantize')
  _checks.check_int_weight_format(fmt, 'gptq_quantize')
  d, f = w_DF.shape
  if h_DD.shape != (d, d):
    raise ValueError(f'gptq_quantize: h_DD has shape {h_DD.shape} but w_DF has D={d} input '
                     f'channels; pass the Hessian of this layer input, shape ({d}, {d}).')
  if not damp >= 0:
    raise ValueError(f'gptq_quantize: damp={damp} must be >= 0 (a fraction of the mean '
                     'Hessian diagonal, typically 0.01).')
  if int(block_size) != block_size or block_size < 1:
    raise ValueError(f'gptq_quantize: block_size={block_size} must be a positive integer '
                     '(typically 128).')
  _checks.check_finite(w_DF, 'gptq_quantize: w_DF')
  _checks.check_finite(h_DD, 'gptq_quantize: h_DD')
  scale_shape(w_DF.shape, fmt)  # group_size must divide D: fail before the sweep

  w = jnp.asarray(w_DF, jnp.float32)
  h = jnp.asarray(h_DD, jnp.float32)
  diag = jnp.diagonal(h)
  dead = diag == 0
  # A never-active input channel carries no signal: pin its weight to 0 (which every format
  # represents exactly) and give H a unit diagonal there so it stays invertible.
  h = h + jnp.diag(dead.astype(h.dtype))
  w = jnp.where(dead[:, None], 0.0, w)
  h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(d, dtype=h.dtype)

  perm = np.argsort(-np.asarray(jnp.diagonal(h)), kind='stable') if act_order else np.arange(d)
  b = min(int(block_size), d)
  padded = -(-d // b) * b
  pad = padded - d
  # Padding rows: zero weight and a unit, uncoupled Hessian entry, so they carry no error.
  h_pp = jnp.pad(h[perm][:, perm], ((0, pad), (0, pad))) + jnp.diag(
      jnp.concatenate([jnp.zeros(d), jnp.ones(pad)]))
  u = _upper_cholesky_of_inverse(h_pp, damp)
  group = fmt.group_size or d
  gid, first, members = _group_tables(perm, group, padded)
  rec_p, lo, hi = _sweep(jnp.pad(w[perm], ((0, pad), (0, 0))), u, gid, first, members,
                         fmt=fmt, block_size=b, n_groups=d // group)

  # Re-quantize the recorded pre-rounding rows with the sweep's own ranges: the same codes the
  # sweep used, in the core's layout and packing.
  rec = rec_p[np.argsort(perm)]
  per_channel = bool(fmt.channel_axes)
  lo, hi = lo[:, :f if per_channel else 1], hi[:, :f if per_channel else 1]  # scale layout
  q = _quantize_with_range(rec, lo, hi, fmt)
  return q.with_dtype(w_DF.dtype)


@functools.partial(jax.jit, static_argnums=(3,))
def _quantize_with_range(w, lo, hi, fmt: QFormat) -> QArray:
  return quantize(w, fmt, calibration=(lo, hi))  # one compile, not a dozen eager ops
