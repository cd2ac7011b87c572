"""Quantized matmul: `qeinsum(spec, x, w)` with a QArray weight, dispatched through one chooser.

`qeinsum` validates the call, asks `qjax.core.paths.choose` which implementation runs it (a
pure function of the call's shapes and formats and of the target, `qjax.target`: the devices
the program is compiled for), and runs that path's module. The table, the path modules and
what each fits are in `qjax.core.paths`; docs/quantized_matmul.md gives the reasons and the
compilers' byte counts per target.

`path=` names what to run (tokamax's `implementation=` contract: 'auto' picks, a name runs
or says why not):

* `'auto'`: the target's row of `paths.AUTO`. CPU: the CPU kernel at decode shapes (<= 16 rows,
  when built), XLA:CPU row tiles, the tied head in V blocks, the dequantized reference where
  none fits. TPU: the Mosaic kernel (`pallas_tpu`: group scales after each group's partial
  sum, no float weight), else XLA's native narrow-dtype dot. NVIDIA: the native dot for
  per-channel codes; grouped codes take the Triton kernel at decode rows first. Quantized
  activations (`act_fmt`): the CPU kernel's integer dots, row tiles or V blocks on CPU, one
  XLA int8 x int8 -> int32 (fp8 x fp8 -> f32) dot elsewhere.
* `'dequant'`: `einsum(x, dequantize(w))` in the activation dtype: exact weight-only
  semantics (a float copy of the weight per call on XLA:CPU, so never its default).
* `'tiled'`: XLA:CPU row tiles (`qjax.core.tiled_path`), the head in V blocks, else 'dequant'.
  Tiles hold ~1M weights, whole groups; bf16 x bf16 -> f32 tile dots at M >= 2 rows where the
  CPU has bf16 dot instructions, f32 otherwise (`tiled_path.tile_dtype`); error vs the exact
  product: bf16 rounding of x and of the tile (~52 dB) or summation order only.
* `'int8'`: activations quantized on the fly to int8, symmetric, one scale per token and per
  weight group, multiplied with the integer codes with an exact integer accumulator, then
  rescaled (and zero-point corrected) in f32: W8A8 when `act_fmt=int8`. On CPU the same
  numerics run on the kernel's VNNI dots (decode) or in tiles whose partial sums stay below
  2**24 (bit-exact with `dot_general(int8, int8, preferred_element_type=int32)`). Scales that
  vary along the contraction other than by groups take 'dequant' (the exact product).
* `'fp8'`: activations quantized per token to the weight's fp8 kind, fp8 x fp8 products with
  f32 accumulation.
* `'native'`: the codes as stored (`jnp.int4` / int8 / fp8, `qjax.core.layouts`) fed to
  `dot_general` (`qjax.core.native_path`); packed codes are unpacked first. Weight-only.
* `'pallas'`: the Pallas kernel of the target (`'pallas_tpu'` on TPU, `'pallas_gpu'` elsewhere,
  interpret mode on CPU) where it fits, else the target's weight-only 'auto' path without
  the CPU kernel. `'pallas_tpu'` / `'pallas_gpu'` name one kernel and raise where it cannot run.
* `'kernel'`: the CPU kernel (`qjax.core.decode_paths`) at any number of rows; raises where it
  cannot run.

Why these paths on XLA:CPU (measured in docs/fast_decode.md and docs/cpu_kernel.md): XLA:CPU
neither fuses an int->float convert into a dot nor keeps a one-row dot from widening its
weight, so a dequantize-then-dot writes a float weight per call; tiles keep the float tile in
cache, and the kernel reads the codes once. On TPU and GPU XLA fuses the convert of
per-channel narrow codes into the dot, but applies group scales before the reduce (TPU) or
writes the dequantized weight (GPU without the subchannel fusion), which the kernels avoid.
"""

from __future__ import annotations

import string
from typing import Optional, Union

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.core import decode_paths
from qjax.core import layouts
from qjax.core import paths
from qjax.core.formats import QFormat
from qjax.core.qarray import QArray, QType
from qjax.core.tiled_path import parse_spec  # re-exported: the project's one spec parser

PATHS = paths.REQUESTS
INT8_ACT = QFormat(bits=8)
WEIGHT_ONLY_PATHS = paths.WEIGHT_ONLY_REQUESTS  # paths that would ignore an activation format


def choose_path(w_fmt: Union[QFormat, QType], act_fmt: Optional[QFormat] = None,
                backend: Optional[str] = None, layout: Optional[str] = None) -> str:
  """The path family `path='auto'` takes for this weight format (or code type, `q.qtype`)
  and activation format before shapes are known (`paths.family`): 'int8' / 'fp8' with
  quantized activations, 'tiled' on CPU, 'native' or 'dequant' (hand-packed codes) elsewhere.
  The implementation each call runs is `paths.choose`'s (`paths.describe` for a layer).

  Args:
    w_fmt: a QFormat (taken in `layout`) or a QType.
    act_fmt: the activation format, or None.
    backend: 'cpu', 'gpu' or 'tpu' (default: the target's, `qjax.target`).
    layout: the QFormat's storage layout (default: the backend's, `layouts.default_layout`).

  Raises:
    ValueError: integer weights with fp8 activations or the reverse.
  """
  if act_fmt is not None and w_fmt.is_float != act_fmt.is_float:
    raise ValueError(f'qeinsum: weights {w_fmt.name} and activations {act_fmt.name} mix '
                     'integer and float codes; use both int or both fp8.')
  target = qjax_target.current()
  if backend is not None and backend != target.backend:
    target = qjax_target.Target('nvidia' if backend == 'gpu' else backend, backend)
  if isinstance(w_fmt, QType):
    qt = w_fmt
  else:
    qt = QType(w_fmt.kind, w_fmt.bits, layout or layouts.default_layout(target.backend))
  return paths.family(qt, act_fmt, target)


def _act_kind(path: str, act_fmt: Optional[QFormat], qt: QType) -> Optional[str]:
  """None (weight-only), 'int' or the weight's fp8 kind, as the request implies."""
  if path in ('int8', 'fp8'):
    return 'int' if path == 'int8' else qt.kind
  if act_fmt is None or path != 'auto':
    return None
  return qt.kind if act_fmt.is_float else 'int'


def qeinsum(spec: str, x: jax.Array, w: Union[jax.Array, QArray], *,
            act_fmt: Optional[QFormat] = None, path: str = 'auto',
            out_dtype=None) -> jax.Array:
  """Einsum of float activations with a (possibly quantized) weight.

  Args:
    spec: two-operand einsum with explicit output, activations first, e.g. 'BTD,DNH->BTNH'.
    x: float activations.
    w: weight, a float array (plain einsum) or a QArray.
    act_fmt: activation format for W8A8 / fp8 x fp8 (only its kind matters: activations are
      always quantized dynamically, symmetric, per token and weight group), or None for
      weight-only.
    path: 'auto' or a name in `PATHS` (see the module docstring and `qjax.core.paths`).
    out_dtype: result dtype (default: x's dtype).

  Returns:
    The einsum result, `out_dtype`.

  Raises:
    ValueError: integer activations (or a non-float plain weight), an unknown path, a spec
      that does not fit the operands, or a path that cannot multiply this weight.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    # An integer x would make the einsum integer and truncate the result to x's dtype.
    raise ValueError(f'qeinsum: activations x have dtype {x.dtype}, not a float dtype; cast '
                     'them first (x.astype(jnp.float32)). Integer inputs belong to '
                     "act_fmt=int_format(8) / path='int8', which quantizes float activations.")
  out_dtype = out_dtype or x.dtype
  if not isinstance(w, QArray):
    if not jnp.issubdtype(w.dtype, jnp.floating):
      raise ValueError(f'qeinsum: a plain weight of dtype {w.dtype} is not float; quantize it '
                       '(qjax.quantize) or cast it to a float dtype.')
    return decode_paths.matrix_einsum(spec, x, w.astype(x.dtype)).astype(out_dtype)
  if path not in PATHS:
    raise ValueError(f'qeinsum: path={path!r} is unknown; use one of {PATHS}.')
  xs, ws, out = parse_spec(spec)
  if len(ws) != w.ndim or len(xs) != x.ndim:
    raise ValueError(f'qeinsum: spec {spec!r} has operands of rank {len(xs)} and {len(ws)} but '
                     f'got x{tuple(x.shape)} and w{w.shape}.')
  qt = w.qtype
  if act_fmt is not None:
    if path in WEIGHT_ONLY_PATHS:
      raise ValueError(f'qeinsum: path={path!r} is weight-only, but act_fmt={act_fmt.name} asks '
                       f"for quantized activations; use path='auto' (or "
                       f"'{'fp8' if act_fmt.is_float else 'int8'}'), or drop act_fmt.")
    if path == 'auto':
      choose_path(qt, act_fmt)  # integer weights with fp8 activations (or the reverse) raise
  target = qjax_target.current()
  call = paths.Call.of((xs, ws, out), x, w, _act_kind(path, act_fmt, qt))
  choice = paths.choose(call, path, target)
  return paths.run(choice, call, x, w, out_dtype, target)


def qdot(x: jax.Array, w: Union[jax.Array, QArray], **kw) -> jax.Array:
  """`x @ w` for a 2-d weight (contracting x's last axis with w's first), via `qeinsum`."""
  if len(w.shape) != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f'qdot: x{tuple(x.shape)} @ w{tuple(w.shape)}: w must be 2-d (K, N) with '
                     "K equal to x's last axis; transpose or reshape one of them.")
  letters = string.ascii_lowercase[:x.ndim - 1]
  return qeinsum(f'{letters}y,yz->{letters}z', x, w, **kw)
