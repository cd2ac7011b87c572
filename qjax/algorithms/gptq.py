"""GPTQ integration: one Einsum weight, its streamed input Hessian -> the policy's QArray.

The math is `gptq_core.gptq_quantize` on the weight's `w_DF` view (`calibrate.EinsumView`):
rows are ordered so that each of the policy's scale groups is contiguous, the Hessian is
permuted the same way, and the result is laid back out as the QArray `quantize_model` would
store (same format, shapes and packing), so the model runs it through `qeinsum` unchanged.
`apply.apply_method` walks the model and calls `quantize_layer` stage by stage.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qjax.algorithms.awq_core import output_error
from qjax.algorithms.calibrate import EinsumView
from qjax.algorithms.gptq_core import gptq_quantize
from qjax.core import QArray, QFormat, dequantize, quantize

OPTIONS = {'damp': 0.01, 'block_size': 128, 'act_order': False}


def check_options(opts: dict) -> None:
  """Fail early on GPTQ options that `gptq_quantize` would reject mid-model."""
  if not float(opts['damp']) >= 0:
    raise ValueError(f"gptq: damp={opts['damp']} must be >= 0 (fraction of the mean Hessian "
                     'diagonal added to it; 0.01 is the paper\'s default).')
  if int(opts['block_size']) != opts['block_size'] or opts['block_size'] < 1:
    raise ValueError(f"gptq: block_size={opts['block_size']} must be a positive integer "
                     '(rows per lazy-update block, typically 128).')


def quantize_layer(w: jax.Array, view: EinsumView, fmt: QFormat, h_nat: jax.Array, *,
                   damp: float, block_size: int, act_order: bool) -> tuple[QArray, dict]:
  """GPTQ-quantize one Einsum weight.

  Args:
    w: the float weight, `view.shape`.
    view: its w_DF view, built with `fmt` (so groups are contiguous rows).
    fmt: the QArray format `quantize_model` resolved for the layer.
    h_nat: input Hessian 2 X^T X / n in natural row order (`calibrate.collect_stats`).
    damp: dampening, fraction of the mean diagonal.
    block_size: rows per lazy-update block.
    act_order: sweep rows by decreasing H_jj.

  Returns:
    (QArray in the layout of `quantize(w, fmt)`, {'output_error', 'rtn_output_error'}: the
    mean squared output error per token, 1/2 tr(dW^T H dW), of GPTQ and of RTN).
  """
  w2, h2 = _views(jnp.asarray(w, jnp.float32), h_nat, view)
  fmt2 = view.fmt2(fmt)
  q2 = gptq_quantize(w2, h2, fmt2, damp=damp, block_size=block_size, act_order=act_order)
  q, err, rtn = finish(w2, h2, q2, view, fmt)
  q = q.with_dtype(w.dtype)
  return q, {'output_error': float(err), 'rtn_output_error': float(rtn)}


@functools.partial(jax.jit, static_argnums=(2,))
def _views(w, h_nat, view: EinsumView):
  p = view.row_perm
  return view.to_2d(w), h_nat[p][:, p]


@functools.partial(jax.jit, static_argnums=(3, 4))
def finish(w2, h2, q2: QArray, view: EinsumView, fmt: QFormat):
  """(q2 in the layer's QArray layout, its output error, RTN's output error), compiled once."""
  err = output_error(w2 - dequantize(q2, jnp.float32), h2)
  rtn = output_error(w2 - dequantize(quantize(w2, view.fmt2(fmt)), jnp.float32), h2)
  return view.to_qarray(q2, fmt), err, rtn
