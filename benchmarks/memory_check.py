"""The memory planner (qjax.eval.memory) against measured bytes on Gemma 3 270M.

    XLA_FLAGS= .venv/bin/python -m benchmarks.memory_check

For float32, int8 per channel (embedding float), int4 g128 (everything) and int3 g128 with
an int8 KV cache: predicted vs measured weights (codes + scales + zero points + float
leftovers, from the device buffers), KV cache at batch 4 x 4096 tokens, and one decode
step's temp (XLA's compiled memory analysis; the planner's activation estimate). Prints one
table with the ratios; exits non-zero unless weights and KV are within 5%. Quality and bytes
do not depend on machine load; run time does (~3 min on 2 loaded cores, peak RSS ~3 GB).
"""

from __future__ import annotations

import sys
import time

from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import int_format
from qjax.eval import memory
from qjax.nn import QuantPolicy, QuantRule, quantize_model, with_kv_format

BATCH, CONTEXT = 4, 4096
POLICIES = {
    'float32': (None, None),
    'int8 (embed float)': (QuantPolicy((QuantRule('embed', exempt=True),
                                        QuantRule('.*', int_format(8)))), None),
    'int4 g128 (all)': (QuantPolicy((QuantRule('.*', int_format(4, group_size=128)),)), None),
    'int3 g128 + int8 KV': (QuantPolicy((QuantRule('.*', int_format(3, group_size=128)),)),
                            'int8'),
}


def main() -> int:
  t0 = time.perf_counter()
  model, _, _ = load_gemma3_270m()
  cfg = model.config
  lines = ['| policy | weights predicted | measured | ratio | KV predicted | measured | ratio |'
           ' decode temp: planner estimate | XLA | ratio |', '|---|---|---|---|---|---|---|---|---|---|']
  ok = True
  for name, (policy, kv) in POLICIES.items():
    qmodel = model if policy is None else quantize_model(model, policy)[0]
    if kv:
      qmodel = with_kv_format(qmodel, kv)
    pred = memory.predict(cfg, policy, batch=BATCH, context=CONTEXT, prompt=1, kv=kv)
    meas = memory.measure(qmodel, batch=BATCH, context=CONTEXT, compiled=False)
    dec = memory.compiled_memory(qmodel, BATCH, 1, CONTEXT)
    rw = pred.weights['total'] / meas['weights']['total']
    rk = pred.kv / meas['kv']
    ok &= abs(rw - 1) <= 0.05 and abs(rk - 1) <= 0.05
    lines.append(f"| {name} | {pred.weights['total'] / 1e6:.2f} MB | "
                 f"{meas['weights']['total'] / 1e6:.2f} MB | {rw:.4f} | {pred.kv / 1e6:.2f} MB | "
                 f"{meas['kv'] / 1e6:.2f} MB | {rk:.4f} | {pred.decode_activations / 1e6:.2f} MB"
                 f" | {dec['temp'] / 1e6:.2f} MB | {pred.decode_activations / dec['temp']:.3f} |")
    print(lines[-1], flush=True)
    del qmodel
  fits = memory.what_fits(cfg, 2 * 2**30, {k: v[0] for k, v in POLICIES.items()}, batch=1,
                          context=8192)
  print('\n'.join(['', f'Gemma 3 270M, batch {BATCH} x {CONTEXT} tokens (float32 KV unless '
                   'stated):'] + lines))
  print('\nWhat fits in 2 GiB (float32 KV; decode, the cache at full length):')
  for k, v in fits.items():
    print(f"  {k}: weights {v['weights'] / 1e6:.1f} MB, max batch at 8192 tokens "
          f"{v['max_batch']}, max context at batch 1 {v['max_context']}")
  print(f"\n{'PASS' if ok else 'FAIL'}: weights and KV within 5% of the device bytes "
        f'({time.perf_counter() - t0:.0f} s)')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
