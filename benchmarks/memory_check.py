r"""The memory planner (qjax.eval.memory) against measured bytes, and the context limit.

    XLA_FLAGS= .venv/bin/python -m benchmarks.memory_check                # Gemma 3 270M
    XLA_FLAGS= .venv/bin/python -m benchmarks.memory_check --base=tiny    # seconds

For float32, int8 per channel (embedding float), int4 g128 (everything) and int3 g128 with
an int8 KV cache, at batch 4 and batch 1 x `--context` tokens: predicted vs measured weights
(codes + scales + zero points + float leftovers, from the device buffers) and KV cache, and
the activations of the prefill (`--prompt` tokens) and decode steps: the planner's estimate
and its compiled prediction (the step compiled from shapes alone, no weights built) against
XLA's memory analysis of the built model's step (temp + unaliased output).

Then the context limit under `--budget_gib` at each of `--context_batches` for float, RTN int8
(embedding float), int4 g128 (embedding float: the bytes of the GPTQ int4 g128 point) and, with
`--mixed_from` (a validation report holding a `mixed_precision.assignment`), that mixed
policy: the estimate's and the compiled planner's longest context, then the built model's
decode step compiled and run once there (`qjax.eval.validation.context_limit`).
Writes `--out` (JSON); exits non-zero unless weights and KV are within 5% and every
confirmed context fits. Bytes do not depend on machine load; run time does (~6 min for
Gemma on 2 loaded cores, peak RSS ~4.5 GB).
Expected result: weights and KV ratio 1.0000 in every row, compiled activations equal to
XLA's to the byte, and every context the compiled planner answers fits when run. The measured
run: docs/validation.md (the memory planner's section).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import app
from absl import flags
from flax import nnx

from qjax.core import int_format
from qjax.eval import memory
from qjax.eval import process
from qjax.eval import sensitivity as qsens
from qjax.eval.validation import context_limit
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, quantize_model,
                     with_kv_format)

_BASE = flags.DEFINE_enum('base', 'gemma3_270m', ['gemma3_270m', 'tiny'], 'the model')
_CONTEXT = flags.DEFINE_integer('context', 4096, 'cache length of the byte checks (tiny: 64)')
_PROMPT = flags.DEFINE_integer('prompt', 512, 'prefill tokens of the prefill check (tiny: 16)')
_BUDGET = flags.DEFINE_float('budget_gib', 1.5, 'context-limit budget (tiny: 0.0006); 0 skips')
_CTX_BATCH = flags.DEFINE_list('context_batches', ['1', '8'], 'batches of the context limit')
_MIXED = flags.DEFINE_string('mixed_from', 'docs/validation/mixed-at-int4-g128.json',
                             'a validation report with mixed_precision.assignment ("" skips)')
_OUT = flags.DEFINE_string('out', 'results/memory_check/memory_check.json', 'JSON written')


def policies(tiny: bool) -> dict:
  g = 32 if tiny else 128
  return {
      'float32': (None, None),
      'int8 (embed float)': (QuantPolicy((QuantRule('embed', exempt=True),
                                          QuantRule('.*', int_format(8)))), None),
      f'int4 g{g} (all)': (QuantPolicy((QuantRule('.*', int_format(4, group_size=g)),)), None),
      f'int3 g{g} + int8 KV': (QuantPolicy((QuantRule('.*', int_format(3, group_size=g)),)),
                               'int8'),
  }


def byte_rows(model, cfg, batches, context, prompt):
  rows = []
  for name, (policy, kv) in policies(_BASE.value == 'tiny').items():
    qmodel = model if policy is None else quantize_model(model, policy)[0]
    if kv:
      qmodel = with_kv_format(qmodel, kv)
    for b in batches:
      est = memory.predict(cfg, policy, batch=b, context=context, prompt=prompt, kv=kv)
      comp = memory.predict(cfg, policy, batch=b, context=context, prompt=prompt, kv=kv,
                            compiled=True)
      meas = memory.measure(qmodel, batch=b, context=context, prompt=prompt)
      xla = {k: memory.step_activations(meas[k]) for k in ('prefill', 'decode')}
      rows.append(dict(
          policy=name, batch=b, context=context, prompt=prompt,
          weights_predicted=est.weights['total'], weights_measured=meas['weights']['total'],
          kv_predicted=est.kv, kv_measured=meas['kv'],
          prefill_estimate=est.prefill_activations, prefill_compiled=comp.prefill_activations,
          prefill_xla=xla['prefill'], decode_estimate=est.decode_activations,
          decode_compiled=comp.decode_activations, decode_xla=xla['decode'],
          decode_temp_over_kv=meas['decode']['temp'] / meas['kv']))
      r = rows[-1]
      print(f"{name} b{b}: weights {r['weights_predicted'] / r['weights_measured']:.4f}, KV "
            f"{r['kv_predicted'] / r['kv_measured']:.4f}, decode estimate / XLA "
            f"{r['decode_estimate'] / r['decode_xla']:.3f}, compiled / XLA "
            f"{r['decode_compiled'] / r['decode_xla']:.4f}, XLA decode temp / KV "
            f"{r['decode_temp_over_kv']:.3f}", flush=True)
    del qmodel
  return rows


def context_rows(model, cfg, budget):
  g = 32 if _BASE.value == 'tiny' else 128
  points = {'float32': None,
            'RTN int8 (embed float)': QuantPolicy((QuantRule('embed', exempt=True),
                                                   QuantRule('.*', int_format(8)))),
            f'int4 g{g} (embed float; = GPTQ bytes)': QuantPolicy((
                QuantRule('embed', exempt=True), QuantRule('.*', int_format(4, group_size=g))))}
  if _MIXED.value and _BASE.value != 'tiny':
    rep = json.loads(pathlib.Path(_MIXED.value).read_text())
    points['mixed at int4 g128 bytes'] = qsens.policy_from_assignment(
        rep['mixed_precision']['assignment'], qsens.FORMATS)
  rows = []
  for name, policy in points.items():
    qmodel = model if policy is None else quantize_model(model, policy)[0]
    for b in (int(x) for x in _CTX_BATCH.value):
      ts = time.perf_counter()
      c = context_limit(qmodel, policy, budget_bytes=int(budget), batch=b)
      c['policy'], c['seconds'] = name, time.perf_counter() - ts
      rows.append(c)
      _print_ctx(name, c)
    del qmodel
  return rows


def _print_ctx(name, c):
  print(f"context limit {name} b{c['batch']}: estimate {c['estimate_max_context']}, compiled "
        f"planner {c['predicted_max_context']}; there predicted "
        f"{c.get('predicted_bytes', 0) / 2**30:.4f} GiB, compiled "
        f"{c.get('compiled_bytes', 0) / 2**30:.4f} GiB (fits: {c.get('confirmed')}); run peak "
        f"RSS above start {c.get('run_peak_rss_above_start', 0) / 2**30:.3f} GiB", flush=True)


def _md(rows, ctx) -> str:
  lines = ['| policy | batch | weights pred / meas | KV pred / meas | prefill act: estimate / '
           'compiled / XLA (MB) | decode act: estimate / compiled / XLA (MB) | XLA decode temp '
           '/ KV |', '|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(
        f"| {r['policy']} | {r['batch']} | {r['weights_predicted'] / 1e6:.2f} / "
        f"{r['weights_measured'] / 1e6:.2f} MB "
        f"({r['weights_predicted'] / r['weights_measured']:.4f})"
        f" | {r['kv_predicted'] / 1e6:.2f} / {r['kv_measured'] / 1e6:.2f} MB "
        f"({r['kv_predicted'] / r['kv_measured']:.4f}) | {r['prefill_estimate'] / 1e6:.1f} / "
        f"{r['prefill_compiled'] / 1e6:.1f} / {r['prefill_xla'] / 1e6:.1f} | "
        f"{r['decode_estimate'] / 1e6:.1f} / {r['decode_compiled'] / 1e6:.1f} / "
        f"{r['decode_xla'] / 1e6:.1f} | {r['decode_temp_over_kv']:.3f} |")
  if ctx:
    lines += ['', '| policy | batch | budget | estimate | compiled planner | predicted bytes | '
              'compiled bytes of the built step | error | fits | run: peak RSS above start |',
              '|---|---|---|---|---|---|---|---|---|---|']
    for c in ctx:
      lines.append(
          f"| {c['policy']} | {c['batch']} | {c['budget_bytes'] / 2**30:.3g} GiB | "
          f"{c['estimate_max_context']} "
          f"| {c['predicted_max_context']} | {c.get('predicted_bytes', 0) / 2**30:.4f} GiB | "
          f"{c.get('compiled_bytes', 0) / 2**30:.4f} GiB | {c.get('prediction_error', 0):+.2%} | "
          f"{c.get('confirmed')} | {c.get('run_peak_rss_above_start', 0) / 1e6:.0f} MB |")
  return '\n'.join(lines)


def main(_) -> int:
  t0 = time.perf_counter()
  tiny = _BASE.value == 'tiny'
  if tiny:
    cfg = TransformerConfig.tiny(max_len=256)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    context, prompt, budget = 64, 16, 0.0006 * 2**30
  else:
    from qjax.checkpoints.gemma3 import load_gemma3_270m  # pylint: disable=g-import-not-at-top
    model = load_gemma3_270m()[0]
    cfg = model.config
    context, prompt, budget = _CONTEXT.value, _PROMPT.value, _BUDGET.value * 2**30
  rows = byte_rows(model, cfg, (4, 1), context, prompt)
  ctx = context_rows(model, cfg, budget) if budget else []
  ok = all(abs(r['weights_predicted'] / r['weights_measured'] - 1) <= 0.05 and
           abs(r['kv_predicted'] / r['kv_measured'] - 1) <= 0.05 for r in rows)
  ok &= all(c.get('confirmed') for c in ctx)
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({'base': _BASE.value, 'rows': rows, 'context_limit': ctx,
                             'peak_rss': process.peak_rss_bytes(),
                             'seconds': time.perf_counter() - t0}, indent=1, default=str))
  print('\n' + _md(rows, ctx))
  print(f"\n{'PASS' if ok else 'FAIL'}: weights and KV within 5% of the device bytes, every "
        f'confirmed context fits ({time.perf_counter() - t0:.0f} s); wrote {out}')
  return 0 if ok else 1


if __name__ == '__main__':
  app.run(lambda argv: sys.exit(main(argv)))
