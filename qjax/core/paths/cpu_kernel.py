"""Path 'kernel': the CPU kernel of `qjax.kernels` (jax.ffi), for decode shapes on XLA:CPU.

Fits: a CPU target with the kernel loaded; symmetric int8 or packed int4 codes, per channel or
grouped; weight (contracted..., kept...) or the tied head (V, D); at most
`decode_paths.MAX_KERNEL_ROWS` rows (any number when named); weight-only or int8 activations
(VNNI integer dots). A one-row weight-only int8 head is left to the V blocks, which measured
faster (docs/cpu_kernel.md), unless the path is named.
Runs: each 64-code slice widened in registers (or multiplied as int8 on integer dots), f32
accumulation, no float weight anywhere (`qjax.core.decode_paths.kernel_einsum`).
"""

from __future__ import annotations

from typing import Optional

from qjax import kernels
from qjax.core import decode_paths
from qjax.core.paths.call import Call

NAME = 'kernel'


def _act(call: Call) -> Optional[str]:
  return 'int8' if call.act == 'int' else None


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  if target.platform != 'cpu':
    return f'the target is {target.platform}; the kernel runs on the CPU'
  if not kernels.available():
    return f'the CPU kernel is {kernels.status()}'
  if call.act not in (None, 'int'):
    return 'fp8 activations have no CPU kernel'
  rows = 2**31 if asked else decode_paths.MAX_KERNEL_ROWS
  return decode_paths.kernel_refusal(call.xs, call.ws, call.out, call.x_shape, call.w, rows,
                                     _act(call), explicit=asked)


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The product on the kernel (`fits` said it runs)."""
  del target
  y = decode_paths.kernel_einsum(call.xs, call.ws, call.out, x, w, out_dtype,
                                 max_rows=2**31 if asked else decode_paths.MAX_KERNEL_ROWS,
                                 act=_act(call), explicit=asked)
  assert y is not None, call  # fits() and kernel_einsum share kernel_refusal
  return y
