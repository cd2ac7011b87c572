"""int4 weight layouts and qeinsum paths side by side: time ratios to the float dot, one run.

    python -m benchmarks.qmm_layouts [--k=2048] [--n=8192] [--ms=1,64] [--reps=9]

For an int4 g128 weight (K, N) and M rows of activations it times, round-robin in one process
(`qdot_bench._time_round_robin`: ratios within a round, median over rounds), the float dot
(f32 on CPU, bf16 elsewhere) and: the packed layout on the 'auto' path, the native layout
(jnp.int4 codes) on 'auto' and on 'native', and the packed layout on 'dequant'. It prints each
path's ratio to the float dot and the bytes its weight holds. 'pallas' is timed only off CPU
(on CPU it runs in the Pallas interpreter, which measures the interpreter). On a shared CPU
only the ratios of one run mean anything.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp

import qjax
from benchmarks.qdot_bench import _time_round_robin
from qjax.core import layouts


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--k', type=int, default=2048)
  ap.add_argument('--n', type=int, default=8192)
  ap.add_argument('--ms', default='1,64')
  ap.add_argument('--reps', type=int, default=9)
  a = ap.parse_args(argv)
  backend = jax.default_backend()
  fdt = jnp.float32 if backend == 'cpu' else jnp.bfloat16
  w = jax.random.normal(jax.random.key(0), (a.k, a.n), jnp.float32) / 32
  packed = qjax.quantize(w, qjax.int_format(4, group_size=128, channel_axes=(1,)))
  native = layouts.to_layout(packed, 'native')
  wf = w.astype(fdt)
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind} ({backend}), '
        f'{os.cpu_count()} cpus; weight {a.k}x{a.n} int4 g128; float dot in {jnp.dtype(fdt).name}')
  print(f'bytes: float {wf.nbytes:,}, packed {packed.nbytes:,}, native {native.nbytes:,} '
        f'(int4 takes {qjax.core.qarray.int4_bits()} bits a code on this backend)')
  qd = jax.jit(qjax.qdot, static_argnames=('path',))
  out = {}
  for m in (int(v) for v in a.ms.split(',')):
    x = jax.random.normal(jax.random.key(1), (m, a.k), fdt)
    calls = {'float dot': (jax.jit(jnp.dot), (x, wf)),
             'packed auto': (functools.partial(qd, path='auto'), (x, packed)),
             'native auto': (functools.partial(qd, path='auto'), (x, native)),
             'native native': (functools.partial(qd, path='native'), (x, native)),
             'packed dequant': (functools.partial(qd, path='dequant'), (x, packed))}
    if backend != 'cpu' and m <= 64:
      calls['packed pallas'] = (functools.partial(qd, path='pallas'), (x, packed))
    res = _time_round_robin(calls, a.reps)
    out[m] = {k: r for k, (_, r) in res.items()}
    print(f'M={m}: ' + ', '.join(f'{k} {r:.2f}x' for k, r in out[m].items()))
  return out


if __name__ == '__main__':
  main()
