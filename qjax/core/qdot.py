"""Quantized matmul: `qeinsum(spec, x, w)` with a QArray weight.

Compute paths (`path=`):

* `'dequant'`: `einsum(x, dequantize(w))` in the activation dtype. Exact weight-only
  semantics. On GPU/TPU XLA fuses the int->float convert into the matmul's operand load, so
  no float weight is materialised there; on XLA:CPU it is (a full f32 copy of the weight per
  call), so it is never the CPU default.
* `'tiled'` (CPU): weight-only semantics computed as a `fori_loop` over row tiles of the
  weight (its contracted axes, ~1M elements and at most 1/8 of the weight per tile, whole
  groups). Each tile's codes are unpacked as separate bit fields (`packing.unpack_fields`,
  no interleaving), dequantized (or, when scales are constant along the contraction, left as
  codes and scaled once after the loop), and multiplied by the matching activation columns:
  bf16 x bf16 with f32 accumulation for M >= 2 rows (XLA:CPU's fused kernel) on CPUs with bf16
  dot instructions (AVX-512 BF16, AMX), f32 elsewhere and at M = 1 (`tiled_path.tile_dtype`:
  without them XLA widens bf16 in software, which is slower than f32 tiles; the measurements
  are in docs/fast_decode.md). The float tile lives in cache; temp memory is
  one tile, never a float copy of the weight. Error vs the exact dequantized product: with
  bf16 tiles, bf16 rounding of x and of the tile (~52 dB SQNR); with f32 tiles, summation
  order only.
* `'int8'`: activations quantized on the fly to int8, symmetric, one scale per token and per
  weight group (per token when ungrouped; the same idea as llama.cpp's Q8 activation blocks),
  multiplied with the integer codes with an exact integer accumulator, then rescaled (and
  zero-point corrected) in f32. This is W8A8 when `act_fmt=int8` is requested. On CPU it
  runs tiled as above: int8 values are exact in bf16 (and f32), so a tile dot is an
  exact integer dot as long as |partial sum| < 2**24; tiles are at most 2**24 / (127 * max
  |code|) rows (1032 for int8 codes) and partial sums are carried in int32, so the result
  equals `dot_general(int8, int8, preferred_element_type=int32)` bit for bit. Grouped
  weights take one group per tile and apply that group's scales to its partial sum.
  Decode shapes (M <= 16 rows) on CPU run the same numerics on the optional kernel's VNNI
  integer dots when it is built (`decode_paths.kernel_einsum(act='int8')`; 4-8 codes per
  instruction instead of widening each to f32). Elsewhere it is that `dot_general` on the
  whole operands.
* `'fp8'`: activations quantized per token to the weight's fp8 kind, fp8 x fp8 products with
  f32 accumulation (tiled on CPU: fp8 values are exact in bf16).

* `'native'` (GPU/TPU default for native-layout weights): the codes as stored (`jnp.int4` /
  int8 / fp8, `qjax.core.layouts`) fed to `dot_general`, converted inside the matmul by XLA;
  per-channel scales applied to the result, grouped ones as a fused dequantize
  (`qjax.core.native_path`). Weight-only semantics.
* `'pallas'` (opt-in): a Pallas kernel for 2-D-able symmetric int8 / packed int4 weights at
  decode shapes (M <= 64 rows; the rest take the weight-only 'auto' path) with the dequantize
  inside the kernel (`qjax.core.pallas_path`, `qjax.kernels.pallas_qmm`); interpret mode
  on CPU. Not a default until
  measured on a device (docs/quantized_matmul.md).

* `'kernel'` (CPU, optional): the jax.ffi kernel of `qjax.kernels` (int8 / packed int4,
  symmetric; `qjax.core.decode_paths`): weight-only semantics, f32 accumulation, each 64-code
  slice widened in registers, no float weight anywhere. Raises where it cannot run.

`path='auto'` picks: the activation format's path if one is given (`'int8'` / `'fp8'`);
otherwise `'tiled'` on CPU for every weight format and, elsewhere, `'native'` for weights
whose codes XLA reads as they are (native layout, and 5-8-bit / fp8 codes in either layout)
and `'dequant'` for hand-packed 2/3/4-bit codes. The choice is a
function of (format, backend) only, so it is recorded in conversion records via
`choose_path`. Within `'tiled'` on CPU, `auto` runs decode shapes (M <= 16 rows) on the
kernel when `qjax.kernels.available()` (same weight-only numerics, summation order aside),
and the tied-head layout ('BTD,VD->BTV', weight (V, D)), which row tiles cannot express, as
blocks of V rows (`decode_paths.vblocked_einsum`) instead of a dequantized 671 MB head.

Why, on XLA:CPU (the measurements, by benchmarks/qdot_bench.py, are in docs/fast_decode.md):

* XLA:CPU's fused dot kernel (YNNPACK) re-packs its weight operand every call, and does not
  fuse an int->float convert into the dot, so "dequantize then dot" writes a full float copy.
  A plain int8 x int8 -> int32 dot reads the codes directly but gains little, and a grouped
  one needs the group as a batch dimension, which XLA:CPU runs slowly. Interleaving unpacked
  4-bit codes back into one array costs more than the matrix-vector product it feeds.
* Tiling keeps the dequantized tile in cache and gives each tile dot a small weight to pack,
  so weight-only and W8A8 tiles run near or below f32 time without a float weight copy.
* Specs the tiled forms cannot express (batch axes shared by x, w and out; weight axes not
  ordered contracted-then-kept, other than the head layout; groups not on the last contracted
  axis; a scale per weight element) fall back to the whole-operand implementations
  ('dequant' for 'tiled').
* Decode shapes (docs/fast_decode.md has the measurements): XLA offers no fused
  int->float dot, so M <= 16 rows go to the kernel, which reads the codes once.
"""

from __future__ import annotations

import string
from typing import Optional, Union

import jax
import jax.numpy as jnp

from qjax import kernels
from qjax import target as qjax_target
from qjax.core import decode_paths
from qjax.core import layouts
from qjax.core import native_path
from qjax.core import pallas_path
from qjax.core import tiled_path as tiled
from qjax.core.formats import QFormat
from qjax.core.qarray import QArray, QType, dequantize
from qjax.core.tiled_path import parse_spec  # re-exported: the project's one spec parser

PATHS = ('auto', 'dequant', 'tiled', 'kernel', 'int8', 'fp8', 'native', 'pallas')
INT8_ACT = QFormat(bits=8)
WEIGHT_ONLY_PATHS = ('native', 'pallas')  # paths that would ignore an activation format


def choose_path(w_fmt: Union[QFormat, QType], act_fmt: Optional[QFormat] = None,
                backend: Optional[str] = None, layout: Optional[str] = None) -> str:
  """The compute path `path='auto'` takes for this weight format (or code type, `q.qtype`),
  activation format and backend (default: the target's, `qjax.target`); a QFormat is taken
  in `layout` (default: the backend's, `layouts.default_layout`)."""
  backend = backend or qjax_target.current().backend
  if act_fmt is not None:
    if w_fmt.is_float != act_fmt.is_float:
      raise ValueError(f'qeinsum: weights {w_fmt.name} and activations {act_fmt.name} mix '
                       'integer and float codes; use both int or both fp8.')
    return 'fp8' if act_fmt.is_float else 'int8'
  if backend == 'cpu':
    return 'tiled'
  if isinstance(w_fmt, QType):
    layout = w_fmt.layout
  qt = QType(w_fmt.kind, w_fmt.bits, layout or layouts.default_layout(backend))
  return 'dequant' if qt.packed else 'native'


def _fresh_letter(used: str) -> str:
  return next(c for c in string.ascii_letters if c not in used)


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
    path: 'auto', 'dequant', 'tiled', 'kernel', 'int8', 'fp8', 'native' or 'pallas' (see the
      module docstring).
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
  auto = path == 'auto'
  if auto:
    path = choose_path(qt, act_fmt)
  if path == 'kernel':
    y = decode_paths.kernel_einsum(xs, ws, out, x, w, out_dtype, max_rows=2**31, explicit=True)
    if y is None:
      raise ValueError(f"qeinsum: path='kernel' cannot run {spec!r} with {w.layout_name}: the "
                       f'CPU kernel is {kernels.status()} (target: {qjax_target.platform()}), '
                       'and it takes symmetric int8 / int4 '
                       "weights in the (contracted..., kept...) or (V, D) head layout; use "
                       "path='auto'.")
    return y
  if path in WEIGHT_ONLY_PATHS and act_fmt is not None:
    raise ValueError(f'qeinsum: path={path!r} is weight-only, but act_fmt={act_fmt.name} asks '
                     f"for quantized activations; use path='auto' (or "
                     f"'{'fp8' if act_fmt.is_float else 'int8'}'), or drop act_fmt.")
  if path == 'native':
    return native_path.native_einsum(xs, ws, out, x, w, out_dtype)
  if path == 'pallas':
    if pallas_path.fits(xs, ws, out, x, w):
      return pallas_path.pallas_einsum(xs, ws, out, x, w, out_dtype)
    path = choose_path(qt)  # prefill rows, or a weight the kernel does not take
    if path == 'native':
      return native_path.native_einsum(xs, ws, out, x, w, out_dtype)
  if path == 'tiled':
    if auto and qjax_target.on_cpu():
      y = decode_paths.kernel_einsum(xs, ws, out, x, w, out_dtype)  # decode shapes
      if y is not None:
        return y
    y = tiled.tiled_einsum(xs, ws, out, x, w, None, out_dtype)
    if y is None:
      y = decode_paths.vblocked_einsum(xs, ws, out, x, w, out_dtype)
    if y is not None:
      return y
    path = 'dequant'  # a spec neither tiled form can express
  if path == 'dequant':
    # The float layers' own product (nn.layers.Einsum): a fake-quantized model and its
    # converted twin stay bit-identical.
    return decode_paths.matrix_einsum(spec, x, dequantize(w, x.dtype)).astype(out_dtype)
  if path == 'int8' and qt.is_float or path == 'fp8' and not qt.is_float:
    raise ValueError(f'qeinsum: path={path!r} cannot multiply {qt.name} weights; use '
                     f"path='{'fp8' if qt.is_float else 'int8'}' or 'dequant'.")
  if qjax_target.on_cpu():
    if path == 'int8':  # decode shapes: the same numerics on the kernel's integer dots
      y = decode_paths.kernel_einsum(xs, ws, out, x, w, out_dtype, act='int8')
      if y is not None:
        return y
    y = tiled.tiled_einsum(xs, ws, out, x, w, 'int' if path == 'int8' else qt.kind, out_dtype)
    if y is not None:
      return y
    if path == 'int8':  # the head at prefill (the layout row tiles cannot express)
      y = decode_paths.vblocked_einsum(xs, ws, out, x, w, out_dtype, act='int8')
      if y is not None:
        return y
  return _integer_like_einsum(xs, ws, out, x, w, path, out_dtype)


def _integer_like_einsum(xs, ws, out, x, w: QArray, path, out_dtype):
  """'int8' / 'fp8' as one dot on the whole operands (non-CPU, and specs tiling can't express)."""
  contracted = [c for c in ws if c in xs and c not in out]
  tiles, sshape = w.tile_shape, w.scale.shape
  along_k = [i for i, c in enumerate(ws) if c in contracted and sshape[i] > 1]
  cut_kept = [i for i, c in enumerate(ws) if c not in contracted and 1 < tiles[i] < w.shape[i]]
  if len(along_k) > 1 or cut_kept or (along_k and tiles[along_k[0]] == 1):
    # A scale that varies along a contracted axis other than by groups cannot be applied
    # after the dot; take the exact dequantize path rather than a wrong answer.
    return jnp.einsum(f'{xs},{ws}->{out}', x, dequantize(w, x.dtype)).astype(out_dtype)
  codes, s_letters = w.codes(), ws
  if along_k:  # groups along one contracted axis: the group index becomes a batch axis
    ga = along_k[0]
    gl, ng, gs = ws[ga], sshape[ga], tiles[ga]
    g = _fresh_letter(xs + ws + out)
    wv, s_letters = ws[:ga] + g + ws[ga:], ws[:ga] + g + ws[ga + 1:]
    codes = codes.reshape(w.shape[:ga] + (ng, gs) + w.shape[ga + 1:])
    xi = xs.index(gl)
    xv = xs[:xi] + g + xs[xi:]
    x = x.reshape(x.shape[:xi] + (ng, gs) + x.shape[xi + 1:])
    acc_l = out + g
  else:
    wv, xv, acc_l = ws, xs, out
  squeeze = tuple(i for i, d in enumerate(sshape) if d == 1)
  kept = ''.join(c for i, c in enumerate(s_letters) if i not in squeeze)

  # Pad batch-1 to two rows on CPU (see module docstring).
  x_only = [i for i, c in enumerate(xv) if c not in wv]
  pad_axis = None
  if qjax_target.on_cpu() and x_only and all(x.shape[i] == 1 for i in x_only):
    pad_axis = x_only[0]
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=pad_axis)

  x_reduce = tuple(i for i, c in enumerate(xv) if c in contracted)
  act_kind = 'int' if path == 'int8' else w.qtype.kind
  xq, xscale = tiled.quantize_rows(x.astype(jnp.float32), x_reduce, act_kind)
  acc_dtype = jnp.int32 if path == 'int8' else jnp.float32
  acc = jnp.einsum(f'{xv},{wv}->{acc_l}', xq, codes, preferred_element_type=acc_dtype)
  acc = acc.astype(jnp.float32)

  xs_l = ''.join(c for c in xv if c not in contracted)
  xscale = jnp.squeeze(xscale, axis=x_reduce)
  scale = jnp.squeeze(w.scale.astype(jnp.float32), axis=squeeze)
  if w.zero_point is not None:
    # (c - z) . x  =  c . x  -  z * sum(x) over each group's contracted elements.
    xsum = jnp.sum(xq.astype(jnp.int32), axis=x_reduce).astype(jnp.float32)
    zp = jnp.squeeze(w.zero_point.astype(jnp.float32), axis=squeeze)
    acc = acc - jnp.einsum(f'{xs_l},{kept}->{acc_l}', xsum, zp)
  y = jnp.einsum(f'{acc_l},{xs_l},{kept}->{out}', acc, xscale, scale)
  if pad_axis is not None:
    y = jax.lax.slice_in_dim(y, 0, 1, axis=out.index(xv[pad_axis]))
  return y.astype(out_dtype)


def qdot(x: jax.Array, w: Union[jax.Array, QArray], **kw) -> jax.Array:
  """`x @ w` for a 2-d weight (contracting x's last axis with w's first), via `qeinsum`."""
  if len(w.shape) != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f'qdot: x{tuple(x.shape)} @ w{tuple(w.shape)}: w must be 2-d (K, N) with '
                     "K equal to x's last axis; transpose or reshape one of them.")
  letters = string.ascii_lowercase[:x.ndim - 1]
  return qeinsum(f'{letters}y,yz->{letters}z', x, w, **kw)
