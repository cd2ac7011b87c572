"""Quantized matmul benchmark: time ratios to f32, measured side by side in one run.

Run:  make bench   (or: .venv/bin/python -m benchmarks.qdot_bench [--d=4096] [--reps=30])
Check first that nothing else runs on the machine (`uptime`): a concurrent process skews
timings several-fold. The paths are timed round-robin (a short block of calls of each per
round) and each ratio is the median over rounds of (path time / f32 time in the same round),
so load that drifts during the run hits numerator and denominator alike. For each M (rows of
activations) it prints, per path, that ratio, the median time, bytes read per call (weight storage +
activations), effective GB/s and the temporary memory XLA allocates for the compiled call
(`memory_analysis()`): a path whose temp is ~4*D*D bytes materialises a float copy of the
weight. Rows marked * are what `path='auto'` runs on this backend.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import qjax
from qjax import kernels
from qjax.core import tiled_path


def _time_round_robin(calls, reps, per_round=3):
  """{name: (median seconds, median ratio to the first entry)} over `reps` rounds.

  Each round runs every path in turn: one untimed call (so the previous path's cache and
  allocator state, e.g. a 64 MiB dequantized temp, is not charged to it), then `per_round`
  timed calls. Ratios are taken within a round, then the median over rounds.
  """
  for f, args in calls.values():
    jax.block_until_ready(f(*args))
  ts = {name: [] for name in calls}
  for _ in range(reps):
    for name, (f, args) in calls.items():
      jax.block_until_ready(f(*args))
      one = []
      for _ in range(per_round):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        one.append(time.perf_counter() - t0)
      ts[name].append(float(np.median(one)))
  base = np.asarray(next(iter(ts.values())))
  return {n: (float(np.median(v)), float(np.median(np.asarray(v) / base))) for n, v in ts.items()}


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--d', type=int, default=4096)
  p.add_argument('--reps', type=int, default=15)
  p.add_argument('--ms', default='1,8,64')
  p.add_argument('--head_v', type=int, default=262144,
                 help="rows V of the tied-head case 'BTD,VD->BTV' (Gemma 3: 262144 x 640); 0: skip")
  a = p.parse_args()
  d = a.d
  backend = jax.default_backend()
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; '
        f'weight {d}x{d}; load average {os.getloadavg()[0]:.2f}')
  w = jax.random.normal(jax.random.key(0), (d, d)) / np.sqrt(d)
  f8 = qjax.int_format(8, channel_axes=(1,))
  f4 = qjax.int_format(4, group_size=128, channel_axes=(1,))
  a8 = qjax.int_format(8)
  q8, q4 = qjax.quantize(w, f8), qjax.quantize(w, f4)
  wb = w.astype(jnp.bfloat16)
  auto8, auto4 = qjax.choose_path(f8), qjax.choose_path(f4)
  paths = {
      'f32': (lambda x, w: x @ w, w),
      'bf16': (lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w,
                                    preferred_element_type=jnp.float32), wb),
      'int8 w-only (dequant)': (lambda x, q: qjax.qdot(x, q, path='dequant'), q8),
      f'int8 w-only (auto={auto8})*': (lambda x, q: qjax.qdot(x, q), q8),
      'int8 w-only (int8 act)': (lambda x, q: qjax.qdot(x, q, path='int8'), q8),
      'int4 g128 (dequant)': (lambda x, q: qjax.qdot(x, q, path='dequant'), q4),
      f'int4 g128 (auto={auto4})*': (lambda x, q: qjax.qdot(x, q), q4),
      'int4 g128 (int8 act)': (lambda x, q: qjax.qdot(x, q, path='int8'), q4),
      f'W8A8 int8 ({qjax.choose_path(f8, a8)})*': (lambda x, q: qjax.qdot(x, q, act_fmt=a8), q8),
  }
  print(f'CPU kernel (qjax.kernels): {kernels.status()}, isa {kernels.isa()}')
  if kernels.available():  # the decode kernel, explicitly (auto takes it for M <= 16)
    paths['int8 w-only (kernel)'] = (lambda x, q: qjax.qdot(x, q, path='kernel'), q8)
    paths['int4 g128 (kernel)'] = (lambda x, q: qjax.qdot(x, q, path='kernel'), q4)
    paths['bf16 (float_einsum)'] = (lambda x, w: qjax.core.float_einsum('MD,DF->MF', x, w), wb)
  # What the kernel's decode shapes fall back to without it (XLA's row tiles), side by side.
  paths['int8 w-only (tiled: XLA)'] = (lambda x, q: qjax.qdot(x, q, path='tiled'), q8)
  paths['int4 g128 (tiled: XLA)'] = (lambda x, q: qjax.qdot(x, q, path='tiled'), q4)
  xla_int8 = lambda x, q: tiled_path.tiled_einsum('MD', 'DF', 'MF', x, q, 'int', jnp.float32)
  paths['W8A8 int8 (XLA int tiles)'] = (xla_int8, q8)
  paths['W4A8 int4 g128 (XLA int tiles)'] = (xla_int8, q4)
  for m in [int(v) for v in a.ms.split(',')]:
    x = jax.random.normal(jax.random.key(1), (m, d))
    print(f'\nM = {m}  ({backend}; load average {os.getloadavg()[0]:.2f})')
    print(f'{"path":30s} {"time/f32":>9s} {"ms":>8s} {"MB read":>8s} {"GB/s":>7s} '
          f'{"temp MB":>8s} {"SQNR dB":>8s}')
    ref = x @ w
    calls = {name: (jax.jit(f), (x, wt)) for name, (f, wt) in paths.items()}
    times = _time_round_robin(calls, a.reps)
    for name, (jf, (_, wt)) in calls.items():
      t, ratio = times[name]
      temp = jf.lower(x, wt).compile().memory_analysis().temp_size_in_bytes
      nbytes = (wt.nbytes if isinstance(wt, qjax.QArray) else wt.size * wt.dtype.itemsize)
      nbytes += x.nbytes
      sq = float(qjax.sqnr_db(ref, jf(x, wt)))
      print(f'{name:30s} {ratio:9.2f} {t * 1e3:8.3f} {nbytes / 1e6:8.1f} '
            f'{nbytes / t / 1e9:7.1f} {temp / 1e6:8.1f} {sq:8.1f}')
  if a.head_v:
    _head(a)
  print(f'\nload average at the end {os.getloadavg()[0]:.2f}')


def _head(a):
  """The tied head 'BTD,VD->BTV' (weight (V, D), contracted D last) at decode shapes."""
  v, d = a.head_v, 640
  w = jax.random.normal(jax.random.key(2), (v, d)) / np.sqrt(d)
  q8 = qjax.quantize(w, qjax.int_format(8, channel_axes=(0,), group_axis=1))
  q4 = qjax.quantize(w, qjax.int_format(4, group_size=128, channel_axes=(0,), group_axis=1))
  head = lambda path: (lambda x, q: qjax.qeinsum('BTD,VD->BTV', x, q, path=path))
  paths = {'f32': (lambda x, w: jnp.einsum('BTD,VD->BTV', x, w), w),
           'bf16 (float_einsum)': (lambda x, w: qjax.core.float_einsum('BTD,VD->BTV', x, w),
                                   w.astype(jnp.bfloat16)),
           'int8 (auto)*': (head('auto'), q8), 'int8 (tiled: V blocks)': (head('tiled'), q8),
           'int4 g128 (auto)*': (head('auto'), q4),
           'int4 g128 (tiled: V blocks)': (head('tiled'), q4),
           'int4 g128 (dequant)': (head('dequant'), q4)}
  for m in [1, 8]:
    x = jax.random.normal(jax.random.key(1), (1, m, d))
    print(f'\ntied head {v} x {d}, M = {m} (load average {os.getloadavg()[0]:.2f})')
    print(f'{"path":30s} {"time/f32":>9s} {"ms":>8s} {"temp MB":>8s} {"SQNR dB":>8s}')
    ref = jnp.einsum('BTD,VD->BTV', x, w)
    calls = {name: (jax.jit(f), (x, wt)) for name, (f, wt) in paths.items()}
    times = _time_round_robin(calls, max(3, a.reps // 3), per_round=1)
    for name, (jf, (_, wt)) in calls.items():
      t, ratio = times[name]
      temp = jf.lower(x, wt).compile().memory_analysis().temp_size_in_bytes
      sq = float(qjax.sqnr_db(ref, jf(x, wt)))
      print(f'{name:30s} {ratio:9.2f} {t * 1e3:8.2f} {temp / 1e6:8.1f} {sq:8.1f}')


if __name__ == '__main__':
  main()
