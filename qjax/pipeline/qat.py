"""QAT points and the QAT sweep: quantization-aware training (and distillation) of a trained
run, evaluated, saved and reloaded exactly like a PTQ point, next to the RTN points it
starts from.

An 'rtn' point is the PTQ sweep's point (`ptq.quantize_and_evaluate`); a QAT point starts
from it (same policy, scales initialised from the same calibration), trains with
fake-quantized weights (LSQ scales with their own learning rate; with 'qat+distill' against
the float model as a frozen teacher), converts with `qjax.train.convert` and reports the
fraction of RTN's perplexity loss it recovers.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import eval as qeval
from qjax import train as qtrain
from qjax.nn import kv_format, with_kv_format
from qjax.pipeline import ptq
from qjax.pipeline.sweeps import apply_overrides, base_key, point_keys
from qjax.pipeline.training import load_trained, trained_checkpoint
from qjax.train import data as qdata
from qjax.train import distill as qdistill
from qjax.train.optim import make_optimizer

QAT_METHODS = ('qat', 'qat+distill')

# The QAT sweep's table: the PTQ columns plus RTN's perplexity, recovery and training cost.
QAT_COLUMNS = (('name', 'point'), ('method', 'method'), ('weight_format', 'format'),
               ('ppl', 'val ppl'), ('rtn_ppl', 'RTN ppl'), ('recovered', 'recovered'),
               ('greedy_agreement', 'greedy agree'), ('weight_bytes', 'weight bytes'),
               ('train_steps', 'steps'), ('train_seconds', 'train s'),
               ('train_serve_max_abs_logit_diff', 'train/serve |Δlogit|'), ('status', 'status'))


def load_teacher(workdir: str, student: nnx.Module) -> nnx.Module:
  """The float model of a finished training run, checked to share the student's vocabulary."""
  teacher, _, _ = load_trained(workdir)
  qdistill.check_teacher(teacher, student)
  return teacher


def train_loop(model: nnx.Module, data, qc, seq_len: int, teacher=None, log=print) -> dict:
  """Train `model` in place for `qc.steps` (cross-entropy, or distillation from `teacher`).

  Args:
    model: a `prepare_qat` model (or any Transformer).
    data: TextData whose `train` ids are sampled.
    qc: a `configs/qat_sweep.py` qat section (steps, batch, lr, scale_lr, alpha, ...).
    seq_len: tokens per training window.
    teacher: the frozen float model for distillation, or None.
    log: progress printer (every `qc.log_every` steps).

  Returns:
    dict with train_steps, train_seconds (wall, compile included), train_loss (last step).
  """
  if teacher is not None:
    qdistill.check_distill(qc.alpha, qc.temperature)
    qdistill.check_teacher(teacher, model)
  tx = make_optimizer(qc.lr, qc.steps, qc.warmup, qc.weight_decay, qc.clip_norm)
  learned = bool(jax.tree.leaves(nnx.state(model, qtrain.QATScale)))
  optimizer = qtrain.make_qat_optimizer(model, tx, scale_lr=qc.scale_lr if learned else None)
  t0, loss = time.perf_counter(), None
  for step in range(qc.steps):
    batch = jnp.asarray(qdata.batch_at(data.train, step, qc.batch, seq_len, qc.seed))
    if teacher is None:
      loss = qtrain.qat_step(model, optimizer, batch)
    else:
      loss, _ = qdistill.distill_step(model, optimizer, teacher, batch, alpha=qc.alpha,
                                      temperature=qc.temperature)
    if qc.log_every and (step + 1) % qc.log_every == 0:
      log(f'  step {step + 1}/{qc.steps} loss {float(loss):.4f}')
  loss = float(loss)
  if not np.isfinite(loss):
    raise FloatingPointError(f'QAT loss became {loss}; lower --config.qat.lr ({qc.lr}) or '
                             f'--config.qat.scale_lr ({qc.scale_lr}).')
  return {'train_steps': qc.steps, 'train_seconds': time.perf_counter() - t0,
          'train_loss': loss}


def kv_name(c) -> str:
  """The KV cache format a point serves with ('' float); QAT points also train with it."""
  return c.qat.kv or c.quant.get('kv', '')


def qat_point_name(c) -> str:
  """The PTQ sweep's point name, plus the QAT start / PACT, and '-kv<fmt>' for a KV format."""
  q = c.quant.copy_and_resolve_references()
  q.kv = ''
  name = ptq.point_name(q)
  if c.quant.method in QAT_METHODS:
    if c.qat.get('init', 'rtn') != 'rtn':
      name += f'-from{c.qat.init}'
    if c.qat.get('pact', 0.0):
      name += f'-pact{c.qat.pact:g}'
  return name + (f'-kv{kv_name(c)}' if kv_name(c) else '')


def qat_point(ref: ptq.FloatReference, c, out_dir: str, base_hash, log=print) -> dict:
  """QAT (+ distillation) of `ref.model` per `c.quant` / `c.qat`; a row like a PTQ point's.

  Args:
    ref: the float reference (its model is the start and, for '+distill', the teacher).
    c: a `configs/qat_sweep.py` config with one point's overrides applied.
    out_dir: where the converted model and its record go (when `c.qat.save`).
    base_hash: sha256 of the float checkpoint, or a dict of facts about it (as for
      `ptq.quantize_and_evaluate`).
    log: progress printer.

  Returns:
    The results row (PTQ columns + training cost, train/serve logit gap, KV columns).
  """
  q, qc = c.quant, c.qat
  if q.method not in QAT_METHODS:
    raise ValueError(f'quant.method={q.method!r} is not a QAT method; use one of '
                     f'{QAT_METHODS} (or "rtn" through python -m experiments.quantize).')
  t0 = time.perf_counter()
  policy = ptq.make_policy(q)
  start, init_record = ref.model, None
  if qc.init != 'rtn':  # a calibrated PTQ result; its codes and scales seed the QAT model
    if qc.init not in ('gptq', 'awq'):
      raise ValueError(f"qat.init={qc.init!r} is unknown; use 'rtn', 'gptq' or 'awq'.")
    start_q = q.copy_and_resolve_references()
    start_q.method = qc.init
    start, _, init_record, _ = ptq.quantize(ref, start_q, c.get('calib'), c.get('options'))
  # Activations are fake-quantized as served when the policy quantizes them (W8A8).
  model, _ = qtrain.prepare_qat(start, policy, learn_scales=qc.learn_scales,
                                kv=kv_name(c) or None, act=q.act != 'none',
                                pact=qc.pact or None)
  teacher = ref.model if q.method == 'qat+distill' else None
  stats = train_loop(model, ref.data, qc, ref.model.config.max_len, teacher, log)
  qmodel, report = qtrain.convert(model, policy)
  # What you train is what you serve: the fake-quant forward vs the converted weights
  # multiplied exactly (path='dequant'); the served path may also quantize activations.
  fake_logits = qeval.logits(model, ref.ref_tokens)
  exact_logits = qeval.logits(qtrain.convert(model, policy, path='dequant')[0],
                              ref.ref_tokens)
  # With a KV format, the full forward quantizes K/V as the cache does: this is the
  # perplexity under that cache, and greedy_agreement generates through it.
  columns, qlogits = ptq.evaluate(ref, qmodel)
  kv = kv_format(qmodel)
  row = {'name': qat_point_name(c), 'method': q.method, 'weight_format': ptq.format_label(q),
         **columns,
         'quantized_layer_bytes': list(report.quantized_bytes()),
         'unused_rules': [r.pattern for r in report.unused_rules], **stats,
         'learn_scales': bool(qc.learn_scales),
         'train_serve_max_abs_logit_diff': float(jnp.max(jnp.abs(fake_logits - exact_logits))),
         'kv_cache_format': kv.name if kv else None, 'qat': qc.to_dict(),
         'init': qc.init}
  if init_record is not None:
    row['init_calibration_tokens_sha256'] = init_record['data']['token_sha256']
  if kv:
    row['float_cache_ppl'] = qeval.perplexity(with_kv_format(qmodel, None), ref.windows,
                                              ref.e.batch)['ppl']
  row['bytes_ratio'] = row['weight_bytes'] / ref.bytes
  if qc.save:
    record = _record(ref, q, qc, report, policy, base_hash, row, init_record)
    ptq.save_and_verify(out_dir, qmodel, policy, record, ref.ref_tokens, qlogits)
    row['reload_bit_identical'] = True
    row['out_dir'] = out_dir
  row['seconds'] = time.perf_counter() - t0
  return row


def _record(ref, q, qc, report, policy, base_hash, row, init_record=None) -> dict:
  """The conversion record of a QAT point (the PTQ record's fields, QAT's procedure)."""
  distill = q.method == 'qat+distill'
  kv = row['kv_cache_format']
  procedure = (f'quantization-aware training, {qc.steps} steps of {qc.batch} x '
               f'{ref.model.config.max_len} tokens (seed {qc.seed}), lr {qc.lr}, '
               f'scale lr {qc.scale_lr}' +
               (f'; Hinton distillation from the float checkpoint, alpha {qc.alpha}, '
                f'T {qc.temperature}' if distill else '') +
               (f'; started from a {qc.init} PTQ result (initialisation)' if init_record
                else '; started from the float model, scales by RTN calibration') +
               (f'; PACT clips initialised at {qc.pact:g}' if qc.pact else ''))
  return qckpt.conversion_record(
      base_checkpoint={**(base_hash if isinstance(base_hash, dict) else {'sha256': base_hash}),
                       'source': 'experiments/train.py'},
      tokenizer=ref.data.tokenizer.name, source_dtype=ref.model.config.param_dtype,
      layers=report.layers, group_size=q.group_size or None, granularity=q.granularity,
      method=q.method,
      scale_method=('LSQ learned step sizes (initialised by ' if qc.learn_scales else
                    'recalibrated from the trained weights by ') +
                   f'{q.calibration}{")" if qc.learn_scales else ""}, scales in '
                   f'{q.scale_dtype}',
      zero_point_method='none (symmetric)' if q.symmetric else
                        ('learned (LSQ+), rounded' if qc.learn_scales else
                         'round(qmin - min/scale)'),
      calibration={'data': ref.data.describe(), 'procedure': procedure,
                   'initialisation': init_record},
      compute_dtype=ref.model.config.dtype, compute_path=policy.path,
      kv_cache_format=(f'{kv} (quantized on write, per token and kv head; K/V '
                       'fake-quantized the same way in training)' if kv else
                       f'{ref.model.config.dtype} (not quantized)'),
      evaluation={k: row[k] for k in ('ppl', 'float_ppl', 'max_abs_logit_diff',
                                      'greedy_agreement', 'weight_bytes',
                                      'train_serve_max_abs_logit_diff')})


def recovered(rows: list[dict], float_ppl: float) -> list[dict]:
  """Rows with `recovered`: (ppl_rtn - ppl) / (ppl_rtn - ppl_float) against the RTN point.

  Left empty where RTN lost under 1% of the float perplexity: the ratio of two tiny
  differences says nothing. A point with a quantized KV cache is compared with the RTN point
  served with the same cache format.
  """
  rtn = {(r['weight_format'], r.get('kv_cache_format')): r['ppl'] for r in rows
         if r.get('method') == 'rtn' and r.get('status') == 'ok'}
  out = []
  for r in rows:
    r = dict(r)
    base = rtn.get((r.get('weight_format'), r.get('kv_cache_format')))
    if r.get('method') in QAT_METHODS and 'ppl' in r and base is not None:
      lost = base - float_ppl
      r['rtn_ppl'] = base
      r['recovered'] = (base - r['ppl']) / lost if lost > 0.01 * float_ppl else None
    out.append(r)
  return out


def run_qat_sweep(config, points: list[dict], model=None, data=None, log=print) -> list[dict]:
  """Every point (PTQ-RTN or QAT) of a QAT sweep.

  Args:
    config: a `configs/qat_sweep.py` config (workdir, out_dir, quant, qat, eval).
    points: override dicts, one per point ('quant.method' in {'rtn', 'qat', 'qat+distill'}).
    model, data: the float model and its data; loaded from `config.workdir` when None.
    log: progress printer.

  Returns:
    [the float row] + one row per point with `recovered`; also writes results.jsonl,
    table.md, summary.json and ppl_vs_bytes.png under `config.out_dir`.
  """
  allow = bool(config.get('allow_unfinished', False))
  if model is None:
    model, _, data = load_trained(config.workdir, allow)
  ref = ptq.FloatReference(model, data, config.eval)
  base_hash = trained_checkpoint(config.workdir, allow)
  named = [(qat_point_name(apply_overrides(config, ov)), ov) for ov in points]

  def run_point(name, ov):
    c = apply_overrides(config, ov)
    out = os.path.join(config.out_dir, 'points', name)
    if c.quant.method == 'rtn':  # served with the KV format the QAT points train with
      q = c.quant.copy_and_resolve_references()
      q.kv = kv_name(c)
      return ptq.quantize_and_evaluate(ref, q, out, base_hash)
    return qat_point(ref, c, out, base_hash, log)

  rows = qeval.run_sweep(named, run_point, os.path.join(config.out_dir, 'results.jsonl'),
                         log=log, keys=point_keys(config, named, base_key(base_hash, ref)))
  float_row = ref.float_row()
  rows = [float_row] + recovered(rows, ref.ppl['ppl'])
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:
    f.write(qeval.markdown_table(rows, QAT_COLUMNS) + '\n')
  with open(os.path.join(config.out_dir, 'summary.json'), 'w') as f:
    json.dump([{k: r.get(k) for k, _ in QAT_COLUMNS} for r in rows], f, indent=2, default=str)
  qeval.plot_ppl_vs_bytes(rows[1:], os.path.join(config.out_dir, 'ppl_vs_bytes.png'),
                          title=f'RTN vs QAT vs QAT + distillation ({len(rows) - 1} points)',
                          baseline=float_row)
  return rows
