"""Path 'dequant': `einsum(x, dequantize(w))` in the activation dtype: the reference.

Fits: every weight and spec (weight-only numerics; quantized activations are not applied).
Runs: the weight dequantized to the activation dtype, then the float layers' own product
(`decode_paths.matrix_einsum`), so a fake-quantized model and its converted twin stay
bit-identical. Writes a float copy of the weight per call on XLA:CPU, so 'auto' takes it only
where no other path fits the call.
"""

from __future__ import annotations

from typing import Optional

from qjax.core import decode_paths
from qjax.core.paths.call import Call
from qjax.core.qarray import dequantize

NAME = 'dequant'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """Always None: the reference takes every call."""
  del call, target, asked
  return None


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The exact weight-only product."""
  del target, asked
  return decode_paths.matrix_einsum(call.spec, x, dequantize(w, x.dtype)).astype(out_dtype)
