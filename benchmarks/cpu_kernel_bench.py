"""Gemma 3 270M decode on XLA:CPU with and without the CPU kernel: ratios to f32.

    .venv/bin/python -m benchmarks.cpu_kernel_bench [--rows=f32,bf16,w4a8] [--steps=64]
        [--repeats=3] [--modes=kernel,fallback] [--isa=avx2]

Through the public API only: `load_gemma3_270m`, `quantize_model`, `greedy_generate`; a
128-token prompt (Tiny Shakespeare), batch 1. Decode tokens/s = (steps - 1) / (time of
`greedy_generate(prompt, steps)` - time of `greedy_generate(prompt, 1)`), i.e. the steps after
prefill, median of `--repeats` after one compiling call. Each mode runs in its own process
(the kernel's switch `QJAX_CPU_KERNEL` is read once per process), f32 first in each, so every
ratio is taken within one process. Rows: f32 and bf16 params; W4A8 / W8A8 (int4 g128 / int8
per-channel weights with dynamic int8 activations) and weight-only int4 g128 / int8, every
weight including the tied 262k-vocab head. Prints one markdown table and the kernel's
`kernels.info()` per mode. ~6 min per mode on 2 idle cores (most of it loading and compiling).
`--isa=avx2` runs both sides as on an AVX2-only CPU: XLA:CPU limited to AVX2
(`--xla_cpu_max_isa=AVX2`) and the kernel built for the `avx2` level (`QJAX_KERNEL_ISA`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = ('f32', 'bf16', 'w4a8', 'w8a8', 'int4', 'int8')
MODES = {'kernel': '1', 'fallback': '0'}  # QJAX_CPU_KERNEL per mode


def _policy(row: str):
  from qjax import int_format  # pylint: disable=g-import-not-at-top
  from qjax.nn import QuantPolicy, QuantRule  # pylint: disable=g-import-not-at-top
  bits = 4 if '4' in row else 8
  fmt = int_format(bits, group_size=128 if bits == 4 else None)
  act = int_format(8) if row.startswith('w') else None
  return QuantPolicy((QuantRule('.*', fmt, act=act),))


def _measure(rows, steps: int, repeats: int) -> dict:
  """Decode tok/s per row in this process (f32 first), and the kernel's state."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from qjax import data as qdata  # pylint: disable=g-import-not-at-top
  from qjax import kernels  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.nn import greedy_generate, quantize_model  # pylint: disable=g-import-not-at-top

  base, tok, _ = load_gemma3_270m()
  ids = tok.encode(qdata.corpus('tinyshakespeare')[:20_000]).ids
  prompt = jax.numpy.asarray(np.asarray(ids[:128], np.int32)[None])

  def timed(model, n):
    t = time.perf_counter()
    jax.block_until_ready(greedy_generate(model, prompt, n))
    return time.perf_counter() - t

  out = {}
  for row in rows:
    if row == 'f32':
      model = base
    elif row == 'bf16':
      model = load_gemma3_270m(param_dtype='bfloat16')[0]
    else:
      model = quantize_model(base, _policy(row))[0]
    timed(model, steps), timed(model, 1)  # compile prefill and the decode step
    decode_s = [timed(model, steps) - timed(model, 1) for _ in range(repeats)]
    out[row] = (steps - 1) / statistics.median(decode_s)
    print(f'  {row}: {out[row]:.2f} tok/s', file=sys.stderr, flush=True)
    del model
  return {'tok_s': out, 'kernel': kernels.info(), 'load': os.getloadavg()}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rows', default=','.join(ROWS))
  p.add_argument('--modes', default=','.join(MODES))
  p.add_argument('--steps', type=int, default=64)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--isa', default='', choices=('', 'avx2'),
                 help='limit XLA:CPU and the kernel to this level (default: the CPU\'s best)')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  a = p.parse_args()
  rows = [r for r in a.rows.split(',') if r]
  bad = [r for r in rows if r not in ROWS] + [m for m in a.modes.split(',') if m not in MODES]
  if bad:
    p.error(f'unknown rows/modes {bad}; rows are {ROWS}, modes {tuple(MODES)}')
  if 'f32' not in rows:
    rows.insert(0, 'f32')  # every ratio is to f32 measured in the same process
  if a.child:
    print(json.dumps(_measure(rows, a.steps, a.repeats)))
    return
  results = {}
  for mode in a.modes.split(','):
    print(f'{mode}: QJAX_CPU_KERNEL={MODES[mode]}, load {os.getloadavg()}', file=sys.stderr,
          flush=True)
    env = dict(os.environ, QJAX_CPU_KERNEL=MODES[mode], XLA_FLAGS='')
    if a.isa:
      env.update(XLA_FLAGS=f'--xla_cpu_max_isa={a.isa.upper()}', QJAX_KERNEL_ISA=a.isa)
    r = subprocess.run([sys.executable, '-m', 'benchmarks.cpu_kernel_bench', '--child',
                        f'--rows={",".join(rows)}', f'--steps={a.steps}',
                        f'--repeats={a.repeats}'], env=env, stdout=subprocess.PIPE, check=True,
                       text=True)
    results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
  modes = list(results)
  print('| row | ' + ' | '.join(f'{m} tok/s | {m} vs f32' for m in modes) + ' |')
  print('|---|' + '---|---|' * len(modes))
  for row in rows:
    cells = []
    for m in modes:
      t = results[m]['tok_s']
      cells += [f'{t[row]:.1f}', f'{t[row] / t["f32"]:.2f}x']
    print(f'| {row} | ' + ' | '.join(cells) + ' |')
  for m in modes:
    print(f'{m}: kernels.info() = {results[m]["kernel"]}; load average after '
          f'{results[m]["load"]}')


if __name__ == '__main__':
  main()
