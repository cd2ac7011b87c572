"""Path 'native': the codes as XLA's own narrow dtypes fed to `dot_general`
(`qjax.core.native_path`).

Fits: weight-only calls; in 'auto', codes XLA reads as stored (the native layout, and 5-8-bit /
fp8 codes in either layout); named, packed codes too (unpacked first).
Runs: per-channel scales after the dot on `x . convert(codes)`; grouped scales as
`convert(codes) * broadcast(scale)` before it (the HLO XLA:GPU's subchannel dequantisation
fusion matches). XLA fuses the convert into the matmul's operand load on GPU and TPU; where it
does not (grouped codes on TPU, grouped codes on GPU without the fusion flag) it writes or
re-reads a float weight: docs/quantized_matmul.md has the compilers' numbers.
"""

from __future__ import annotations

from typing import Optional

from qjax.core import native_path
from qjax.core.paths.call import Call

NAME = 'native'


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del target
  if call.act is not None:
    return 'weight-only: the activations stay float'
  if call.qtype.packed and not asked:
    return (f'{call.qtype.bits}-bit codes stored packed: unpacking them is what the native '
            'layout avoids')
  return None


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """`x . dequantize(w)` on native codes."""
  del target, asked
  return native_path.native_einsum(call.xs, call.ws, call.out, x, w, out_dtype)
