"""The device check: what qjax costs on the machine it runs on, written as JSON, markdown, PNG.

    python -m benchmarks.device_check [--smoke] [--out=results/device_check]
        [--models=llama32_1b,gemma3_270m]
        [--formats=bf16,int4,int4_pallas,int4_packed,w8a8,int8,fp8,fp8xfp8]
        [--batches=1,8,64] [--engine=bf16,w8a8] [--engine_kv=int8] [--budget_s=340]
        [--cache_dir=OUT/compile_cache]

For each model shape (`benchmarks/check_models.py`: synthetic weights, the cost, not the
quality) and weight format it measures, on the default backend:
  * prefill: one (1, P) prompt through `generate.greedy_step` (P = 512), median of 3;
  * decode, host loop: `generate.greedy_step` called once per token from Python, as a user's
    loop does (a 128-token context, 64 steps), at the `--host_batches` (default 1);
  * decode, device loop: `generate.decode_steps`, the same step run `steps` times inside one
    jitted `lax.while_loop` (what `greedy_generate` runs), so the time is the device's,
    without per-step dispatch (what the step itself costs);
  * weight bytes (the state's device buffers: packed codes count what they hold), the fraction
    of the HBM-bandwidth bound each decode step reaches ((weight bytes + the KV bytes a step
    must read) / the chip's bandwidth from `qjax.costmodel`, over the step's time), device
    memory from `jax.Device.memory_stats()` (on CPU: none, said so), the decode step's temp
    bytes and the compile seconds of the row's executables;
  * beside every timed program, the compiler's prediction for that same executable
    (`benchmarks/predicted.py`): bytes accessed, flops, temp bytes and, on a chip in
    `qjax.costmodel`'s table, the roofline ms (max(bytes / HBM bandwidth, flops / peak)) and
    measured / predicted. On CPU there is no chip preset: the bytes and flops, no roofline.
  * HF transformers bf16 on the same device in the same run, when `torch` and `transformers`
    import and torch sees the device (`benchmarks/hf_rows.py`);
  * the serving engine's rows (`--engine` formats, `benchmarks/engine_rows.py`): decode
    tokens/s of `qjax.infer.Engine` at 8 rows in decode blocks, beside the bare
    `decode_steps` loop and HF eager `generate` at batch 8; a quantized format's row keeps its
    paged KV in `--engine_kv` (int8).

Compiles are few: each row compiles the programs it times and nothing else (prefill, the host
loop's step, one device loop per batch; the decode step's temp bytes and every prediction are
read from those executables, which the check counts), and jax's persistent compilation cache
(`--cache_dir`, default `<out>/compile_cache`; '' for none) keeps every executable, so a
second run loads what the first compiled.

`--budget_s` (default 340 s) bounds the whole check. Rows run in order (`row_order`: every
model's HF and bf16 rows, the engine rows, the other formats, then the comparison forms
int4_pallas, int4_packed and fp8xfp8) while the longest row so far still fits before the
attention section's share (`--attention_budget_s`, 90 s) of it; the rest are listed as not
run. Results are written after every row (`device_check.json`), so a run stopped from outside
keeps what it measured. Then the attention section (`--attention=yes`, default), within what
is left of the budget: `benchmarks/attention_timing.py`'s prefill and paged decode attention,
before and after the fused forms, at 2k/8k/32k context. `--smoke`: tiny shapes of both
models, batches 1 and 2, a few steps: proves every row runs, on CPU, in about a minute
(tests/benchmarks runs it).

The int4 rows compare the ways a 4-bit weight reaches the matmul (docs/quantized_matmul.md):
'int4' in the backend's default layout (native jnp.int4 codes on GPU/TPU, path 'native'),
'int4_pallas' (packed codes, the Pallas kernel at decode shapes) and 'int4_packed' (packed
codes unpacked by XLA ops, path 'dequant': the form before native codes). Grouped native
weights fuse into the GEMM on GPU only with
XLA_FLAGS=--xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true: run the check
once with and once without it to see what the flag buys.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import json
import os
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import attention_timing, check_models, compile_cache, engine_rows, hf_rows
from benchmarks import predicted
from benchmarks.budget import Budget
from benchmarks.check_models import (COMPARISON_FORMATS, DESCRIPTIONS, EIGHT_BIT_DOTS, FORMATS,
                                     INT4_VARIANTS, Protocol, build, decode_cache, int4_group,
                                     kv_bytes_per_token, model_config, state_bytes)
from benchmarks.device_check_page import pairs, render
from benchmarks.device_env import chip_for, chip_name, environment
from qjax.core import choose_path
from qjax.eval.process import device_memory
from qjax.nn import generate, kvcache
from qjax.nn.attention import kv_format

ENGINE_FORMATS = ('bf16', 'w8a8')


def row_order(models, formats, hf: bool, engine=()) -> list[tuple[str, str]]:
  """(model, row) in the order the rows run: every model's HF (when `hf`) and bf16 rows, the
  engine rows ('engine <format>'), every model's other formats not in COMPARISON_FORMATS, in
  the order given; then the comparison forms."""
  base = [(m, f) for m in models
          for f in (['hf-bf16'] if hf else []) + (['bf16'] if 'bf16' in formats else [])]
  serve = [(m, f'engine {f}') for m in models for f in engine]
  rest = [(m, f) for m in models for f in formats if f != 'bf16' and f not in COMPARISON_FORMATS]
  return base + serve + rest + [(m, f) for m in models for f in formats
                                if f in COMPARISON_FORMATS]


def run_qjax(model_name: str, fmt: str, p: Protocol, smoke: bool, threads: int) -> dict:
  """One qjax row: build, quantize, compile (in `threads` threads), time, predict."""
  dev = jax.devices()[0]
  mem0 = device_memory(dev)
  t0 = time.perf_counter()
  cfg, model, pol, layout = build(model_name, fmt, smoke)
  gc.collect()
  row = {'model': model_name, 'format': fmt, 'description': DESCRIPTIONS[fmt],
         'group': int4_group(cfg) if fmt in INT4_VARIANTS else None,
         'layout': None if pol is None else layout,
         'path': None if pol is None else (pol.path if pol.path != 'auto' else choose_path(
             pol.rules[0].weight, pol.rules[0].act, layout=layout)),
         'build_s': time.perf_counter() - t0, 'weight_bytes': state_bytes(model),
         'kv_bytes_per_token': kv_bytes_per_token(cfg, model)}
  mem1 = device_memory(dev)
  if mem0 and mem1:
    row['device_bytes_in_use_after_load'] = mem1['in_use'] - mem0['in_use']
  rng = np.random.default_rng(0)
  prefill_ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, p.prefill)), jnp.int32)
  first = {b: jnp.asarray(rng.integers(3, cfg.vocab_size, (b,)), jnp.int32) for b in p.batches}
  prefill_cache = lambda: kvcache.init_cache(cfg, 1, p.prefill + 1, fmt=kv_format(model))

  def prefill_once():
    cache = prefill_cache()
    t = time.perf_counter()
    jax.block_until_ready(generate.greedy_step(model, prefill_ids, cache)[0])
    return time.perf_counter() - t

  def host_loop(b: int, steps: int) -> float:
    cache, tok = decode_cache(cfg, model, b, p), first[b]
    t = time.perf_counter()
    for _ in range(steps):
      tok, cache = generate.greedy_step(model, tok[:, None], cache)
    jax.block_until_ready(tok)
    return time.perf_counter() - t

  def device_loop(b: int) -> float:
    cache = jax.block_until_ready(decode_cache(cfg, model, b, p))
    t = time.perf_counter()
    jax.block_until_ready(generate.decode_steps(model, first[b], cache, p.steps)[0])
    return time.perf_counter() - t

  # Warm-up = compile: every program the row times, once, in parallel threads (XLA compiles
  # outside the GIL); the row's compile seconds are this phase's wall time.
  host_batches = [b for b in p.batches if b in p.host_batches]
  jobs = [prefill_once] + [functools.partial(host_loop, b, 1) for b in host_batches] + [
      functools.partial(device_loop, b) for b in p.batches]
  with compile_cache.Counter() as counted:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
      list(pool.map(lambda f: f(), jobs))
    row['compile_s'] = time.perf_counter() - t0
  row.update(executables=len(jobs), xla_compiles=counted.compiles,
             cache_hits=counted.cache_hits)

  with compile_cache.Counter() as timed:
    prefill_s = statistics.median(prefill_once() for _ in range(p.reps))
    row.update(prefill_tokens=p.prefill, prefill_ms=1e3 * prefill_s,
               prefill_tok_s=p.prefill / prefill_s)
    chip = chip_for(dev)
    context = p.prompt + p.steps / 2
    for b in p.batches:
      dev_s = min(device_loop(b) for _ in range(2)) / p.steps
      row[f'b{b}'] = cell = {'device_loop_ms': 1e3 * dev_s, 'device_loop_tok_s': b / dev_s}
      if b in host_batches:
        host_s = min(host_loop(b, p.steps) for _ in range(2)) / p.steps
        cell.update(host_loop_ms=1e3 * host_s, host_loop_tok_s=b / host_s)
      if chip is not None:
        bound = (row['weight_bytes'] + b * context * row['kv_bytes_per_token']) / chip.hbm_bw
        cell['bound_ms'] = 1e3 * bound
        cell['hbm_fraction_device_loop'] = bound / dev_s
        if 'host_loop_ms' in cell:
          cell['hbm_fraction_host_loop'] = bound / host_s
  row['compiles_while_timed'] = timed.compiles + timed.cache_hits
  row['predicted'] = _predict(model, cfg, fmt, p, prefill_ids, prefill_cache, first,
                              host_batches, row)
  mem2 = device_memory(dev)
  if mem2:
    row['device_peak_bytes_so_far'] = mem2['peak']
  row['memory_source'] = 'device memory_stats()' if mem2 else 'none on this backend'
  return row


def _predict(model, cfg, fmt, p, prefill_ids, prefill_cache, first, host_batches,
             row) -> dict:
  """The compiler's prediction for every program the row timed, from the executables it
  compiled (`row['prediction_compiles']` counts any it had to compile again); the decode
  step's temp bytes from the host loop's step (else the first device loop)."""
  chip, bits = chip_name(jax.devices()[0]), 8 if fmt in EIGHT_BIT_DOTS else 16
  out = {}
  with compile_cache.Counter() as extra:
    out['prefill'] = predicted.prediction(
        predicted.greedy_step_program(model, prefill_ids, prefill_cache()),
        f'prefill {p.prefill}', chip, bits)
    for b in host_batches:
      out[f'step_b{b}'] = predicted.prediction(
          predicted.greedy_step_program(model, first[b][:, None],
                                        decode_cache(cfg, model, b, p)),
          f'greedy_step b{b}', chip, bits)
    for b in p.batches:
      out[f'loop_b{b}'] = predicted.prediction(
          predicted.decode_steps_program(model, first[b], decode_cache(cfg, model, b, p),
                                         p.steps), f'decode_steps loop b{b}', chip, bits)
  row['prediction_compiles'] = extra.compiles + extra.cache_hits
  step = out.get(f'step_b{host_batches[0]}') if host_batches else None
  row['decode_step_temp_bytes'] = (step or out[f'loop_b{p.batches[0]}'])['temp_bytes']
  row['decode_step_temp_source'] = 'greedy_step' if step else 'decode_steps loop'
  return out


def _names(text: str, known, what: str) -> list[str]:
  names = [x.strip() for x in text.split(',') if x.strip() and x.strip() != 'no']
  for x in names:
    if x not in known:
      raise SystemExit(f'device_check: {what} {x!r} is unknown; use some of {known}.')
  return names


def _hf_at(result: dict, model_name: str, b: int, hf_why: Optional[str], p, smoke) -> dict:
  """HF eager decode at batch b: the HF row's cell where it timed b, else timed now."""
  row = next((r for r in result['rows']
              if r['model'] == model_name and r['format'] == 'hf-bf16'), None)
  if row is not None and f'b{b}' in row:
    return dict(row[f'b{b}'], source='the HF row')
  if hf_why is not None:
    return {'skipped': f'HF: {hf_why}'}
  return dict(hf_rows.decode_cell(model_name, b, p, smoke), source='timed here')


def _run_row(m: str, f: str, p, a, threads: int, hf_why, result) -> tuple[str, dict]:
  """('rows' or 'engine', the row) of todo entry (m, f)."""
  if f == 'hf-bf16':
    return 'rows', hf_rows.run_hf(m, p, a.smoke)
  if f.startswith('engine '):
    fmt = f.split()[1]
    kv = 'bf16' if fmt == 'bf16' else a.engine_kv
    row = engine_rows.run_engine(m, fmt, kv, p, a.smoke, chip_name(jax.devices()[0]))
    row['hf'] = _hf_at(result, m, p.engine_rows, hf_why, p, a.smoke)
    return 'engine', row
  return 'rows', run_qjax(m, f, p, a.smoke, threads)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--smoke', action='store_true', help='tiny shapes, a few steps (CPU, CI)')
  ap.add_argument('--out', default='results/device_check')
  ap.add_argument('--models', default=','.join(check_models.MODELS))
  ap.add_argument('--formats', default=','.join(FORMATS))
  ap.add_argument('--batches', default=None, help='default 1,8,64 (smoke: 1,2)')
  ap.add_argument('--host_batches', default='1',
                  help='batches also timed as a Python loop of greedy_step (each one more '
                       'executable to compile per row; the device loop runs at every batch)')
  ap.add_argument('--engine', default=','.join(ENGINE_FORMATS),
                  help="formats of the serving engine's rows ('' or no: none)")
  ap.add_argument('--engine_kv', default='int8',
                  help="the paged KV format of a quantized format's engine row")
  ap.add_argument('--hf', default='auto', choices=('auto', 'no'))
  ap.add_argument('--budget_s', type=float, default=340.0,
                  help='seconds for the whole check, rows and attention section together')
  ap.add_argument('--attention', default='yes', choices=('yes', 'no'),
                  help='the attention section (benchmarks/attention_timing.py) after the rows')
  ap.add_argument('--attention_budget_s', type=float, default=90.0,
                  help='the part of --budget_s kept for the attention section')
  ap.add_argument('--threads', type=int, default=None,
                  help='compile threads per row (default: min(8, cores))')
  ap.add_argument('--cache_dir', default=None,
                  help="jax's persistent compilation cache (default <out>/compile_cache; '' "
                       'for none)')
  ap.add_argument('--render', default=None,
                  help='comma-separated device_check.json files: merge their rows and write '
                       'the markdown and plot to --out (nothing is measured)')
  a = ap.parse_args(argv)
  if a.render:
    return render([json.load(open(f)) for f in a.render.split(',')], a.out)
  start = time.perf_counter()
  batches = tuple(int(b) for b in (a.batches or ('1,2' if a.smoke else '1,8,64')).split(','))
  host_batches = tuple(int(b) for b in a.host_batches.split(',') if b.strip())
  p = (Protocol(prefill=32, prompt=16, steps=4, batches=batches, reps=1,
                host_batches=host_batches, engine_block=2) if a.smoke else
       Protocol(prefill=512, prompt=128, steps=64, batches=batches, reps=3,
                host_batches=host_batches))
  threads = a.threads or min(8, os.cpu_count() or 1)
  models = [m.strip() for m in a.models.split(',') if m.strip()]
  for m in models:
    model_config(m, a.smoke)  # unknown names fail before anything runs
  formats = _names(a.formats, FORMATS, 'format')
  engine = _names(a.engine, FORMATS, 'engine format')
  hf_why = hf_rows.hf_available() if a.hf == 'auto' else 'not asked for (--hf=no)'
  todo = row_order(models, formats, hf_why is None, engine)
  os.makedirs(a.out, exist_ok=True)
  cache_dir = os.path.join(a.out, 'compile_cache') if a.cache_dir is None else a.cache_dir
  with compile_cache.persistent(cache_dir) as cache_path, compile_cache.Counter() as run:
    env = environment()
    env['compilation_cache'] = {'dir': cache_path, 'min_compile_time_s': 0.0,
                                'min_entry_bytes': -1}
    if cache_path is None:
      env['compilation_cache']['off'] = ('--cache_dir is empty' if not cache_dir else
                                         'jax_enable_compilation_cache is false')
    result = {'environment': env, 'protocol': dataclasses.asdict(p), 'rows': [], 'engine': [],
              'hf': hf_why or 'run', 'not_run': [], 'smoke': a.smoke}
    json_path = os.path.join(a.out, 'device_check.json')

    def save():
      result['wall_s'] = time.perf_counter() - start
      env['compilation_cache'].update(xla_compiles=run.compiles, cache_hits=run.cache_hits)
      with open(json_path, 'w') as fh:
        json.dump(result, fh, indent=1, default=str)

    budget = Budget(a.budget_s)
    rows_until = a.budget_s - (a.attention_budget_s if a.attention == 'yes' else 0.0)
    for i, (m, f) in enumerate(todo):
      row_start = time.perf_counter()
      if not budget.fits(rows_until):
        result['not_run'] = [f'{m} {f}' for m, f in todo[i:]]
        break
      print(f'device_check: {m} {f} ...', flush=True)
      try:
        kind, row = _run_row(m, f, p, a, threads, hf_why, result)
        row['measured_vs_predicted'] = pairs(row)
      except Exception as e:  # pylint: disable=broad-except
        kind = 'engine' if f.startswith('engine ') else 'rows'
        row = {'model': m, 'format': f.split()[-1], 'error': f'{type(e).__name__}: {e}'[:300]}
        if a.smoke:
          raise
      result[kind].append(row)
      save()
      jax.clear_caches()
      gc.collect()
      budget.ran(row_start)
    if a.attention == 'yes':
      print('device_check: attention ...', flush=True)
      chip = chip_for(jax.devices()[0])
      result['attention'] = attention_timing.measure(
          smoke=a.smoke, models=models, kvs=('int8',) if a.smoke else ('int8', 'bf16'),
          budget_s=max(0.0, a.budget_s - budget.elapsed()),
          hbm_bw=chip and chip.hbm_bw)
    save()
  return render([result], a.out)


if __name__ == '__main__':
  main()
