"""Quantized matmul benchmark: time ratios to f32, measured side by side in one run.

Run:  make bench   (or: .venv/bin/python benchmarks/qdot_bench.py [--d=4096] [--reps=20])
Check first that nothing else runs on the machine (`uptime`): a concurrent process skews
timings several-fold. For each M (rows of activations) it prints, per path, the time relative
to the f32 dot, bytes read per call (weight storage + activations), effective GB/s and the
temporary memory XLA allocates for the compiled call (`memory_analysis()`): a path whose temp
is ~4*D*D bytes materialises a float copy of the weight.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import qjax


def _time(f, *args, reps):
  jax.block_until_ready(f(*args))
  best = []
  for _ in range(3):  # best of 3 medians of `reps` calls: robust to a stray hiccup
    ts = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      ts.append(time.perf_counter() - t0)
    best.append(float(np.median(ts)))
  return min(best)


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--d', type=int, default=4096)
  p.add_argument('--reps', type=int, default=20)
  p.add_argument('--ms', default='1,8,64')
  a = p.parse_args()
  d = a.d
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; '
        f'weight {d}x{d}; load average {os.getloadavg()[0]:.2f}')
  w = jax.random.normal(jax.random.key(0), (d, d)) / np.sqrt(d)
  q8 = qjax.quantize(w, qjax.int_format(8, channel_axes=(1,)))
  q4 = qjax.quantize(w, qjax.int_format(4, group_size=128, channel_axes=(1,)))
  wb = w.astype(jnp.bfloat16)
  a8 = qjax.int_format(8)
  paths = {
      'f32': (lambda x, w: x @ w, w),
      'bf16': (lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w,
                                    preferred_element_type=jnp.float32), wb),
      'int8 w-only (dequant)': (lambda x, q: qjax.qdot(x, q, path='dequant'), q8),
      'int8 w-only (auto=int8 act)': (lambda x, q: qjax.qdot(x, q), q8),
      'int4 g128 (dequant)': (lambda x, q: qjax.qdot(x, q, path='dequant'), q4),
      'int4 g128 (auto=int8 act)': (lambda x, q: qjax.qdot(x, q), q4),
      'W8A8 int8': (lambda x, q: qjax.qdot(x, q, act_fmt=a8), q8),
  }
  for m in [int(v) for v in a.ms.split(',')]:
    x = jax.random.normal(jax.random.key(1), (m, d))
    print(f'\nM = {m}')
    print(f'{"path":30s} {"time/f32":>9s} {"ms":>8s} {"MB read":>8s} {"GB/s":>7s} '
          f'{"temp MB":>8s} {"SQNR dB":>8s}')
    ref = x @ w
    base = None
    for name, (f, wt) in paths.items():
      jf = jax.jit(f)
      t = _time(jf, x, wt, reps=a.reps)
      base = base or t
      temp = jf.lower(x, wt).compile().memory_analysis().temp_size_in_bytes
      nbytes = (wt.nbytes if isinstance(wt, qjax.QArray) else wt.size * wt.dtype.itemsize)
      nbytes += x.nbytes
      sq = float(qjax.sqnr_db(ref, jf(x, wt)))
      print(f'{name:30s} {t / base:9.2f} {t * 1e3:8.3f} {nbytes / 1e6:8.1f} '
            f'{nbytes / t / 1e9:7.1f} {temp / 1e6:8.1f} {sq:8.1f}')


if __name__ == '__main__':
  main()
