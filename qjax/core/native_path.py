"""`qeinsum(path='native')`: the weight's codes fed to `dot_general` as XLA's own narrow dtypes.

On GPU and TPU a QArray in the 'native' layout (`qjax.core.layouts`) holds its codes as
`jnp.int4` / `int8` / `float8_e4m3fn`. XLA converts such an operand to the activation dtype
inside the matmul (the GPU Triton GEMM fusion and the TPU MXU operand load take an `s4`/`s8`/
`f8` -> bf16 `convert`), so no float weight is written to memory. Two forms:

* scales constant along every contracted axis (per-channel or per-tensor): `x . codes` with
  f32 accumulation, then the scales (and the zero-point term `z * sum(x)`) applied to the
  (M, N) result. Codes of 8 bits or fewer and fp8 values are exact in bf16, so the only
  rounding is x's own and the f32 sum's: the float reference `x . dequantize(w)` up to
  summation order and the rounding of the dequantized weight.
* scales that vary along a contracted axis (groups, including groups that span flattened
  contracted axes, e.g. o_proj's N*H): `x . ((codes - z) * s)` in the activation dtype,
  with no unpacking arithmetic, written as the sequence (`[K/G, N] scale -> broadcast
  [K/G, G, N] -> bitcast [K, N] -> multiply(convert(codes)) -> dot`) that XLA:GPU fuses
  into the GEMM with `--xla_gpu_experimental_enable_subchannel_dequantisation_fusion`
  (docs/quantized_matmul.md); without the flag XLA may materialise the dequantized weight,
  which the device check measures. With f32 activations it equals the 'dequant' path bit
  for bit; with bf16 ones the scale is rounded to bf16 before the product (the 'dequant'
  path rounds the f32 product), within one bf16 rounding of it.

A packed QArray multiplied with `path='native'` is unpacked first (`QArray.codes`): correct,
but that unpack is what the native layout exists to avoid, so `path='auto'` never does it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qjax.core import numerics
from qjax.core.decode_paths import matrix_einsum
from qjax.core.qarray import QArray


def native_codes(w: QArray) -> jax.Array:
  """The codes in the tensor's shape, as stored when native (int4 / int8 / fp8)."""
  return w.codes() if w.qtype.packed else w.data


def compute_dtype(x: jax.Array):
  """The dot's operand dtype: x's float dtype (bf16 stays bf16: codes are exact in it)."""
  return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.float32


def _kept_broadcast(a: jax.Array, w: QArray, kept_axes) -> jax.Array:
  """A scale-shaped leaf, contracted axes dropped, repeated over its tiles on the kept axes."""
  sub = jnp.squeeze(a.astype(jnp.float32), axis=tuple(i for i in range(w.ndim)
                                                     if i not in kept_axes))
  return numerics.broadcast_scale(sub, tuple(w.shape[i] for i in kept_axes))


def native_einsum(xs: str, ws: str, out: str, x: jax.Array, w: QArray,
                  out_dtype) -> jax.Array:
  """Weight-only `einsum(xs,ws->out)(x, dequantize(w))` on native codes (module docstring)."""
  spec = f'{xs},{ws}->{out}'
  cdt = compute_dtype(x)
  xc = x.astype(cdt)
  codes = native_codes(w)
  contracted = [i for i, c in enumerate(ws) if c in xs and c not in out]
  if any(w.scale.shape[i] > 1 for i in contracted):
    # Grouped: convert(codes) * bitcast(broadcast(scale)) in the compute dtype, then the dot:
    # the HLO sequence XLA:GPU's subchannel dequantisation fusion matches.
    v = codes.astype(cdt)
    if w.zero_point is not None:
      v = v - numerics.broadcast_scale(w.zero_point.astype(cdt), w.shape)
    wd = v * numerics.broadcast_scale(w.scale.astype(cdt), w.shape)
    return matrix_einsum(spec, xc, wd, jnp.float32).astype(out_dtype)
  acc = matrix_einsum(spec, xc, codes.astype(cdt), jnp.float32)
  kept_axes = [i for i in range(w.ndim) if i not in contracted]
  kept = ''.join(ws[i] for i in kept_axes)
  scale = _kept_broadcast(w.scale, w, kept_axes)
  if w.zero_point is not None:
    # (c - z) . x = c . x - z * sum(x) over the contracted elements (z is constant there).
    x_kept = ''.join(c for c in xs if c not in [ws[i] for i in contracted])
    xsum = jnp.einsum(f'{xs}->{x_kept}', xc.astype(jnp.float32))
    z = _kept_broadcast(w.zero_point, w, kept_axes)
    acc = acc - jnp.einsum(f'{x_kept},{kept}->{out}', xsum, z)
  y = jnp.einsum(f'{out},{kept}->{out}', acc, scale)
  return y.astype(out_dtype)
