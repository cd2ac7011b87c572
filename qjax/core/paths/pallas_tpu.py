"""Path 'pallas_tpu': the Mosaic kernel `qjax.kernels.tpu_qmm`, group scales after the partial
reduce.

Fits: weight-only; symmetric int8, native int4 or fp8 codes; a weight (contracted...,
kept...) whose groups are runs of the flattened contraction (o_proj's N*H included) in whole
multiples of 8 rows, or the tied head (V, D) per channel or in groups of whole 128-lane columns;
output channels in multiples of 128 or one block (`tpu_qmm.fits`); any number of rows. A
one-device TPU target in 'auto' (a Mosaic call has no SPMD partitioner); named elsewhere, it
runs in Pallas interpret mode.
Runs: blocks of codes widened in VMEM, one MXU dot per group with f32 accumulation and that
group's scale row applied to its partial sum; per-channel scales once after the last K block.
No float weight exists in HBM, so XLA's cost analysis counts the codes, the scales and the
activations (the kernel states its cost).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from qjax.core import native_path
from qjax.core.paths.call import Call
from qjax.kernels import tpu_qmm

NAME = 'pallas_tpu'


def _codes_dtype_name(call: Call) -> Optional[str]:
  qt = call.qtype
  if qt.is_float:
    return jnp.dtype(qt.code_dtype).name
  if qt.bits == 8:
    return 'int8'
  return 'int4' if qt.native_int4 and qt.bits == 4 else None


def fits(call: Call, target, asked: bool) -> Optional[str]:
  """None where this path runs the call, else why not."""
  if call.act is not None:
    return 'weight-only: the activations stay float'
  if target.platform != 'tpu' and not asked:
    return f'the target is {target.platform}; the Mosaic kernel lowers for TPUs'
  if target.platform == 'tpu' and target.device_count > 1:
    # A Mosaic call has no SPMD partitioning rule: over several devices XLA would gather its
    # operands whole; its own dot partitions.
    return f'{target.device_count} devices: the kernel is not partitioned (XLA\'s dot is)'
  if call.zero_point:
    return 'asymmetric codes (zero points)'
  if _codes_dtype_name(call) is None:
    return (f'{call.qtype.name} {call.qtype.layout} codes: the kernel takes int8, native int4 '
            'and fp8')
  form = call.form
  if form == 'other':
    return f'spec {call.spec} is neither (contracted..., kept...) nor the head layout'
  if form == 'kn' and any(1 < call.tile_shape[i] < call.w_shape[i]
                          for i in range(len(call.ws)) if i not in call.contracted):
    return f'scales {call.scale_shape} cut an output axis into groups'
  group = call.group
  if group is None:
    return f'scales {call.scale_shape} are not groups of the flattened contraction'
  return tpu_qmm.fits('kn' if form == 'kn' else 'nk', call.rows, call.k, call.n, group,
                      target.device_kind if target.platform == 'tpu' else '')


def run(call: Call, x, w, out_dtype, *, target, asked: bool):
  """The product on the Mosaic kernel: interpret mode off a TPU target; for a TPU target, a
  program lowered for another platform after all (a TPU trace compiled on the host) runs
  XLA's native dot there instead (`lax.platform_dependent`)."""
  del asked
  xs, ws, out = call.xs, call.ws, call.out
  contracted = ''.join(ws[i] for i in call.contracted)
  x_only = tuple(c for c in xs if c not in contracted)
  m_shape = tuple(x.shape[xs.index(c)] for c in x_only)
  kept = ''.join(c for c in ws if c not in contracted)
  kept_shape = tuple(d for c, d in zip(ws, w.shape) if c in kept)

  def kernel(x, w):
    x2 = x.transpose([xs.index(c) for c in x_only + tuple(contracted)])
    x2 = x2.reshape(math.prod(m_shape), call.k)
    if x2.dtype not in (jnp.bfloat16, jnp.float32):
      x2 = x2.astype(jnp.float32)
    codes, scales = operands(call, w)
    on_tpu = target.platform == 'tpu'
    y2 = tpu_qmm.qmm(x2, codes, scales, layout='kn' if call.form == 'kn' else 'nk',
                     out_dtype=out_dtype, interpret=not on_tpu,
                     device_kind=target.device_kind if on_tpu else '')
    y = y2.reshape(m_shape + kept_shape)
    letters = ''.join(x_only) + kept
    return y.transpose([letters.index(c) for c in out]).astype(out_dtype)

  if target.platform != 'tpu':
    return kernel(x, w)
  return jax.lax.platform_dependent(
      x, w, tpu=kernel,
      default=lambda x, w: native_path.native_einsum(xs, ws, out, x, w, out_dtype))


def operands(call: Call, w):
  """(codes, scales) as the kernel takes them: 'kn' (K, N) and (G, N); 'nk' (N, K) and
  (N, G). Reshapes of the stored arrays (free), scales broadcast where they are per tensor
  along an output axis."""
  k, n = call.k, call.n
  if call.form == 'nk':
    v, d = call.w_shape
    g = d // call.group
    return w.data, jnp.broadcast_to(w.scale, (v, g)) if w.scale.shape != (v, g) else w.scale
  a = len(call.contracted)
  sk = math.prod(w.scale.shape[:a])  # one scale row per group of the flattened contraction
  kept_shape = tuple(call.w_shape[a:])
  s = jnp.broadcast_to(w.scale.reshape((sk,) + w.scale.shape[a:]), (sk,) + kept_shape)
  return w.data.reshape(k, n), s.reshape(sk, n)
