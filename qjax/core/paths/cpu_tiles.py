"""Path 'tiled': XLA:CPU row tiles of the weight (`qjax.core.tiled_path`).

Fits: a weight stored (contracted..., kept...) with groups along the last contracted axis
(`tiled_path.plan_tiles`); weight-only, int8 or fp8 activations.
Runs: a `fori_loop` over tiles of ~1M weights; each tile's codes unpacked by bit fields,
dequantized in cache (or scaled after the loop when scales are constant along K) and
multiplied on XLA:CPU's fused dot; the temporary is one tile, never a float weight.
"""

from __future__ import annotations

from typing import Optional

from qjax.core import tiled_path
from qjax.core.paths.call import Call

NAME = 'tiled'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del target, asked
  if tiled_path.plan_tiles(call.xs, call.ws, call.out, call.x_shape, call.w, call.act) is None:
    return (f'spec {call.spec} with scales {call.scale_shape} has no row tiles (batch axes, '
            'a weight not (contracted..., kept...), groups off the last contracted axis, or a '
            'scale per element)')
  return None


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The product as a loop over row tiles."""
  del target, asked
  return tiled_path.tiled_einsum(call.xs, call.ws, call.out, x, w, call.act, out_dtype)
