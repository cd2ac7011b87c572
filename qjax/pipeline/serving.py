"""Side-by-side serving comparison on one trace: batching, prefix caching, KV formats.

    rows = compare(model, trace, EngineConfig(...), ('continuous', 'static', 'prefix',
                                                     'kv_int8', 'kv_int4'))
    print(markdown_table(rows, COLUMNS)); plot(rows, 'serve.png'); print(ratios(rows))

Variants (each served from a fresh engine after a warm-up that compiles its step buckets,
so no row pays compilation):
- 'continuous': continuous batching, the float (model dtype) cache, no prefix caching.
- 'static': static batches on the same engine (`trace.replay(static=True)`), without the
  config's `prefill_budget` (a static batch prefills its padded prompts whole).
- 'prefix': continuous batching with prefix caching.
- 'kv_<fmt>' (int8, int4, fp8): continuous batching with a quantized cache whose pools take
  the bytes of the float pools (no more): more pages, so more concurrent sequences;
  `max_batch` grows to the sequences that fit (capped by `max_batch_limit`).
`experiments/serve.py --config=configs/serve_gemma3.py` runs it on Gemma 3 270M.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import numpy as np

from qjax.eval.report import figure, pyplot, save_figure
from qjax.infer import paged
from qjax.infer.engine import Engine, EngineConfig
from qjax.pipeline.trace import TraceRequest, replay

COLUMNS = (('variant', 'variant'), ('max_batch', 'B'), ('num_pages', 'pages'),
           ('cache_mib', 'cache MiB'), ('fits', 'longest requests that fit'),
           ('peak_running', 'peak running'), ('tokens_per_s', 'tokens/s'),
           ('tokens_per_busy_s', 'tokens/busy s'),
           ('ttft_p50', 'TTFT p50 s'), ('ttft_p90', 'TTFT p90 s'), ('ttft_p99', 'TTFT p99 s'),
           ('itl_p50', 'ITL p50 s'), ('itl_p90', 'ITL p90 s'), ('itl_p99', 'ITL p99 s'),
           ('ttft_shared_mean', 'TTFT system-prompt requests s'),
           ('ttft_hits_of_prefix_row', 'TTFT of the prefix row\'s hits s'),
           ('prefix_hit_requests', 'prefix-hit requests'),
           ('prefix_hit_rate', 'prefix hit rate'), ('prefill_tokens', 'prefill tokens'),
           ('preemptions', 'preemptions'), ('steps', 'steps'),
           ('paged_waste', 'paged cache waste'), ('contiguous_waste', 'contiguous cache waste'),
           ('note', 'note'))


def page_bytes(model, config: EngineConfig, kv_format: Optional[str]) -> int:
  """Device bytes of one page over every layer (k and v) in `kv_format` (no allocation)."""
  cfg = model.config
  shapes = jax.eval_shape(lambda: paged.init_paged_cache(
      cfg, num_pages=2, page_size=config.page_size, batch=1, max_pages=1, fmt=kv_format,
      dtype=cfg.dtype))
  leaves = jax.tree.leaves((shapes.k, shapes.v))
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves) // 2


def _longest_pages(trace: Sequence[TraceRequest], page_size: int) -> int:
  return max(-(-(len(r.prompt) + r.max_tokens - 1) // page_size) for r in trace)


def warm_up(model, config: EngineConfig, tokenizer=None) -> int:
  """Compile every step bucket of `config` on a throwaway engine; returns compilations."""
  return Engine(model, config, tokenizer).compile_buckets()


def compare(model, trace: Sequence[TraceRequest], config: EngineConfig,
            variants: Sequence[str], *, max_batch_limit: int = 32, pad_id: int = 0,
            log=print) -> list[dict]:
  """One row per variant (the module docstring); every row replays the same trace.

  Args:
    model: a (float or weight-quantized) Transformer; its KV format should be float.
    trace: the requests (`trace.poisson_trace`).
    config: the float engine ('continuous', 'static', 'prefix' use it; prefix caching and
      the KV format are set per variant). Ring pages must be off (`ring=False`) so that every
      format's pool is one page array per layer and 'same bytes' means the same pages x bytes.
    variants: names from the module docstring.
    max_batch_limit: the largest max_batch a 'kv_*' row may grow to.
    pad_id: left padding of static batches.
    log: called with each finished row.

  Returns:
    Rows (dicts) with `COLUMNS`, plus 'outputs' (request id -> tokens).
  """
  if config.ring and any(model.config.is_local(i) for i in range(model.config.num_layers)):
    raise ValueError('serving.compare: pass EngineConfig(ring=False), so pools of every KV '
                     'format hold the same pages (see the docstring).')
  known = ('continuous', 'static', 'prefix')
  bad = [v for v in variants if v not in known and not v.startswith('kv_')]
  if bad:
    raise ValueError(f'serving.compare: variants {bad} are unknown; use {known} or kv_<fmt>.')
  float_bytes = config.num_pages * page_bytes(model, config, None)
  longest = _longest_pages(trace, config.page_size)
  rows = []
  for name in variants:
    cfg, static = config, name == 'static'
    if name == 'prefix':
      cfg = dataclasses.replace(config, prefix_caching=True)
    elif name.startswith('kv_'):
      fmt = name[3:]
      pages = float_bytes // page_bytes(model, config, fmt)
      fits = (pages - 1) // longest
      cfg = dataclasses.replace(config, kv_format=fmt, num_pages=int(pages),
                                max_batch=int(max(config.max_batch,
                                                  min(fits, max_batch_limit))))
    # Static batches prefill their padded prompts whole, as HF `generate` does: no budget.
    cfg = dataclasses.replace(cfg, prefix_caching=cfg.prefix_caching and not static,
                              prefill_budget=None if static else cfg.prefill_budget)
    warm_up(model, cfg)
    engine = Engine(model, cfg)
    result = replay(engine, trace, static=static, pad_id=pad_id)
    row = dict(variant=name, max_batch=cfg.max_batch, num_pages=cfg.num_pages,
               kv=engine.cache.format, cache_mib=result['cache_bytes'] / 2**20,
               fits=(cfg.num_pages - 1) // longest, **result)
    if static:
      row['note'] = 'padded to the longest prompt, run to the longest output'
    rows.append(row)
    log({k: v for k, v in row.items() if k not in PER_REQUEST})
  _ttft_of_prefix_hits(rows)
  return rows


PER_REQUEST = ('outputs', 'ttft_by_request', 'prefix_hits')  # row keys holding {id: value}


def _ttft_of_prefix_hits(rows: list[dict]) -> None:
  """Give every row 'ttft_hits_of_prefix_row': its mean TTFT over the requests that hit the
  prefix cache in the 'prefix' row (the same requests in every row, so rows compare)."""
  by = {r['variant']: r for r in rows}
  if 'prefix' not in by:
    return
  hit_ids = [i for i, n in by['prefix']['prefix_hits'].items() if n > 0]
  for r in rows:
    ttft = r['ttft_by_request']
    r['ttft_hits_of_prefix_row'] = (float(np.mean([ttft[i] for i in hit_ids])) if hit_ids
                                    else float('nan'))


def ratios(rows: Sequence[dict]) -> dict:
  """The headline ratios between rows present: continuous / static throughput (and static /
  continuous steps, the part of it that is scheduling); TTFT without
  / with prefix caching, of the requests that hit the prefix cache (the target's measure)
  and of every system-prompt request (its first one always misses); sequences that fit vs
  float."""
  by = {r['variant']: r for r in rows}
  out = {}
  if 'continuous' in by and 'static' in by:
    out['throughput continuous / static'] = (by['continuous']['tokens_per_s'] /
                                             by['static']['tokens_per_s'])
    # Most of that ratio is step counts (a step's cost barely depends on its rows here).
    out['steps static / continuous'] = by['static']['steps'] / max(by['continuous']['steps'], 1)
  if 'continuous' in by and 'prefix' in by:
    cont, pre = by['continuous'], by['prefix']
    if 'ttft_hits_of_prefix_row' in pre:
      out[f"TTFT of prefix-hit requests ({pre['prefix_hit_requests']}), no prefix caching / "
          'prefix caching'] = (cont['ttft_hits_of_prefix_row'] /
                               pre['ttft_hits_of_prefix_row'])
    out['TTFT of system-prompt requests, no prefix caching / prefix caching'] = (
        by['continuous']['ttft_shared_mean'] / by['prefix']['ttft_shared_mean'])
    out['outputs identical with prefix caching'] = (by['continuous']['outputs'] ==
                                                    by['prefix']['outputs'])
  for name, r in by.items():
    if name.startswith('kv_') and 'continuous' in by:
      out[f'{name}: sequences that fit in the same bytes / float'] = (
          r['fits'] / max(by['continuous']['fits'], 1))
  return out


def pooled_throughput(rows: Sequence[dict]) -> float:
  """Tokens over seconds (each trace's span, as 'tokens_per_s') summed across `rows` (one
  variant on several traces, e.g. one per seed): the throughput of those traces served one
  after another. A ratio of two pooled throughputs weighs each trace by its length, not each
  trace's ratio equally."""
  return sum(r['tokens'] for r in rows) / sum(r['seconds'] for r in rows)


@figure
def plot(rows: Sequence[dict], path: str, title: str = '') -> str:
  """Throughput, TTFT and ITL percentiles, and cache MiB per row as one PNG; returns path."""
  plt = pyplot()

  names = [r['variant'] for r in rows]
  x = np.arange(len(rows))
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
  axes[0].bar(x, [r['tokens_per_s'] for r in rows])
  axes[0].set_title('throughput (tokens/s)')
  for ax, key in ((axes[1], 'ttft'), (axes[2], 'itl')):
    for i, q in enumerate((50, 90, 99)):
      ax.bar(x + (i - 1) * 0.27, [r.get(f'{key}_p{q}', np.nan) for r in rows], 0.27,
             label=f'p{q}')
    ax.set_title(f"{'time to first token' if key == 'ttft' else 'inter-token latency'} (s)")
    ax.legend()
  axes[3].bar(x, [r.get('cache_mib', np.nan) for r in rows], label='cache MiB')
  axes[3].plot(x, [r.get('fits', np.nan) for r in rows], 'ko', label='longest requests fit')
  axes[3].set_title('KV cache MiB / sequences that fit')
  axes[3].legend()
  for ax in axes:
    ax.set_xticks(x, names, rotation=30, ha='right')
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  save_figure(fig, path)
  return path
