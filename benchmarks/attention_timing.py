"""Attention alone, before and after the fused forms: per prefill and per decode step.

    python -m benchmarks.attention_timing [--smoke] [--out=results/attention_timing]
        [--models=llama32_1b,gemma3_270m] [--contexts=2048,8192,32768] [--batch=32]
        [--kv=int8,bf16] [--budget_s=240]

For one global attention layer of each model shape (queries already projected; bf16):
  * prefill: T queries over their own T keys, causal, batch 1. 'before' is the blockwise
    scan (`attend_blockwise`, O(T) memory); 'after' is what `attention_impl='fused'` runs on
    this platform (`qjax.nn.attention_forms.choose_form`: cuDNN flash attention, splash, or
    `jax.nn.dot_product_attention` on CPU, whose T x S logits are skipped past `--dense_cap`).
  * decode: one query per row over a paged cache holding `context` positions per row (page
    size 16, pages shuffled), `--batch` rows, KV pools in each `--kv` format. 'before' is
    the gather + online-softmax scan, 'after' the Pallas paged attention kernel
    (`qjax.kernels.paged_attention`); on CPU the kernel runs only in interpret mode, so it is
    checked for agreement, not timed. The bytes bound is the KV bytes a step reads over the
    chip's HBM bandwidth (`qjax.costmodel`; none on CPU).
Each cell: median milliseconds of `reps` calls after a warm-up, the compiled temp bytes
(XLA's memory analysis), and the form that ran. `--smoke`: tiny shapes, both models, every
cell, in seconds (tests/benchmarks runs it); benchmarks/device_check.py runs this as its
attention section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.budget import Budget
from benchmarks.device_env import chip_for, environment
from qjax.infer import init_paged_cache, with_step
from qjax.infer.paged_kernel import attention_form
from qjax.nn import TransformerConfig, attend_blockwise
from qjax.nn.attention_forms import choose_form, fused_attend

MODELS = ('llama32_1b', 'gemma3_270m')
PAGE_SIZE = 16


def layer_config(name: str, smoke: bool) -> TransformerConfig:
  """One global layer of model shape `name` (tiny heads in smoke mode), bf16."""
  if name == 'llama32_1b':
    cfg = TransformerConfig.llama_like(tie_embeddings=True)
  elif name == 'gemma3_270m':
    cfg = TransformerConfig.gemma3_270m()
  else:
    raise ValueError(f'attention_timing: model {name!r} is unknown; use one of {MODELS}.')
  cfg = cfg.replace(num_layers=1, sliding_window=None, global_every=None, dtype='bfloat16',
                    max_len=1 << 16)
  if smoke:
    cfg = cfg.replace(num_heads=4, num_kv_heads=2 if name == 'llama32_1b' else 1,
                      head_dim=32 if name == 'llama32_1b' else 64)
  return cfg


def _time(fn, args, reps: int) -> tuple[float, int]:
  """(median ms of `reps` calls after a warm-up, compiled temp bytes) of jitted `fn`."""
  jitted = jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), temp


def prefill_cells(cfg: TransformerConfig, t: int, reps: int, dense_cap: int) -> dict:
  """'before' (blockwise) and 'after' (the fused form here) of one causal prefill of T."""
  ks = jax.random.split(jax.random.key(0), 3)
  n, kh, h, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16
  q = (jax.random.normal(ks[0], (1, t, n, h)) * cfg.scale_q).astype(dt)
  k = jax.random.normal(ks[1], (1, t, kh, h)).astype(dt)
  v = jax.random.normal(ks[2], (1, t, kh, h)).astype(dt)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  form = choose_form('fused', t=t, dtype=dt, head_dim=h)
  cells = {'form': form.name, 'reason': form.reason}
  ms, temp = _time(lambda q, k, v, p: attend_blockwise(q, k, v, p, p,
                                                       block_size=cfg.attention_block),
                   (q, k, v, pos), reps)
  cells['before'] = {'form': 'blockwise', 'ms': ms, 'temp_bytes': temp}
  logits_bytes = n * t * t * 4
  if form.name == 'sdpa_xla' and logits_bytes > dense_cap:
    cells['after'] = {'form': form.name, 'skipped': f'T x S logits take {logits_bytes / 2**30:.1f}'
                      f' GiB > --dense_cap'}
  elif form.name == 'blockwise':
    cells['after'] = dict(cells['before'])
  else:
    ms, temp = _time(lambda q, k, v, p: fused_attend(form.name, q, k, v, p, p,
                                                     block_size=cfg.attention_block),
                     (q, k, v, pos), reps)
    cells['after'] = {'form': form.name, 'ms': ms, 'temp_bytes': temp}
  if 'ms' in cells['after']:
    cells['speedup'] = cells['before']['ms'] / cells['after']['ms']
  return cells


def decode_cells(cfg: TransformerConfig, context: int, batch: int, kv: str, reps: int,
                 hbm_bw: Optional[float]) -> dict:
  """'before' (scan) and 'after' (kernel) of one decode step's paged attention."""
  per_row = -(-(context + 1) // PAGE_SIZE)
  fmt = None if kv == 'bf16' else kv
  cache = init_paged_cache(cfg, num_pages=batch * per_row + 1, page_size=PAGE_SIZE,
                           batch=batch, max_pages=per_row, dtype=jnp.bfloat16, fmt=fmt)
  rng = np.random.default_rng(0)
  table = (1 + rng.permutation(batch * per_row)).reshape(batch, per_row)
  fill = lambda x: jax.tree.map(  # random codes / values, valid scales
      lambda a: (jnp.asarray(rng.uniform(0.01, 0.1, a.shape), a.dtype) if a.ndim and
                 a.shape[-1] == 1 else jnp.asarray(rng.integers(-7, 8, a.shape), a.dtype)), x)
  cache = dataclasses.replace(cache, k=(fill(cache.k[0]),), v=(fill(cache.v[0]),))
  cache = with_step(cache, table, np.zeros((batch, 0)), [context] * batch, [1] * batch)
  q = (jax.random.normal(jax.random.key(1), (batch, 1, cfg.num_heads, cfg.head_dim))
       * cfg.scale_q).astype(jnp.bfloat16)
  pos = cache.positions(1)
  pool_bytes = sum(x.nbytes for x in jax.tree.leaves((cache.k[0], cache.v[0])))
  read = pool_bytes / (cache.k[0].shape[0] * PAGE_SIZE) * batch * (context + 1)  # K+V seen
  cells = {'kv_bytes_read': int(read)}

  def run(mode, fn):
    """fn() with QJAX_PAGED_ATTENTION=mode while it traces (the variable restored after)."""
    old = os.environ.get('QJAX_PAGED_ATTENTION')
    os.environ['QJAX_PAGED_ATTENTION'] = mode
    try:
      return fn()
    finally:
      if old is None:
        os.environ.pop('QJAX_PAGED_ATTENTION')
      else:
        os.environ['QJAX_PAGED_ATTENTION'] = old
  # A new function per trace: jit caches traces by function, and the mode is read while tracing.
  attend = lambda: lambda c, q, p: c.attend(0, q, p)
  timed = lambda: _time(attend(), (cache, q, pos), reps)
  ms, temp = run('scan', timed)
  cells['before'] = {'form': 'scan', 'ms': ms, 'temp_bytes': temp}
  form = run('auto', lambda: attention_form(cache.k[0], 1))
  if form.name == 'kernel':
    ms, temp = run('kernel', timed)
    cells['after'] = {'form': f'kernel ({form.backend})', 'ms': ms, 'temp_bytes': temp}
    cells['speedup'] = cells['before']['ms'] / ms
  else:  # checked in interpret mode, not timed
    got = run('interpret', lambda: jax.jit(attend())(cache, q, pos))
    want = run('scan', lambda: jax.jit(attend())(cache, q, pos))
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    cells['after'] = {'form': 'kernel (interpret)', 'skipped': form.reason,
                      'max_abs_diff_vs_scan': err}
  if hbm_bw:
    for side in ('before', 'after'):
      if 'ms' in cells[side]:
        cells[side]['bytes_bound_fraction'] = read / hbm_bw / (cells[side]['ms'] / 1e3)
  return cells


def measure(*, smoke: bool, models=MODELS, contexts=None, batch: Optional[int] = None,
            kvs=('int8', 'bf16'), budget_s: float = 240.0, dense_cap: int = 2 << 30,
            hbm_bw: Optional[float] = None) -> dict:
  """Every cell in order while one as long as the longest so far still fits in `budget_s`:
  {'prefill': [...], 'decode': [...], 'not_run': [...]}."""
  contexts = contexts or ((64,) if smoke else (2048, 8192, 32768))
  batch = batch or (2 if smoke else 32)
  reps = 2 if smoke else 5
  start = time.perf_counter()
  out = {'prefill': [], 'decode': [], 'not_run': [], 'batch': batch, 'page_size': PAGE_SIZE}
  todo = [row for m in models for c in contexts
          for row in [('prefill', m, c, None)] + [('decode', m, c, kv) for kv in kvs]]
  budget = Budget(budget_s)
  for i, (what, m, c, kv) in enumerate(todo):
    cell_start = time.perf_counter()
    if not budget.fits():
      out['not_run'] = [' '.join(str(x) for x in row if x) for row in todo[i:]]
      break
    cfg = layer_config(m, smoke)
    print(f'attention_timing: {what} {m} {c} {kv or ""}', flush=True)
    cells = (prefill_cells(cfg, c, reps, dense_cap) if what == 'prefill' else
             decode_cells(cfg, c, batch, kv, reps, hbm_bw))
    out[what].append(dict(model=m, context=c, kv=kv, **cells))
    jax.clear_caches()
    budget.ran(cell_start)
  out['wall_s'] = time.perf_counter() - start
  return out


def _cell(c: dict) -> str:
  if 'ms' not in c:
    return f"{c['form']}: not timed"
  frac = f", {c['bytes_bound_fraction']:.0%} of bound" if 'bytes_bound_fraction' in c else ''
  return f"{c['form']} {c['ms']:.3g} ms, temp {c['temp_bytes'] / 2**20:.3g} MiB{frac}"


def _speedup(r: dict) -> str:
  return f"{r['speedup']:.2f}" if 'speedup' in r else '-'


def markdown(result: dict) -> str:
  """The tables of one `measure` result."""
  lines = ['### Prefill attention (one global layer, batch 1)', '',
           '| model | T | before | after | speedup |', '|---|---|---|---|---|']
  for r in result['prefill']:
    lines.append(f"| {r['model']} | {r['context']} | {_cell(r['before'])} | "
                 f"{_cell(r['after'])} | {_speedup(r)} |")
  lines += ['', f"### Paged decode attention (one global layer, batch {result['batch']}, "
            f"page {result['page_size']})", '',
            '| model | context | KV | before | after | speedup |', '|---|---|---|---|---|---|']
  for r in result['decode']:
    lines.append(f"| {r['model']} | {r['context']} | {r['kv']} | {_cell(r['before'])} | "
                 f"{_cell(r['after'])} | {_speedup(r)} |")
  if result['not_run']:
    lines += ['', 'Not run (budget): ' + ', '.join(result['not_run'])]
  return '\n'.join(lines) + '\n'


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--smoke', action='store_true', help='tiny shapes (CPU, CI)')
  ap.add_argument('--out', default='results/attention_timing')
  ap.add_argument('--models', default=','.join(MODELS))
  ap.add_argument('--contexts', default=None, help='default 2048,8192,32768 (smoke: 64)')
  ap.add_argument('--batch', type=int, default=None, help='decode rows (default 32; smoke 2)')
  ap.add_argument('--kv', default='int8,bf16', help='KV pool formats of the decode cells')
  ap.add_argument('--dense_cap', type=float, default=2.0,
                  help='GiB of T x S logits past which the CPU dense form is not run')
  ap.add_argument('--budget_s', type=float, default=240.0)
  a = ap.parse_args(argv)
  models = [m.strip() for m in a.models.split(',') if m.strip()]
  for m in models:
    layer_config(m, a.smoke)  # unknown names fail before anything runs
  contexts = tuple(int(c) for c in a.contexts.split(',')) if a.contexts else None
  chip = chip_for(jax.devices()[0])
  result = measure(smoke=a.smoke, models=models, contexts=contexts, batch=a.batch,
                   kvs=tuple(k.strip() for k in a.kv.split(',')), budget_s=a.budget_s,
                   dense_cap=int(a.dense_cap * 2**30), hbm_bw=chip and chip.hbm_bw)
  result['environment'] = environment()
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, 'attention_timing.json'), 'w') as fh:
    json.dump(result, fh, indent=1, default=str)
  text = markdown(result)
  with open(os.path.join(a.out, 'attention_timing.md'), 'w') as fh:
    fh.write(text)
  print(text)
  return result


if __name__ == '__main__':
  main()
