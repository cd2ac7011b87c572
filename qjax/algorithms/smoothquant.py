"""SmoothQuant integration: one migration scale per shared layer input, then W8A8.

The layers fed by one array share s (1/s is folded into its producer, see `apply.py`), so
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) is taken over their concatenated weights, as in
the paper for q/k/v and for gate/up. When s must also be constant over groups of rows
(`tie`: the query heads that share one kv head, when 1/s is folded into v_proj), the
activation and weight maxima are taken over each group first. Each layer then stores
`quantize(diag(s) w, fmt)` in the policy's format and multiplies with the policy's
activation format (int8 per token: W8A8 through `qeinsum`).
"""

from __future__ import annotations

from typing import Optional

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax.algorithms import _checks
from qjax.algorithms.calibrate import EinsumView
from qjax.algorithms.smoothquant_core import smooth_scales
from qjax.core import QArray, QFormat, quantize

OPTIONS = {'alpha': 0.5, 'fold_linear': True}


def check_options(opts: dict) -> None:
  _checks.check_alpha(opts['alpha'], 'smoothquant')


def stage_scales(amax_nat: jax.Array, weights_nat: list[jax.Array], alpha: float,
                 tie: Optional[np.ndarray] = None) -> jax.Array:
  """Shared smoothing scales of one layer input.

  Args:
    amax_nat: max |x| per natural row of the input (`calibrate.collect_stats`).
    weights_nat: the float weights it feeds, each as (rows, columns) in natural row order.
    alpha: migration strength in [0, 1].
    tie: optional group id per row; rows of a group get one scale (maxima over the group).

  Returns:
    s per natural row, positive.
  """
  w_rowmax = jnp.max(jnp.concatenate([jnp.abs(w) for w in weights_nat], axis=1), axis=1)
  if tie is None:
    return smooth_scales(amax_nat, w_rowmax[:, None], alpha)
  n = int(tie.max()) + 1
  a = jax.ops.segment_max(amax_nat, tie, num_segments=n)
  wm = jax.ops.segment_max(w_rowmax, tie, num_segments=n)
  return smooth_scales(a, wm[:, None], alpha)[jnp.asarray(tie)]


@functools.partial(jax.jit, static_argnums=(2, 3))
def quantize_scaled(w: jax.Array, s_nat: jax.Array, view: EinsumView, fmt: QFormat) -> QArray:
  """`quantize(diag(s) w, fmt)` for an Einsum weight (s over its contracted elements)."""
  return quantize(w.astype(jnp.float32) * s_nat.reshape(view.row_shape()), fmt)
