"""The serving engine's rows of the device check: decode tokens/s at 8 rows, beside the bare
decode loop (and HF transformers eager, which the device check adds) at the same batch.

A row builds one model shape in one weight format, its KV in `kv` (a quantized format's row
stores a quantized paged KV), and times at `Protocol.engine_rows` (8) rows:
  * the engine: `qjax.infer.Engine` with max_batch 8 and decode blocks of
    `Protocol.engine_block` steps serving 8 greedy requests of a `prompt`-token prompt and
    `steps` + 1 output tokens. The prefill is not timed; the decode steps after it are, as
    the engine runs them (planning, block dispatch, readback and booking on the host), the
    best of `reps` servings;
  * the bare loop: `generate.decode_steps` at batch 8 over a contiguous cache of the same KV
    format and about the same length (`Protocol.context` positions; the engine's page tables
    cover the same), the steps in one jitted loop, best of 2.

Compiles: a warm-up serving of the same requests compiles what the timed ones run (the
prefill step's bucket and the decode block, two executables, where `Engine.compile_buckets()`
would compile every bucket), and the bare loop one more, in parallel threads. The compiler's
prediction for the engine is read from the executable of its first decode block (`_Engine`).
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from benchmarks import check_models, compile_cache, predicted
from benchmarks.check_models import Protocol
from qjax import infer
from qjax.infer import engine_block
from qjax.nn import generate, set_kv_format

PAGE_SIZE = 16


class _Engine(infer.Engine):
  """An `Engine` that keeps its first decode block's executable: lowered and compiled just
  before that dispatch, which then finds it in jax's cache (no executable is added)."""

  block_program = None

  def _dispatch(self, fn, *args):
    if fn is engine_block.decode_block and self.block_program is None:
      self.block_program = fn.lower(*args).compile()
    return super()._dispatch(fn, *args)


def _serve(engine: infer.Engine, prompts, params) -> dict:
  """Serve `prompts`; time the decode steps after their prefill (the engine's own split of
  that time from `EngineStats`)."""
  ids = [engine.add_request(x, params) for x in prompts]
  while not all(engine.output(i) for i in ids):  # prefill: every request has its first token
    engine.step()
  st = engine.stats
  before = (st.steps, st.decode_tokens, st.dispatches, st.host_s, st.dispatch_s, st.wait_s)
  t0 = time.perf_counter()
  while engine.scheduler.has_work:
    engine.step()
  wall = time.perf_counter() - t0
  steps = max(st.steps - before[0], 1)
  tokens = st.decode_tokens - before[1]
  return {'ms_per_step': 1e3 * wall / steps, 'tok_s': tokens / wall, 'steps': steps,
          'tokens': tokens, 'dispatches': st.dispatches - before[2],
          'host_ms_per_step': 1e3 * (st.host_s - before[3]) / steps,
          'dispatch_ms_per_step': 1e3 * (st.dispatch_s - before[4]) / steps,
          'wait_ms_per_step': 1e3 * (st.wait_s - before[5]) / steps}


def run_engine(model_name: str, fmt: str, kv: str, p: Protocol, smoke: bool, chip) -> dict:
  """One engine row (module docstring); `chip`: the costmodel preset name, or None."""
  cfg, model, _, _ = check_models.build(model_name, fmt, smoke)
  set_kv_format(model, None if kv == 'bf16' else kv)
  rows, rng = p.engine_rows, np.random.default_rng(0)
  pages = -(-p.context // PAGE_SIZE)
  engine = _Engine(model, infer.EngineConfig(
      max_batch=rows, page_size=PAGE_SIZE, num_pages=rows * pages + 1, max_len=p.context,
      decode_block=p.engine_block))
  prompts = [rng.integers(3, cfg.vocab_size, p.prompt).tolist() for _ in range(rows)]
  params = infer.SamplingParams(temperature=0.0, max_tokens=p.steps + 1)
  first = jax.numpy.asarray(rng.integers(3, cfg.vocab_size, (rows,)), jax.numpy.int32)

  def bare_loop() -> float:
    cache = jax.block_until_ready(check_models.decode_cache(cfg, model, rows, p))
    t = time.perf_counter()
    jax.block_until_ready(generate.decode_steps(model, first, cache, p.steps)[0])
    return time.perf_counter() - t

  row = {'model': model_name, 'format': fmt, 'kv': kv, 'rows': rows,
         'decode_block': p.engine_block, 'steps': p.steps, 'context': p.context}
  with compile_cache.Counter() as counted:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      list(pool.map(lambda f: f(), [lambda: engine.generate(prompts, params), bare_loop]))
    row['compile_s'] = time.perf_counter() - t0
  row.update(xla_compiles=counted.compiles, cache_hits=counted.cache_hits)
  with compile_cache.Counter() as timed:
    served = [_serve(engine, prompts, params) for _ in range(max(1, min(2, p.reps)))]
    row['engine'] = min(served, key=lambda s: s['ms_per_step'])
    loop_s = min(bare_loop() for _ in range(2)) / p.steps
    row['bare_loop'] = {'ms_per_step': 1e3 * loop_s, 'tok_s': rows / loop_s}
  row['compiles_while_timed'] = timed.compiles + timed.cache_hits
  bits = 8 if fmt in check_models.EIGHT_BIT_DOTS else 16
  with compile_cache.Counter() as extra:
    loop = predicted.decode_steps_program(
        model, first, check_models.decode_cache(cfg, model, rows, p), p.steps)
    row['predicted'] = {
        'engine_block': predicted.prediction(engine.block_program, 'engine decode block',
                                             chip, bits),
        f'loop_b{rows}': predicted.prediction(loop, f'decode_steps loop b{rows}', chip, bits)}
  row['prediction_compiles'] = extra.compiles + extra.cache_hits
  return row
