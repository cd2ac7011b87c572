"""Path 'int_dot': quantized activations times the codes as one XLA dot (W8A8, fp8 x fp8).

Fits: int8 activations with integer codes, fp8 activations with fp8 codes; scales per output
channel or per group of one contracted axis.
Runs: the activations quantized per token (and per weight group) to int8 / the weight's fp8
kind, `dot_general(x_q, codes)` with an int32 (integer) or f32 (fp8) accumulator, the group
index a batch axis of the dot, then both scales (and the zero-point term) applied in f32.
A single activation row is padded to two on XLA:CPU, whose one-row dot widens the weight.
"""

from __future__ import annotations

import string
from typing import Optional

import jax
import jax.numpy as jnp

from qjax.core import tiled_path
from qjax.core.paths.call import Call

NAME = 'int_dot'


def _scale_axes(call: Call):
  """(contracted axes along which the scale varies, kept axes it cuts into groups)."""
  contracted = call.contracted
  along_k = [i for i in contracted if call.scale_shape[i] > 1]
  cut_kept = [i for i in range(len(call.ws)) if i not in contracted
              and 1 < call.tile_shape[i] < call.w_shape[i]]
  return along_k, cut_kept


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  del target, asked
  if call.act is None:
    return 'it multiplies quantized activations; the call is weight-only'
  if (call.act == 'int') == call.qtype.is_float:
    return f'{call.qtype.name} codes do not multiply {call.act} activations'
  along_k, cut_kept = _scale_axes(call)
  if len(along_k) > 1 or cut_kept or (along_k and call.tile_shape[along_k[0]] == 1):
    # A scale that varies along a contracted axis other than by groups cannot be applied
    # after the dot.
    return (f'scales {call.scale_shape} vary along the contraction other than by groups of '
            'one axis')
  return None


def _fresh_letter(used: str) -> str:
  return next(c for c in string.ascii_letters if c not in used)


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The quantized-activation dot on the whole operands."""
  del asked
  xs, ws, out = call.xs, call.ws, call.out
  contracted = [ws[i] for i in call.contracted]
  tiles, sshape = w.tile_shape, w.scale.shape
  along_k, _ = _scale_axes(call)
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

  # One row on XLA:CPU: its plain one-row dot widens the weight; two rows take the fused dot.
  x_only = [i for i, c in enumerate(xv) if c not in wv]
  pad_axis = None
  if target.platform == 'cpu' and x_only and all(x.shape[i] == 1 for i in x_only):
    pad_axis = x_only[0]
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=pad_axis)

  x_reduce = tuple(i for i, c in enumerate(xv) if c in contracted)
  xq, xscale = tiled_path.quantize_rows(x.astype(jnp.float32), x_reduce, call.act)
  acc_dtype = jnp.int32 if call.act == 'int' else jnp.float32
  if target.platform not in ('cpu', 'tpu') and call.bucket == 'decode':
    # XLA:GPU merges dots that share an operand into one GEMM; at decode rows the projections
    # that read the same quantized activations (q, k, v) were merged by first transposing
    # their int8 weights K-minor, a copy of each weight every step (its size:
    # docs/quantized_matmul.md). Pairing the activations with this call's
    # own codes in a barrier keeps each dot separate, reading its weight as stored. (At prefill
    # the merged GEMM read less than the separate ones.)
    xq, codes = jax.lax.optimization_barrier((xq, codes))
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
