r"""Serve requests with `qjax.infer.Engine` and print a table.

  python -m experiments.serve --config=configs/serve_gemma3.py [--config.small=True]
  python -m experiments.serve --config=configs/engine_tiny.py
  python -m experiments.serve --config.checkpoint=OUT [--config.chat=True]

With a `checkpoint` (an `experiments.convert` output): the config's `prompts` (texts, wrapped
in the checkpoint's chat template with `chat`) served together by the engine, greedy, each
completion printed, then the run's throughput row.

With a `trace` in the config (serve_gemma3): a Poisson request trace replayed side by side
(continuous vs static batching, prefix caching, int8 / int4 KV caches in the same bytes, HF
`generate`), printed as a table with throughput, TTFT / inter-token latency percentiles,
cache memory and prefix hit rate, plotted to <out_dir>/serve.png (`qjax.pipeline.serving`).

Without one (engine_tiny): a synthetic batch served per (KV format, prefix caching), one row
each: throughput of the second (compiled) run, steps, prefill tokens computed, prefix-hit
tokens, preemptions, compilations, and cache waste of the paged cache next to a contiguous
max_len-per-request one.
"""

import json
import os
import pathlib
import time

from flax import nnx
import numpy as np

from qjax import infer
from qjax.eval import markdown_table
from qjax.pipeline import cli, serving
from qjax.pipeline import trace as trace_lib
from qjax.pipeline import workload
from qjax.nn import Transformer, TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.define_config(os.path.join(ROOT, 'configs', 'engine_tiny.py'), ROOT,
                            lock_config=False, prog='experiments.serve')


def _workload_table(c):
  n = c.workload.num_requests
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f'--config.workload.num_requests={n!r}: the workload needs at least one '
                     'request; pass a positive integer.')
  cfg = TransformerConfig(**c.model)
  model = Transformer(cfg, rngs=nnx.Rngs(c.seed))
  prompts, params = workload.synthetic_workload(vocab_size=cfg.vocab_size, **c.workload)
  rows = []
  for fmt in c.kv_formats:
    for caching in c.prefix_caching:
      ecfg = infer.EngineConfig(kv_format=None if fmt == 'float' else fmt,
                                prefix_caching=caching, **c.engine)
      engine = infer.Engine(model, ecfg)
      workload.serve(engine, prompts, params)  # compiles the step buckets
      engine = infer.Engine(model, ecfg)  # fresh pages and prefix cache, same executables
      row = workload.serve(engine, prompts, params)
      rows.append(dict(kv=fmt, prefix_caching=caching, **row))
      print(rows[-1], flush=True)
  keys = ['kv', 'prefix_caching', 'generated', 'tokens_per_s', 'steps', 'dispatches',
          'prefill_tokens', 'prefix_hit_tokens', 'preemptions', 'compilations', 'paged_waste',
          'contiguous_waste', 'host_share']
  print('\n| ' + ' | '.join(keys) + ' |\n|' + '---|' * len(keys))
  for r in rows:
    print('| ' + ' | '.join(str(r[k]) for k in keys) + ' |')


def _checkpoint_serve(c):
  """Serve `c.prompts` with a converted checkpoint; print completions and the run's row."""
  from qjax.pipeline.convert import load_converted  # pylint: disable=g-import-not-at-top
  model, tok, record = load_converted(c.checkpoint)
  print(f"loaded {c.checkpoint}: {record['method']}, {record['base_checkpoint']['source']}",
        flush=True)
  if isinstance(c.prompts, str) or not c.prompts or not all(
      isinstance(p, str) and p.strip() for p in c.prompts):
    raise ValueError(f'--config.prompts={c.prompts!r}: give one or more non-empty texts, '
                     "e.g. --config.prompts='Hello world' or "
                     '--config.prompts="(\'Hello\', \'Bonjour\')".')
  prompts = [tok.chat(p) if c.chat else tok.encode(p) for p in c.prompts]
  params = infer.SamplingParams(temperature=0.0, max_tokens=c.max_tokens,
                                stop_tokens=tuple(tok.stop_ids))
  max_len = min(c.max_len, model.config.max_len)
  for i, ids in enumerate(prompts):
    if len(ids) + c.max_tokens > max_len:
      raise ValueError(f'prompt {i} has {len(ids)} tokens + --config.max_tokens='
                       f'{c.max_tokens} > --config.max_len={c.max_len}'
                       + (f' (the model holds {model.config.max_len})'
                          if model.config.max_len < c.max_len else '')
                       + f'; pass --config.max_len={len(ids) + c.max_tokens} or more'
                       + (f' (at most {model.config.max_len})'
                          if len(ids) + c.max_tokens <= model.config.max_len else
                          ', which this model cannot hold: shorten the prompt')
                       + ', or lower --config.max_tokens.')
  ecfg = infer.EngineConfig(**dict(c.engine, max_len=max_len))
  engine = infer.Engine(model, ecfg, tokenizer=tok)
  t0 = time.perf_counter()
  outputs = engine.generate(prompts, params)
  seconds = time.perf_counter() - t0
  for text, out in zip(c.prompts, outputs):
    print(f'{text!r} -> {tok.decode(out)!r}', flush=True)
  generated = sum(len(o) for o in outputs)
  row = dict(requests=len(outputs), generated=generated, seconds=round(seconds, 3),
             tokens_per_s=round(generated / seconds, 1), steps=engine.stats.steps,
             compilations=engine.stats.compilations, note='incl. compilation')
  print(json.dumps(row))
  return row


def _gemma_trace(c):
  """Gemma 3 270M, a maker of the config's traces (windows of Tiny Shakespeare), pad id."""
  from qjax.checkpoints.gemma3 import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.data import corpus  # pylint: disable=g-import-not-at-top
  from configs import serve_gemma3  # pylint: disable=g-import-not-at-top  (ROOT on sys.path)
  model, tok, info = load_gemma3_270m(param_dtype=c.param_dtype)
  print(f"loaded Gemma 3 270M in {info['seconds']:.1f} s", flush=True)
  bos = tok.token_to_id('<bos>')
  system = tok.encode(serve_gemma3.SYSTEM_PROMPT).ids[1:]
  if len(system) < c.system_len:
    raise ValueError(f'system_len={c.system_len} is longer than the system prompt '
                     f'({len(system)} tokens); lower it.')
  source = tok.encode(corpus(c.corpus)[:200_000]).ids[1:]
  make = lambda spec, seed=c.seed: trace_lib.poisson_trace(
      **spec, system_prompt=system[:c.system_len], token_source=source, bos=bos, seed=seed)
  return model, make, tok.token_to_id('<pad>')


def _hf_generate_row(trace, max_batch: int, pad_id: int) -> dict:
  """HF transformers `generate` on the trace in static batches (the same grouping as the
  'static' row); it returns a batch's tokens when the batch is done, so every token of a
  request is stamped then (TTFT = the batch's completion, no inter-token latency)."""
  row = dict(variant='hf_generate', max_batch=max_batch)
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    row['note'] = f'not run: {e} (pip install the reference extra)'
    return row
  from qjax.checkpoints.gemma3 import gemma3_270m_path  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(gemma3_270m_path())
  hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                            dtype=torch.float32).eval()

  def run(batch):
    longest = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[pad_id] * (longest - len(r.prompt)) + list(r.prompt) for r in batch])
    mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    steps = max(r.max_tokens for r in batch)
    with torch.no_grad():
      hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                  min_new_tokens=steps, do_sample=False, pad_token_id=pad_id)
  run(trace[:1])  # warm up
  pending, now, times = list(trace), 0.0, {}
  while pending:
    now = max(now, pending[0].arrival)
    batch = [r for r in pending if r.arrival <= now][:max_batch]
    pending = [r for r in pending if r not in batch]
    t0 = time.perf_counter()
    run(batch)
    now += time.perf_counter() - t0
    times.update({r.id: [now] * r.max_tokens for r in batch})
  result = trace_lib.summarize(trace, times)
  for q in trace_lib.PERCENTILES:
    result[f'itl_p{q}'] = float('nan')
  row.update(result, note='HF generate, fp32 torch; tokens arrive when the batch ends')
  return row


def _trace_comparison(c):
  from configs import serve_gemma3  # pylint: disable=g-import-not-at-top  (ROOT on sys.path)
  if c.small:
    c = serve_gemma3.small(c)
  if c.get('quick'):
    c = serve_gemma3.quick(c)
  print(f'load average before: {os.getloadavg()}', flush=True)
  if c.model == 'tiny':
    cfg = TransformerConfig.tiny(max_len=c.engine.max_len)
    model, pad_id = Transformer(cfg, rngs=nnx.Rngs(c.seed)), 0
    make = lambda spec, seed=c.seed: trace_lib.poisson_trace(
        **spec, system_prompt=list(range(1, 1 + c.system_len)), vocab_size=cfg.vocab_size,
        seed=seed)
  else:
    model, make, pad_id = _gemma_trace(c)
  trace = make(c.trace)
  ttft_trace = make(c.ttft_trace) if c.get('ttft_trace') else None
  print(f'trace: {len(trace)} requests over {trace[-1].arrival:.1f} s, prompts '
        f'{min(len(r.prompt) for r in trace)}-{max(len(r.prompt) for r in trace)} tokens, '
        f'{sum(r.shared for r in trace)} with the system prompt, '
        f'{sum(r.max_tokens for r in trace)} output tokens', flush=True)
  variants = c.variants.split(',')
  if c.model == 'tiny' and 'hf' in variants:  # HF loads Gemma's GGUF: not the tiny model
    variants.remove('hf')
  ecfg = infer.EngineConfig(**c.engine)
  rows = serving.compare(model, trace, ecfg, [v for v in variants if v != 'hf'],
                         max_batch_limit=c.max_batch_limit, pad_id=pad_id,
                         log=lambda r: print(r, flush=True))
  if 'hf' in variants:
    rows.append(_hf_generate_row(trace, ecfg.max_batch, pad_id))
    print(rows[-1], flush=True)
  tail_rows, tail_ratios = [], {}
  # heavy-tailed outputs (config.quick), one trace per seed: continuous vs static only
  for seed in (c.get('tail_seeds') or (c.seed,)) if c.get('tail_trace') else ():
    tail = make(c.tail_trace, seed)
    print(f'tail trace, seed {seed}: {sum(r.max_tokens for r in tail)} output tokens, '
          f'max_tokens {sorted(r.max_tokens for r in tail)}', flush=True)
    pair = serving.compare(model, tail, ecfg, ['continuous', 'static'], pad_id=pad_id,
                           log=lambda r: print(r, flush=True))
    tail_ratios.update({f'{k} (heavy-tailed outputs, seed {seed})': v
                        for k, v in serving.ratios(pair).items()})
    for r in pair:
      r['variant'] = f"{r['variant']} (heavy-tailed outputs, seed {seed})"
    tail_rows += pair
  if len(tail_rows) > 2:  # the seeds' traces served one after another
    pooled = {v: serving.pooled_throughput([r for r in tail_rows if r['variant'].startswith(v)])
              for v in ('continuous', 'static')}
    tail_ratios['throughput continuous / static (heavy-tailed outputs, seeds pooled)'] = (
        pooled['continuous'] / pooled['static'])
  ttft_rows, ttft_ratios = [], {}
  if ttft_trace is not None:  # prefix caching's TTFT without queueing (config.quick)
    ttft_rows = serving.compare(model, ttft_trace, ecfg, ['continuous', 'prefix'],
                                pad_id=pad_id, log=lambda r: print(r, flush=True))
    ttft_ratios = {f'{k} (unsaturated trace)': v
                   for k, v in serving.ratios(ttft_rows).items()}
    for r in ttft_rows:
      r['variant'] = f"{r['variant']} (unsaturated trace)"
  load = os.getloadavg()
  print(f'load average after: {load}', flush=True)
  print(markdown_table(rows + tail_rows + ttft_rows, serving.COLUMNS))
  ratios = {**serving.ratios(rows), **tail_ratios, **ttft_ratios}
  for k, v in ratios.items():
    print(f'{k}: {v:.3g}' if isinstance(v, float) else f'{k}: {v}')
  print(f'\ntargets (load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}):')
  for k, v in ratios.items():
    target = (2 if k.startswith('throughput continuous / static') else
              3 if k.startswith('TTFT of prefix-hit requests') and 'unsaturated' in k else
              None)  # the saturated trace's TTFT is queueing, not the skipped prefill
    if target is not None:
      print(f"  {k}: {v:.2f}x (target >= {target}x: {'met' if v >= target else 'missed'})")
  out = pathlib.Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  title = f'{c.model}, {len(trace)} requests (load average {load[0]:.1f})'
  print('plot:', serving.plot([r for r in rows if 'tokens_per_s' in r], str(out / 'serve.png'),
                              title))
  clean = [{k: v for k, v in r.items() if k != 'outputs'} for r in rows + tail_rows + ttft_rows]
  (out / 'results.json').write_text(json.dumps(
      dict(config=c.to_dict(), rows=clean, ratios=ratios, load_average=load), indent=1,
      default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))


def main(argv):
  del argv
  c = _CONFIG.value
  if c.get('checkpoint'):
    _checkpoint_serve(c)
  elif c.get('chat'):
    raise ValueError('--config.chat=True applies the chat template of a converted checkpoint; '
                     'pass --config.checkpoint=OUT (python -m experiments.convert writes one).')
  elif 'trace' in c:
    _trace_comparison(c)
  else:
    _workload_table(c)


if __name__ == '__main__':
  cli.run(main, 'experiments.serve')
