"""AWQ integration: one scale per input channel, searched for all the Einsums that share it.

Layers fed by the same array (q/k/v after `pre_attn_norm`, gate/up after `pre_mlp_norm`)
must share one scale vector s, because 1/s is folded into that array's producer. So alpha is
chosen on the *sum* of the layers' output errors (`awq_core`'s proxy 1/2 tr(dW^T H dW) on
each weight's w_DF view), then each layer gets `awq_search` at that alpha (with its optional
clip search) and is laid back out as the QArray `quantize_model` would store. Folding 1/s
(norm weight, previous linear, or an explicit multiply) is `apply.py`'s job.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax.algorithms import _checks
from qjax.algorithms.awq_core import _alpha_errors, awq_scales, awq_search
from qjax.algorithms.gptq import finish
from qjax.algorithms.calibrate import EinsumView
from qjax.core import QArray, QFormat

OPTIONS = {'alpha_grid': 20, 'alpha': None, 'clip_search': True, 'clip_grid': 20,
           'max_shrink': 0.5, 'fold_linear': True}


def alpha_grid(opts: dict) -> np.ndarray:
  """The alphas searched: `alpha` alone, n evenly spaced in [0, 1], or an explicit list."""
  if opts['alpha'] is not None:
    _checks.check_alpha(opts['alpha'], 'awq')
    return np.asarray([opts['alpha']], np.float32)
  g = opts['alpha_grid']
  if isinstance(g, (int, np.integer)):
    if g < 1:
      raise ValueError(f'awq: alpha_grid={g} must be >= 1 (number of alphas in [0, 1]).')
    return np.linspace(0.0, 1.0, int(g), dtype=np.float32)
  grid = np.asarray(g, np.float32).reshape(-1)
  if grid.size == 0:
    raise ValueError('awq: alpha_grid is empty; give a count (e.g. 20) or alphas in [0, 1].')
  for a in grid:
    _checks.check_alpha(float(a), 'awq: alpha_grid')
  return grid


def check_options(opts: dict) -> None:
  alpha_grid(opts)
  if opts['clip_grid'] < 1 or not 0.0 <= opts['max_shrink'] < 1.0:
    raise ValueError(f"awq: clip_grid={opts['clip_grid']} must be >= 1 and max_shrink="
                     f"{opts['max_shrink']} in [0, 1).")


def search_stage(layers: list[tuple[jax.Array, EinsumView, QFormat]], act_nat: jax.Array,
                 h_nat: jax.Array, opts: dict) -> tuple[jax.Array, list[QArray], dict]:
  """Search one shared scale for Einsums fed by the same input, and quantize them.

  Args:
    layers: (float weight, its view built with the format, the policy's format) per layer.
    act_nat: mean |x| of the shared input, natural rows (tie it first if the scale must be
      constant over some rows, e.g. query heads sharing a kv head).
    h_nat: its Hessian 2 X^T X / n, natural rows.
    opts: AWQ options (`OPTIONS`).

  Returns:
    (s_nat: the scales, natural rows; the QArrays of diag(s) w, one per layer;
     record facts: alpha, grid, summed errors per alpha, output error vs RTN).
  """
  grid = alpha_grid(opts)
  total = jnp.zeros(grid.size)
  prepared = []
  for w, view, fmt in layers:
    w2, a2, h2 = _views(jnp.asarray(w, jnp.float32), act_nat, h_nat, view)
    fmt2 = view.fmt2(fmt)
    _checks.check_int_weight_format(fmt2, f'awq ({view.spec})')
    total = total + _alpha_errors(w2, a2, h2, jnp.asarray(grid), fmt=fmt2)
    prepared.append((w, view, fmt, w2, a2, h2, fmt2))
  i = int(jnp.argmin(total))
  alpha = float(grid[i])
  qs, err, rtn = [], 0.0, 0.0
  for w, view, fmt, w2, a2, h2, fmt2 in prepared:
    r = awq_search(w2, a2, h2, fmt2, alpha=alpha, clip_search=bool(opts['clip_search']),
                   clip_grid=int(opts['clip_grid']), max_shrink=float(opts['max_shrink']))
    q, _, e_rtn = finish(w2, h2, r.qweight, view, fmt)
    qs.append(q.with_dtype(w.dtype))
    err += r.error
    rtn += float(e_rtn)
  s_nat = awq_scales(act_nat, alpha)
  return s_nat, qs, {'alpha': alpha, 'grid_errors': [float(e) for e in total],
                     'output_error': err, 'rtn_output_error': rtn,
                     'scale_range': [float(jnp.min(s_nat)), float(jnp.max(s_nat))]}


@functools.partial(jax.jit, static_argnums=(3,))
def _views(w, act_nat, h_nat, view: EinsumView):
  p = view.row_perm
  return view.to_2d(w), act_nat[p], h_nat[p][:, p]
