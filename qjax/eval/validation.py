"""One validation report of a converted model against its float base.

    report = qjax.eval.validate(float_model, quant_model, name='int4-g128', out_dir=point_dir,
                                prompts=..., ppl_windows={'wikitext2': w, ...}, tasks=...)

Sections (each optional but the first three): fixed-prompt logits (max / mean |Δ|, KL, top-1
agreement), greedy agreement (matched-prefix length and per-position agreement), perplexity
on each corpus given, task accuracy with paired 95% intervals, memory (predicted by
`qjax.eval.memory` from config + policy, measured from the device buffers and the compiled
steps), latency (prefill tok/s, decode ms/token at each batch, float and quantized in the
same run), the context limit under a budget (predicted, then compiled and run), perplexity by
position bucket over a long window, the dynamic trigger rate of LLM.int8() layers (features
and tokens that took the float path, per layer), and what actually ran (per-layer weight and
activation formats read back from the quantized model). `write` puts validation.json,
validation.md and validation.png in `out_dir`; with a conversion record there, the record
links them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax import target as qjax_target
from qjax.algorithms.llm_int8 import llm_int8_layers, trigger_rate
from qjax.checkpoints import records
from qjax.eval import memory as qmemory
from qjax.eval import process as qprocess
from qjax.eval import metrics
from qjax.eval import tasks as qtasks
from qjax.eval._validation_report import markdown, plot
from qjax.nn import (Attention, einsum_layers, greedy_step, init_cache,
                     kv_format)
from qjax.nn.report import format_name, layer_paths


# ---------------------------------------------------------------------------- quality
def greedy_positions(ref_model, test_model, prompts_BT, num_tokens: int) -> dict:
  """Greedy agreement per generated position, and the matched-prefix length per prompt."""
  same, prefix = metrics.greedy_match(ref_model, test_model, prompts_BT, num_tokens)
  return {'agreement': float(same.mean()), 'prefix_mean': float(prefix.mean()),
          'prefix': prefix.tolist(), 'per_position': same.mean(0).tolist(),
          'tokens': num_tokens, 'prompts': len(prefix)}


@contextlib.contextmanager
def attention_impl(model, impl: str):
  """Run every Attention of `model` with `impl` ('blockwise': O(T) memory) for a while."""
  layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, Attention)]
  old = [m.impl for m in layers]
  try:
    for m in layers:
      m.impl = impl
    yield model
  finally:
    for m, o in zip(layers, old):
      m.impl = o


@functools.partial(jax.jit, static_argnums=(0, 3))
def _position_nll(graphdef, state, tokens_1T, chunk):
  model = nnx.merge(graphdef, state)
  inp, tgt = tokens_1T[:, :-1], tokens_1T[0, 1:]
  t = inp.shape[1]
  h, _ = model.run_layers(model.embed_tokens(inp), jnp.arange(t, dtype=jnp.int32)[None])
  h = h[0].reshape(t // chunk, chunk, -1)

  def one(args):  # the head on J chunks of T positions: (J * T, V) f32 logits never exist
    h_TD, tgt_T = args
    logp = jax.nn.log_softmax(model.logits(h_TD[None])[0], -1)
    return -jnp.take_along_axis(logp, tgt_T[:, None], -1)[:, 0]

  return jax.lax.map(one, (h, tgt.reshape(t // chunk, chunk))).reshape(-1)


def position_nll(model, tokens_1T, chunk: int = 512) -> np.ndarray:
  """Per-position NLL of one long window (blockwise attention, head in chunks)."""
  tokens_1T = np.asarray(tokens_1T)
  t = tokens_1T.shape[1] - 1
  chunk = min(chunk, t)
  if t > model.config.max_len:
    raise ValueError(f'position_nll: a window of {t} tokens exceeds max_len='
                     f'{model.config.max_len}.')
  if t % chunk:
    raise ValueError(f'position_nll: {t} predicted tokens are not a multiple of chunk={chunk}; '
                     'use a window of k * chunk + 1 tokens.')
  with attention_impl(model, 'blockwise'):
    graphdef, state = nnx.split(model)
    return np.asarray(_position_nll(graphdef, state, jnp.asarray(tokens_1T), chunk))


def bucket_ppl(nll: np.ndarray, edges) -> list[dict]:
  """Perplexity per position bucket [lo, hi) of a per-position NLL."""
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    seg = nll[lo:hi]
    if seg.size:
      out.append({'lo': int(lo), 'hi': int(min(hi, len(nll))),
                  'ppl': float(np.exp(seg.mean()))})
  return out


# ---------------------------------------------------------------------------- speed
def _timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def latency(model, *, prompt_len: int, steps: int, batches=(1, 8), vocab: Optional[int] = None,
            seed: int = 0) -> dict:
  """Prefill tok/s at batch 1 and decode ms/token at each batch (after one warm-up run)."""
  cfg = model.config
  vocab = vocab or cfg.vocab_size
  rng = np.random.default_rng(seed)
  fmt = kv_format(model)
  out = {}
  for b in batches:
    prompt = jnp.asarray(rng.integers(0, vocab, (b, prompt_len)), jnp.int32)
    best_prefill, best_decode = None, None
    for _ in range(2):  # the first run compiles
      cache = init_cache(cfg, b, prompt_len + steps + 1, fmt=fmt)
      (tok, cache), tp = _timed(lambda: greedy_step(model, prompt, cache))  # noqa: B023
      t0 = time.perf_counter()
      for _ in range(steps):
        tok, cache = greedy_step(model, tok[:, None], cache)
      jax.block_until_ready(tok)
      td = (time.perf_counter() - t0) / steps
      best_prefill, best_decode = tp, td
    out[f'b{b}'] = {'prefill_tok_s': b * prompt_len / best_prefill,
                    'decode_ms_per_token': 1e3 * best_decode}
  return out


# ---------------------------------------------------------------------------- memory
def memory_section(quant_model, policy, *, batch: int, context: int, prompt: int) -> dict:
  """Predicted (config + policy) and measured bytes of the quantized model's workload."""
  cfg = quant_model.config
  pred = qmemory.predict(cfg, policy, batch=batch, context=context, prompt=prompt,
                         kv=kv_format(quant_model)) if policy is not None else None
  meas = qmemory.measure(quant_model, batch=batch, context=context, prompt=prompt)
  out = {'workload': {'batch': batch, 'context': context, 'prompt': prompt},
         'measured': meas}
  if pred is not None:
    p = pred.as_dict()
    out['predicted'] = p
    out['weights_ratio'] = p['weights']['total'] / meas['weights']['total']
    out['kv_ratio'] = p['kv'] / meas['kv']
    out['prefill_activations_ratio'] = p['prefill_activations'] / max(meas['prefill']['temp'], 1)
    out['decode_activations_ratio'] = p['decode_activations'] / max(meas['decode']['temp'], 1)
  return out


def context_limit(model, policy, *, budget_bytes: int, batch: int = 1,
                  max_context: Optional[int] = None, compiled: bool = True) -> dict:
  """The longest decode context under `budget_bytes`: predicted, then compiled and run.

  Predicted by `qjax.eval.memory` (weights + KV + one decode step's activations) two ways:
  the estimate, and (`compiled`) XLA's memory analysis of the step compiled from shapes
  alone; confirmed at the prediction used (the compiled one when asked) by building the
  cache at that length, compiling this model's decode step (XLA's argument + temp + output
  - alias bytes: weights and cache counted once) and running one step, with the process'
  peak RSS around the run.
  """
  cfg = model.config
  cap = min(max_context or cfg.max_len, cfg.max_len)
  ccfg, kv = cfg.replace(max_len=cap), kv_format(model)
  est = qmemory.max_context(ccfg, budget_bytes, policy, batch=batch, kv=kv)
  out = {'budget_bytes': int(budget_bytes), 'batch': batch, 'estimate_max_context': est,
         'capped_at': cap, 'planner': 'compiled' if compiled else 'estimate'}
  s = qmemory.max_context(ccfg, budget_bytes, policy, batch=batch, kv=kv,
                          compiled=True) if compiled else est
  out['predicted_max_context'] = s
  if s < 1:
    out['confirmed'] = False
    return out
  out['predicted_bytes'] = qmemory.predict(ccfg, policy, batch=batch, context=s, prompt=1,
                                           kv=kv, compiled=compiled).total
  cm = qmemory.compiled_memory(model, batch, 1, s)
  used = cm['argument'] + cm['temp'] + cm['output'] - cm['alias']
  cache = init_cache(cfg, batch, s, fmt=kv)
  cache = dataclasses.replace(cache, length=jnp.full_like(cache.length, s - 1))
  rss0 = qprocess.current_rss_bytes()
  reset = qprocess.reset_peak_rss()  # the step just analysed, run once at full context
  jax.block_until_ready(qmemory.run_step(model, jnp.zeros((batch, 1), jnp.int32), cache))
  device = qprocess.device_memory()
  if device is not None:  # an accelerator: its memory, not the host's
    out['run_device_peak'] = device['peak']
  elif reset:
    out['run_peak_rss_above_start'] = qprocess.peak_rss_bytes(since_reset=True) - rss0
  out.update(compiled_bytes=used, compiled=cm, confirmed=used <= budget_bytes, ran=True,
             prediction_error=out['predicted_bytes'] / used - 1)
  return out


# ---------------------------------------------------------------------------- what ran
def what_ran(model) -> dict:
  """Per layer, the weight format, activation format and compute path actually stored, and
  for a quantized layer the path it runs at decode and prefill shapes with the reason
  (`qjax.nn.report.layer_paths`, on the target the report's programs are traced for)."""
  out = {}
  ran = layer_paths(model)
  for path, layer in einsum_layers(model):
    if not layer.quantized:
      out[path] = {'weight': str(layer.w.get_value().dtype), 'act': 'float'}
      continue
    q = layer.quant
    act = q.act_fmt.name if q.act_fmt is not None else 'float'
    if getattr(q, 'outlier_threshold', None):
      act = f'int8 + float outlier columns (|x| > {q.outlier_threshold:g})'
    out[path] = {'weight': format_name(layer), 'act': act, 'path': q.path}
    if path in ran:
      out[path]['runs'] = ran[path]
  return out


# ---------------------------------------------------------------------------- the report
def validate(float_model: nnx.Module, quant_model: nnx.Module, *, name: str,
             out_dir: Optional[str] = None, prompts, greedy_prompts=None,
             greedy_tokens: int = 16, ppl_windows: Mapping[str, np.ndarray] = (),
             ppl_batch: int = 1, tasks: Mapping[str, qtasks.Task] = (), task_batch: int = 8,
             policy=None, memory: Optional[dict] = None, latency_cfg: Optional[dict] = None,
             context: Optional[dict] = None, long_window: Optional[np.ndarray] = None,
             buckets=None, extra: Optional[dict] = None, base_file: Optional[str] = None,
             float_cache: Optional[dict] = None, log=print) -> dict:
  """Validate `quant_model` against `float_model`; write the report when `out_dir` is given.

  Args:
    float_model, quant_model: the base and the converted model (same config).
    name: the conversion's name (e.g. 'gptq-int4-g128').
    out_dir: where validation.json / .md / .png go (the point's directory: its conversion
      record, if there, is verified first and then links the report).
    prompts: [B, T] tokens of the fixed-prompt logit comparison.
    greedy_prompts: [B, T] prompts of greedy generation (default: `prompts[:, :8]`).
    greedy_tokens: tokens generated per prompt.
    ppl_windows: {corpus: [n, T + 1] windows}.
    ppl_batch: windows per perplexity batch.
    tasks: {name: Task} from `qjax.eval.tasks.build`.
    task_batch: rows per scoring batch.
    policy: the QuantPolicy used (enables the memory prediction and the context limit).
    memory: {'batch', 'context', 'prompt'} of the memory section.
    latency_cfg: {'prompt_len', 'steps', 'batches'} of the latency section.
    context: {'budget_bytes', 'batch', 'max_context'} of the context-limit section.
    long_window: [1, k * 512 + 1] tokens for perplexity by position bucket.
    buckets: bucket edges in positions (default powers of two from 64).
    extra: more fields for the report (fallback / mixed-precision facts, trigger rates).
    base_file: the base checkpoint file, checked against the record's base hash.
    float_cache: a dict reused across calls for the float model's numbers (a sweep of
      conversions evaluates the float model once).
    log: progress printer.

  Returns:
    The report (a JSON-able dict).
  """
  cache = {} if float_cache is None else float_cache
  if float_model.config != quant_model.config:
    raise ValueError('validate: the float and quantized models have different configs; '
                     'validate a conversion against the base it was converted from.')
  rec = None
  if out_dir and os.path.isfile(os.path.join(out_dir, records.RECORD_NAME)):
    rec = records.read_record(out_dir, verify=False)
  t_all = time.perf_counter()
  report = {'name': name, 'model': {'num_layers': float_model.config.num_layers,
                                    'vocab_size': float_model.config.vocab_size,
                                    'd_model': float_model.config.d_model}}
  if rec is not None:
    report['base_verified'] = records.verify_base(rec, file=base_file,
                                                  tree=nnx.state(float_model))
  prompts = jnp.asarray(prompts)
  if 'logits' not in cache:
    cache['logits'] = metrics.logits(float_model, prompts)
  ql = metrics.logits(quant_model, prompts)
  report['logits'] = {**metrics.logit_diff(cache['logits'], ql),
                      'kl': metrics.kl_divergence(cache['logits'], ql),
                      'tokens': int(prompts.size)}
  del ql
  log(f'{name}: logits {report["logits"]}')
  gp = prompts[:, :8] if greedy_prompts is None else jnp.asarray(greedy_prompts)
  report['greedy'] = greedy_positions(float_model, quant_model, gp, greedy_tokens)
  report['perplexity'] = {}
  for corpus, w in dict(ppl_windows).items():
    key = f'ppl:{corpus}'
    if key not in cache:
      cache[key] = metrics.perplexity(float_model, w, ppl_batch)
    q = metrics.perplexity(quant_model, w, ppl_batch)
    f = cache[key]
    report['perplexity'][corpus] = {'float': f['ppl'], 'quant': q['ppl'],
                                    'delta': q['ppl'] - f['ppl'], 'tokens': q['tokens']}
  log(f'{name}: perplexity {report["perplexity"]}')
  report['tasks'] = {}
  for tname, task in dict(tasks).items():
    key = f'task:{tname}'
    if key not in cache:
      cache[key] = qtasks.score(float_model, task, task_batch)
    report['tasks'][tname] = qtasks.compare(float_model, quant_model, task, task_batch,
                                            float_scores=cache[key])
  if tasks:
    log(f'{name}: tasks ' + ', '.join(f"{k} {v['float']:.3f} -> {v['quant']:.3f}"
                                      for k, v in report['tasks'].items()))
  if memory:
    report['memory'] = memory_section(quant_model, policy, **memory)
    if 'mem:float' not in cache:
      cache['mem:float'] = qmemory.measure(float_model, **memory, compiled=False)['weights']
    report['memory']['float_weights'] = cache['mem:float']
  if latency_cfg:
    if 'latency' not in cache:
      cache['latency'] = latency(float_model, **latency_cfg)
    q = latency(quant_model, **latency_cfg)
    report['latency'] = {'float': cache['latency'], 'quant': q,
                         'note': 'float and quantized timed in the same process, one after the '
                                 'other; on a shared machine label them "under load"'}
  if context:
    if policy is None:
      raise ValueError('validate: context= needs policy= (the limit is predicted from the '
                       'config and the policy, then confirmed).')
    report['context_limit'] = {'quant': context_limit(quant_model, policy, **context)}
    if 'ctx:float' not in cache:
      cache['ctx:float'] = context_limit(float_model, None, **context)
    report['context_limit']['float'] = cache['ctx:float']
  if long_window is not None:
    t = np.asarray(long_window).shape[1] - 1
    edges = buckets or [0] + [2 ** k for k in range(6, 20) if 2 ** k < t] + [t]
    if 'long:float' not in cache:
      cache['long:float'] = bucket_ppl(position_nll(float_model, long_window), edges)
    report['ppl_by_position'] = {'float': cache['long:float'], 'tokens': t,
                                 'quant': bucket_ppl(position_nll(quant_model, long_window),
                                                     edges)}
  if llm_int8_layers(quant_model):  # a dynamic fallback: count what took the float path
    report['llm_int8_trigger'] = trigger_rate(quant_model, prompts)
    log(f"{name}: LLM.int8() features in float {report['llm_int8_trigger']['features']:.4f}, "
        f"tokens {report['llm_int8_trigger']['tokens']:.4f}")
  report['what_ran'] = what_ran(quant_model)
  report['target'] = qjax_target.current().facts()  # the devices its programs were traced for
  report['kv_cache'] = kv_format(quant_model).name if kv_format(quant_model) else (
      f'{quant_model.config.dtype} (not quantized)')
  if extra:
    report.update(extra)
  report['seconds'] = time.perf_counter() - t_all
  if out_dir:
    write(report, out_dir, link=rec is not None)
  return report


REPORT_DIR = 'validation'


def write(report: dict, out_dir: str, link: bool = False) -> dict:
  """validation.json, validation.md and validation.png under `out_dir/validation/`; with
  `link`, the conversion record in `out_dir` gains a 'validation' field naming them (and
  their hashes, as artifacts). Without matplotlib (the 'plots' extra) the PNG is left out
  with a warning; the report and the record do not need it."""
  d = os.path.join(out_dir, REPORT_DIR)
  os.makedirs(d, exist_ok=True)
  paths = {'json': os.path.join(d, 'validation.json'), 'md': os.path.join(d, 'validation.md'),
           'png': os.path.join(d, 'validation.png')}
  with open(paths['json'], 'w') as f:
    json.dump(report, f, indent=1, default=str, sort_keys=True)
  with open(paths['md'], 'w') as f:
    f.write(markdown(report) + '\n')
  if plot([report], paths['png']) is None:  # matplotlib missing: warned, not linked
    del paths['png']
  if link:
    rel = {k: os.path.relpath(v, out_dir) for k, v in paths.items()}
    records.amend_record(out_dir, {'validation': {
        'files': rel, 'kl': report['logits']['kl'],
        'perplexity': {k: v['quant'] for k, v in report['perplexity'].items()},
        **({'fallback': report['fallback']['trigger_rate']} if 'fallback' in report else {}),
        **({'llm_int8_trigger': {k: report['llm_int8_trigger'][k]
                                 for k in ('features', 'tokens', 'measured_on')} | {
            'layers': {p: {'features': v['features'], 'tokens': v['tokens']}
                       for p, v in report['llm_int8_trigger']['layers'].items()}}}
           if 'llm_int8_trigger' in report else {}),
        'what_ran': 'see validation.json what_ran'}}, replaced=REPORT_DIR + '/')
  return paths
