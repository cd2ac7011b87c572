"""Path 'pallas_gpu': the Pallas kernel `qjax.kernels.pallas_qmm` (Triton on GPU), at decode.

Fits: weight-only; symmetric int8, packed int4 or native int4 codes (bitcast to the same
bytes); weight (contracted..., kept...) with groups that are runs of the flattened contraction;
at most `pallas_qmm.MAX_ROWS` rows. Not on a TPU, where 'pallas_tpu' is the Mosaic kernel.
Runs: blocks of codes widened in registers, one group per block of K rows with its scales
applied to the block's product, f32 accumulation (`qjax.core.pallas_path`); interpret mode on
a CPU target.
"""

from __future__ import annotations

from typing import Optional

from qjax.core import pallas_path
from qjax.core.paths.call import Call

NAME = 'pallas_gpu'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del asked
  if call.act is not None:
    return 'weight-only: the activations stay float'
  if target.platform == 'tpu':
    return "on a TPU the Mosaic kernel is 'pallas_tpu'"
  return pallas_path.refusal(call.xs, call.ws, call.out, call.x_shape, call.w)


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The product on the Triton kernel."""
  del target, asked
  return pallas_path.pallas_einsum(call.xs, call.ws, call.out, x, w, out_dtype)
