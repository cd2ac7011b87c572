"""Path 'vblocks': the tied head (weight (V, D), 'BTD,VD->BTV') as blocks of V rows.

Fits: the head layout, more than one block of V rows; weight-only or int8 activations.
Runs: a `fori_loop` over blocks of ~2**19 weights (2**20 at prefill), each dequantized by bit
fields and multiplied, written in place into the (M, V) logits
(`qjax.core.decode_paths.vblocked_einsum`): the temporary is one block, never the float head.
"""

from __future__ import annotations

from typing import Optional

from qjax.core import decode_paths
from qjax.core.paths.call import Call

NAME = 'vblocks'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del target, asked
  if call.act not in (None, 'int'):
    return 'fp8 activations have no V-block form'
  return decode_paths.vblocks_refusal(call.xs, call.ws, call.out, call.x_shape, call.w)


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The head in V blocks."""
  del target, asked
  return decode_paths.vblocked_einsum(call.xs, call.ws, call.out, x, w, out_dtype,
                                      act='int8' if call.act == 'int' else None)
