"""Quantized matmul: `qeinsum(spec, x, w)` with a QArray weight.

Compute paths (`path=`):

* `'dequant'`: `einsum(x, dequantize(w))` in the activation dtype. Exact weight-only
  semantics. On GPU/TPU XLA fuses the int->float convert into the matmul's operand load, so
  no float weight is materialised there; on XLA:CPU it is (a full float copy per call, see
  NOTES.md), so it is not the CPU default.
* `'int8'`: activations quantized on the fly to int8, symmetric, one scale per token and per
  weight group (the same idea as llama.cpp's Q8 activation blocks), multiplied with the
  integer codes by `lax.dot_general(int8, int8, preferred_element_type=int32)`, then
  rescaled (and zero-point corrected) in f32 after the dot. This is W8A8 when
  `act_fmt=int8` is requested, and the CPU default for integer weights of <= 8 bits:
  XLA:CPU runs int8 x int8 -> int32 as a fused kernel that reads the codes directly.
* `'fp8'`: activations quantized per token to the weight's fp8 kind, fp8 x fp8 dot with f32
  accumulation.

`path='auto'` picks: the activation format's path if one is given; otherwise `'int8'` for
integer weights on CPU and `'dequant'` elsewhere. The choice is a function of (format,
backend) only, so it is recorded in conversion records via `choose_path`.

A weight grouped along a contracted axis is handled exactly by splitting that axis into
(groups, group size) on both operands, accumulating per group, and applying the group scales
after the integer dot. At M = 1 (batch-1 decode) XLA:CPU lowers an integer dot to a plain
loop that widens the weight, so the int8 path pads the token axis to 2 rows there.
"""

from __future__ import annotations

import string
from typing import Optional, Union

import jax
import jax.numpy as jnp

from qjax.core.calibration import grouped_view_shape
from qjax.core.formats import FLOAT_KINDS, QFormat, normalize_axis
from qjax.core.qarray import QArray, dequantize

PATHS = ('auto', 'dequant', 'int8', 'fp8')
INT8_ACT = QFormat(bits=8)


def choose_path(w_fmt: QFormat, act_fmt: Optional[QFormat] = None,
                backend: Optional[str] = None) -> str:
  """The compute path `path='auto'` takes for this weight format, activation format, backend."""
  backend = backend or jax.default_backend()
  if act_fmt is not None:
    if w_fmt.is_float != act_fmt.is_float:
      raise ValueError(f'qeinsum: weights {w_fmt.name} and activations {act_fmt.name} mix '
                       'integer and float codes; use both int or both fp8.')
    return 'fp8' if act_fmt.is_float else 'int8'
  if backend == 'cpu' and not w_fmt.is_float:
    return 'int8'
  return 'dequant'


def _parse(spec: str):
  try:
    ins, out = spec.replace(' ', '').split('->')
    xs, ws = ins.split(',')
  except ValueError:
    raise ValueError(f"qeinsum: spec {spec!r} must look like 'BTD,DF->BTF' (two operands, "
                     'explicit output, no ellipsis).') from None
  if '.' in spec:
    raise ValueError(f'qeinsum: spec {spec!r} uses an ellipsis; spell out every axis.')
  return xs, ws, out


def _fresh_letter(used: str) -> str:
  return next(c for c in string.ascii_letters if c not in used)


def _quantize_rows(x, reduce_axes, act_kind):
  """Symmetric per-row quantization of activations (rows = all non-reduced axes)."""
  amax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
  if act_kind == 'int':
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale
  dt = FLOAT_KINDS[act_kind]
  fmax = float(jnp.finfo(dt).max)
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  return jnp.clip(x / scale, -fmax, fmax).astype(dt), scale


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
    path: 'auto', 'dequant', 'int8' or 'fp8' (see the module docstring).
    out_dtype: result dtype (default: x's dtype).

  Returns:
    The einsum result, `out_dtype`.
  """
  out_dtype = out_dtype or x.dtype
  if not isinstance(w, QArray):
    return jnp.einsum(spec, x, w.astype(x.dtype)).astype(out_dtype)
  if path not in PATHS:
    raise ValueError(f'qeinsum: path={path!r} is unknown; use one of {PATHS}.')
  xs, ws, out = _parse(spec)
  if len(ws) != w.ndim or len(xs) != x.ndim:
    raise ValueError(f'qeinsum: spec {spec!r} has operands of rank {len(xs)} and {len(ws)} but '
                     f'got x{tuple(x.shape)} and w{w.shape}.')
  fmt = w.fmt
  if path == 'auto':
    path = choose_path(fmt, act_fmt)
  if path == 'dequant':
    return jnp.einsum(spec, x, dequantize(w, x.dtype)).astype(out_dtype)
  if path == 'int8' and fmt.is_float or path == 'fp8' and not fmt.is_float:
    raise ValueError(f'qeinsum: path={path!r} cannot multiply {fmt.name} weights; use '
                     f"path='{'fp8' if fmt.is_float else 'int8'}' or 'dequant'.")
  return _integer_like_einsum(xs, ws, out, x, w, path, out_dtype)


def _integer_like_einsum(xs, ws, out, x, w: QArray, path, out_dtype):
  fmt, x0 = w.fmt, x
  contracted = [c for c in ws if c in xs and c not in out]
  view_shape, reduced = grouped_view_shape(w.shape, fmt)
  g = _fresh_letter(xs + ws + out)
  if fmt.group_size is not None:
    ga = normalize_axis(fmt.group_axis, w.ndim, 'group_axis')
    gl = ws[ga]
    if gl not in contracted:
      return jnp.einsum(f'{xs},{ws}->{out}', x0, dequantize(w, x0.dtype)).astype(out_dtype)
    wv = ws[:ga] + g + ws[ga:]
    xi = xs.index(gl)
    xv = xs[:xi] + g + xs[xi:]
    x = x.reshape(x.shape[:xi] + (w.shape[ga] // fmt.group_size, fmt.group_size)
                  + x.shape[xi + 1:])
    acc_l = out + g
  else:
    wv, xv, acc_l = ws, xs, out
  kept = ''.join(c for i, c in enumerate(wv) if i not in reduced)
  if any(c in contracted for c in kept):
    # A scale that varies along a contracted axis (not by group) cannot be applied after the
    # dot; take the exact dequantize path rather than a wrong answer.
    return jnp.einsum(f'{xs},{ws}->{out}', x0, dequantize(w, x0.dtype)).astype(out_dtype)

  # Pad batch-1 to two rows on CPU (see module docstring).
  x_only = [i for i, c in enumerate(xv) if c not in wv]
  pad_axis = None
  if jax.default_backend() == 'cpu' and x_only and all(x.shape[i] == 1 for i in x_only):
    pad_axis = x_only[0]
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=pad_axis)

  x_reduce = tuple(i for i, c in enumerate(xv) if c in contracted)
  act_kind = 'int' if path == 'int8' else fmt.kind
  xq, xscale = _quantize_rows(x.astype(jnp.float32), x_reduce, act_kind)
  codes = w.codes().reshape(view_shape)
  acc_dtype = jnp.int32 if path == 'int8' else jnp.float32
  acc = jnp.einsum(f'{xv},{wv}->{acc_l}', xq, codes, preferred_element_type=acc_dtype)
  acc = acc.astype(jnp.float32)

  xs_l = ''.join(c for c in xv if c not in contracted)
  xscale = jnp.squeeze(xscale, axis=x_reduce)
  scale = jnp.squeeze(w.scale.astype(jnp.float32), axis=reduced)
  if w.zero_point is not None:
    # (c - z) . x  =  c . x  -  z * sum(x) over each group's contracted elements.
    xsum = jnp.sum(xq.astype(jnp.int32), axis=x_reduce).astype(jnp.float32)
    zp = jnp.squeeze(w.zero_point.astype(jnp.float32), axis=reduced)
    acc = acc - jnp.einsum(f'{xs_l},{kept}->{acc_l}', xsum, zp)
  y = jnp.einsum(f'{acc_l},{xs_l},{kept}->{out}', acc, xscale, scale)
  if pad_axis is not None:
    y = jax.lax.slice_in_dim(y, 0, 1, axis=out.index(xv[pad_axis]))
  return y.astype(out_dtype)


def qdot(x: jax.Array, w: Union[jax.Array, QArray], **kw) -> jax.Array:
  """`x @ w` for a 2-d weight (contracting x's last axis with w's first), via `qeinsum`."""
  letters = string.ascii_lowercase[:x.ndim - 1]
  return qeinsum(f'{letters}y,yz->{letters}z', x, w, **kw)
