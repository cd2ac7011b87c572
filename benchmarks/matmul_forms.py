"""Candidate forms of a quantized matmul, timed on the device: which one reads fewer bytes.

    python -m benchmarks.matmul_forms [--smoke] [--out=results/matmul_forms.json]

Each form computes y = x @ W for a (K, N) weight stored one way, inside one jitted
`lax.fori_loop` of `--reps` products (the activations change every iteration, so nothing is
hoisted), so the time is the device's per product, without dispatch. Forms:
  * bf16: the float weight;
  * qjax dequant: `qjax.qdot(..., path='dequant')` on qjax's packed storage (int8, int4 g64);
  * native int8 / int4 (per channel, and int4 in groups of 64 and 128) and fp8 e4m3 codes
    stored as jnp.int8 / jnp.int4 / float8 arrays: `convert` -> multiply by the scale -> dot,
    the form XLA can fuse into the GEMM's operand load;
  * int8 x int8 -> int32 and fp8 x fp8 -> f32 dots (activations quantized per row).
Also each compiled product's temp bytes (`memory_analysis()`): about 2*K*N means a bf16 copy
of the weight was written. Run once with XLA's default flags and once with
`XLA_FLAGS=--xla_gpu_experimental_enable_subchannel_dequantisation_fusion` to see whether the
grouped forms fuse.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from jax import lax

import qjax

SHAPES = ((2048, 8192), (8192, 2048))  # Llama 3.2 1B's MLP up/gate and down projections
ROWS = (1, 8, 64, 512)


def _scaled(codes, scale, group):
  """codes * scale in bf16, for per-channel (group None) or grouped scales."""
  k, n = codes.shape
  if group is None:
    return codes.astype(jnp.bfloat16) * scale
  return (codes.reshape(k // group, group, n).astype(jnp.bfloat16)
          * scale[:, None, :]).reshape(k, n)


def forms(w, group_sizes=(64, 128)):
  """{name: (fn(x, *args) -> y, args)} for the float weight `w` (K, N)."""
  k, n = w.shape
  out = {'bf16': (lambda x, w: x @ w, (w.astype(jnp.bfloat16),))}
  for bits, g in ((8, None), (4, 64)):
    fmt = qjax.int_format(bits, group_size=g, channel_axes=(1,))
    q = qjax.quantize(w, fmt)
    out[f'qjax dequant int{bits}' + (f' g{g}' if g else '')] = (
        lambda x, q: qjax.qdot(x, q, path='dequant', out_dtype=jnp.bfloat16), (q,))
  amax = jnp.max(jnp.abs(w), axis=0)
  for bits, dtype in ((8, jnp.int8), (4, jnp.int4)):
    qmax = 2 ** (bits - 1) - 1
    scale = (amax / qmax).astype(jnp.bfloat16)
    codes = jnp.clip(jnp.round(w / amax * qmax), -qmax, qmax).astype(dtype)
    out[f'native int{bits}'] = (lambda x, c, s: x @ _scaled(c, s, None), (codes, scale))
  for g in group_sizes:
    wg = w.reshape(k // g, g, n)
    gmax = jnp.max(jnp.abs(wg), axis=1)
    codes = jnp.clip(jnp.round(wg / gmax[:, None] * 7), -7, 7).reshape(k, n).astype(jnp.int4)
    scale = (gmax / 7).astype(jnp.bfloat16)
    out[f'native int4 g{g}'] = (lambda x, c, s, g=g: x @ _scaled(c, s, g), (codes, scale))
  fscale = (amax / 448).astype(jnp.bfloat16)
  f8 = (w / (amax / 448)).astype(jnp.float8_e4m3fn)
  out['native fp8'] = (lambda x, c, s: x @ _scaled(c, s, None), (f8, fscale))
  i8scale = amax / 127
  i8 = jnp.clip(jnp.round(w / i8scale), -127, 127).astype(jnp.int8)

  def w8a8(x, c, s):
    xs = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / 127 + 1e-12
    xq = jnp.round(x / xs).astype(jnp.int8)
    acc = lax.dot(xq, c, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * xs * s).astype(jnp.bfloat16)
  out['int8 x int8'] = (w8a8, (i8, i8scale))

  def fp8x8(x, c, s):
    xs = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / 448 + 1e-12
    xq = (x / xs).astype(jnp.float8_e4m3fn)
    acc = lax.dot(xq, c, preferred_element_type=jnp.float32)
    return (acc * xs * s).astype(jnp.bfloat16)
  out['fp8 x fp8'] = (fp8x8, (f8, (amax / 448).astype(jnp.float32)))
  return out


def time_form(fn, args, x, reps: int):
  """(seconds per product on the device, temp bytes of one compiled product)."""
  @jax.jit
  def loop(x, *args):
    def body(i, carry):
      acc, x = carry
      y = fn(x + i.astype(x.dtype) * 1e-3, *args)
      return acc + y[0, 0].astype(jnp.float32), x
    return lax.fori_loop(0, reps, body, (jnp.float32(0), x))[0]
  jax.block_until_ready(loop(x, *args))
  best = float('inf')
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(loop(x, *args))
    best = min(best, time.perf_counter() - t)
  one = jax.jit(fn).lower(x, *args).compile().memory_analysis()
  return best / reps, (None if one is None else int(one.temp_size_in_bytes))


def main(argv=None) -> list:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--smoke', action='store_true', help='small shapes, few reps (CPU)')
  ap.add_argument('--reps', type=int, default=200)
  ap.add_argument('--out', default='results/matmul_forms.json')
  a = ap.parse_args(argv)
  shapes = ((256, 512),) if a.smoke else SHAPES
  rows_m = (1, 8) if a.smoke else ROWS
  reps = 2 if a.smoke else a.reps
  results = []
  for k, n in shapes:
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
    for name, (fn, args) in forms(w, (64,) if a.smoke else (64, 128)).items():
      for m in rows_m:
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        s, temp = time_form(fn, args, x, reps)
        results.append({'k': k, 'n': n, 'm': m, 'form': name, 'us': 1e6 * s, 'temp_bytes': temp,
                        'weight_bytes': sum(int(a.nbytes) for a in jax.tree.leaves(args))})
        print(f"{k}x{n} M={m:4d} {name:22s} {1e6 * s:9.1f} us  temp "
              f"{(temp or 0) / 2**20:8.1f} MiB", flush=True)
  os.makedirs(os.path.dirname(a.out) or '.', exist_ok=True)
  with open(a.out, 'w') as f:
    json.dump({'backend': jax.default_backend(), 'device': jax.devices()[0].device_kind,
               'xla_flags': os.environ.get('XLA_FLAGS', ''), 'rows': results}, f, indent=1)
  return results


if __name__ == '__main__':
  main()
