"""Path 'pallas_gpu': the Pallas kernels `qjax.kernels.pallas_qmm` and `gpu_qmm_head` (Triton).

Fits: weight-only; symmetric int8, packed int4 or native int4 codes (bitcast to the same
bytes); weight (contracted..., kept...) with groups that are runs of the flattened contraction
(`qjax.kernels.pallas_qmm`) at any number of rows, or the tied head (V, D) with groups along D
(`qjax.kernels.gpu_qmm_head`) at most 64 rows. Not on a TPU, where 'pallas_tpu' is the
Mosaic kernel.
Runs: blocks of codes widened in registers, each block of K inside one group with its scales
applied to the block's product, f32 accumulation, the output written once in its dtype
(`qjax.core.pallas_path`); interpret mode on a CPU target.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from qjax.core import pallas_path
from qjax.core.paths.call import Call
from qjax.kernels import gpu_qmm_head

NAME = 'pallas_gpu'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del asked
  if call.act is not None:
    return 'weight-only: the activations stay float'
  if target.platform == 'tpu':
    return "on a TPU the Mosaic kernel is 'pallas_tpu'"
  if call.form == 'nk':
    return _head_refusal(call)
  return pallas_path.refusal(call.xs, call.ws, call.out, call.x_shape, call.w)


def _head_refusal(call: Call) -> Optional[str]:
  qt = call.qtype
  if qt.is_float or call.zero_point or qt.bits not in (4, 8):
    return f'{qt.name} codes{" with zero points" if call.zero_point else ""}: the head kernel ' \
           'takes symmetric int8 / int4'
  if qt.bits == 4 and call.w_shape[1] % 2:
    return 'an odd contraction leaves a padding nibble in each row'
  if call.group is None:
    return f'scales {call.scale_shape} are not groups along D'
  return gpu_qmm_head.refusal(call.rows, call.n, call.k, call.group, qt.bits)


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The product on the Triton kernel."""
  del target, asked
  if call.form != 'nk':
    return pallas_path.pallas_einsum(call.xs, call.ws, call.out, x, w, out_dtype)
  xs, ws, out = call.xs, call.ws, call.out
  v, d = call.w_shape
  x_only = tuple(c for c in xs if c != ws[1])
  x2 = x.transpose([xs.index(c) for c in x_only + (ws[1],)]).reshape(call.rows, d)
  data = w.data
  if call.qtype.native_int4:  # XLA's s4 bytes are qjax's packing (`pallas_path`)
    data = lax.bitcast_convert_type(data.reshape(v, d // 2, 2), jnp.uint8)
  scale = jnp.broadcast_to(w.scale, (v, w.scale.shape[1]))
  y2 = gpu_qmm_head.qmm_nk(x2, data, scale, bits=call.qtype.bits,
                           out_dtype=pallas_path.kernel_out_dtype(out_dtype))
  y = y2.reshape(tuple(x.shape[xs.index(c)] for c in x_only) + (v,))
  letters = ''.join(x_only) + ws[0]
  return y.transpose([letters.index(c) for c in out]).astype(out_dtype)
