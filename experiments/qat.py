r"""Quantization-aware training and distillation of a trained run, and the QAT sweep.

  python -m experiments.qat --config=configs/qat_sweep.py --config.workdir=/tmp/qat_base \
      --config.out_dir=/tmp/qat_sweep [--config.qat.steps=200]

Runs the config's `sweep()` (points override e.g. quant.bits, quant.group_size and
quant.method in {'rtn', 'qat', 'qat+distill'}). An 'rtn' point is the PTQ sweep's point
(`experiments/quantize.py`); a QAT point starts from it (same policy, scales initialised from
the same calibration), trains with fake-quantized weights (LSQ scales with their own learning
rate; with '+distill', against the float model restored from the checkpoint as a frozen
teacher), converts with `quantize_model` and is evaluated, saved and reloaded exactly like a
PTQ point. Results append to <out_dir>/results.jsonl (resumable), with table.md,
ppl_vs_bytes.png and summary.json (the fraction of RTN's perplexity loss each QAT point
recovers, and its training cost).

With --config.qat.kv=int4 (or int8, fp8, fp8_e5m2) QAT points also train with keys and
values fake-quantized as that KV cache stores them; the converted model keeps the format, so
its perplexity (a full forward) is the perplexity under that cache, greedy generation runs
through that cache, the record's kv_cache_format names it, and the row adds
float_cache_ppl (the same model with a float cache). RTN points are served with the same
cache (`quant.kv`), so `recovered` compares like with like; all are named '...-kv<fmt>'.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qjax import checkpoints as qckpt  # noqa: E402
from qjax import eval as qeval  # noqa: E402
from qjax import train as qtrain  # noqa: E402
from qjax.nn import kv_format, weight_bytes, with_kv_format  # noqa: E402
from qjax.train import data as qdata  # noqa: E402
from qjax.train import distill as qdistill  # noqa: E402
from qjax.train.optim import make_optimizer  # noqa: E402

from experiments import quantize as qexp  # noqa: E402
from experiments import sweep as sweep_lib  # noqa: E402
from experiments import train as train_lib  # noqa: E402

QAT_METHODS = ('qat', 'qat+distill')


def load_teacher(workdir: str, student: nnx.Module) -> nnx.Module:
  """The float model of a finished training run, checked to share the student's vocabulary."""
  teacher, _, _ = train_lib.load_trained(workdir)
  qdistill.check_teacher(teacher, student)
  return teacher


def train_loop(model: nnx.Module, data, qc, seq_len: int, teacher=None, log=print) -> dict:
  """Train `model` in place for `qc.steps` (CE, or distillation from `teacher`).

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


def qat_point(ref: qexp.FloatReference, c, out_dir: str, base_hash: str, log=print) -> dict:
  """QAT (+ distillation) of `ref.model` per `c.quant` / `c.qat`; a row like a PTQ point's."""
  q, qc = c.quant, c.qat
  if q.method not in QAT_METHODS:
    raise ValueError(f'quant.method={q.method!r} is not a QAT method; use one of '
                     f'{QAT_METHODS} (or "rtn" through experiments/quantize.py).')
  t0 = time.perf_counter()
  policy = qexp.make_policy(q)
  start, init_record = ref.model, None
  if qc.init != 'rtn':  # a calibrated PTQ result; its codes and scales seed the QAT model
    if qc.init not in ('gptq', 'awq'):
      raise ValueError(f"qat.init={qc.init!r} is unknown; use 'rtn', 'gptq' or 'awq'.")
    ptq = q.copy_and_resolve_references()
    ptq.method = qc.init
    start, _, init_record, _ = qexp.quantize(ref, ptq, c.get('calib'), c.get('options'))
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
  ppl = qeval.perplexity(qmodel, ref.windows, ref.e.batch)
  qlogits = qeval.logits(qmodel, ref.ref_tokens)
  kv = kv_format(qmodel)
  row = {'name': point_name(c), 'method': q.method, 'weight_format': qexp.format_label(q),
         'ppl': ppl['ppl'], 'float_ppl': ref.ppl['ppl'], 'ppl_delta': ppl['ppl'] - ref.ppl['ppl'],
         'eval_tokens': ppl['tokens'], **qeval.logit_diff(ref.logits, qlogits),
         'kl': qeval.kl_divergence(ref.logits, qlogits),
         **qeval.greedy_agreement(ref.model, qmodel, ref.prompts, ref.e.greedy_tokens),
         'weight_bytes': weight_bytes(qmodel)['total'], 'float_weight_bytes': ref.bytes,
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
    qckpt.save_quantized(out_dir, qmodel, policy, _record(ref, q, qc, report, policy, base_hash,
                                                          row, init_record))
    loaded, _ = qckpt.load_quantized(out_dir)
    if not np.array_equal(np.asarray(qeval.logits(loaded, ref.ref_tokens)), np.asarray(qlogits)):
      raise RuntimeError(f'{out_dir}: the reloaded QAT model does not reproduce its logits.')
    row['reload_bit_identical'] = True
    row['out_dir'] = out_dir
  row['seconds'] = time.perf_counter() - t0
  return row


def kv_name(c) -> str:
  """The KV cache format a point serves with ('' float); QAT points also train with it."""
  return c.qat.kv or c.quant.get('kv', '')


def point_name(c) -> str:
  """The PTQ sweep's point name, plus the QAT start / PACT, and '-kv<fmt>' for a KV format."""
  q = c.quant.copy_and_resolve_references()
  q.kv = ''
  name = qexp.point_name(q)
  if c.quant.method in QAT_METHODS:
    if c.qat.get('init', 'rtn') != 'rtn':
      name += f'-from{c.qat.init}'
    if c.qat.get('pact', 0.0):
      name += f'-pact{c.qat.pact:g}'
  return name + (f'-kv{kv_name(c)}' if kv_name(c) else '')


def _record(ref, q, qc, report, policy, base_hash, row, init_record=None) -> dict:
  """The conversion record of a QAT point (the PTQ record's fields, QAT's procedure)."""
  distill = q.method == 'qat+distill'
  kv = row['kv_cache_format']
  return {
      'base_checkpoint': {'sha256': base_hash, 'source': 'experiments/train.py'},
      'tokenizer': ref.data.tokenizer.name, 'source_dtype': ref.model.config.param_dtype,
      'weight_formats': {l.path: l.weight for l in report.layers},
      'activation_formats': {l.path: l.act for l in report.layers},
      'group_size': q.group_size or None, 'granularity': q.granularity,
      'scale_method': ('LSQ learned step sizes (initialised by ' if qc.learn_scales else
                       'recalibrated from the trained weights by ') +
                      f'{q.calibration}{")" if qc.learn_scales else ""}, scales in '
                      f'{q.scale_dtype}',
      'zero_point_method': 'none (symmetric)' if q.symmetric else
                           ('learned (LSQ+), rounded' if qc.learn_scales else
                            'round(qmin - min/scale)'),
      'exempt_modules': [l.path for l in report.layers if not l.quantized],
      'calibration': {'data': ref.data.describe(), 'procedure':
                      f'quantization-aware training, {qc.steps} steps of {qc.batch} x '
                      f'{ref.model.config.max_len} tokens (seed {qc.seed}), lr {qc.lr}, '
                      f'scale lr {qc.scale_lr}' +
                      (f'; Hinton distillation from the float checkpoint, alpha {qc.alpha}, '
                       f'T {qc.temperature}' if distill else '') +
                      (f'; started from a {qc.init} PTQ result (initialisation)' if init_record
                       else '; started from the float model, scales by RTN calibration') +
                      (f'; PACT clips initialised at {qc.pact:g}' if qc.pact else ''),
                      'initialisation': init_record},
      'compute_dtype': ref.model.config.dtype,
      'accumulation_dtype': 'int32 for integer dots, float32 otherwise',
      'compute_path': policy.path,
      'kv_cache_format': (f'{kv} (quantized on write, per token and kv head; K/V '
                          'fake-quantized the same way in training)' if kv else
                          f'{ref.model.config.dtype} (not quantized)'),
      'adapter_merge_status': 'no adapters',
      'evaluation': {k: row[k] for k in ('ppl', 'float_ppl', 'max_abs_logit_diff',
                                         'greedy_agreement', 'weight_bytes',
                                         'train_serve_max_abs_logit_diff')},
  }


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


COLUMNS = (('name', 'point'), ('method', 'method'), ('weight_format', 'format'),
           ('ppl', 'val ppl'), ('rtn_ppl', 'RTN ppl'), ('recovered', 'recovered'),
           ('greedy_agreement', 'greedy agree'), ('weight_bytes', 'weight bytes'),
           ('train_steps', 'steps'), ('train_seconds', 'train s'),
           ('train_serve_max_abs_logit_diff', 'train/serve |Δlogit|'), ('status', 'status'))


def run_qat_sweep(config, points: list[dict], model=None, data=None, log=print) -> list[dict]:
  """Every point (PTQ-RTN or QAT); results.jsonl, table.md, ppl_vs_bytes.png, summary.json."""
  if model is None:
    model, _, data = train_lib.load_trained(config.workdir)
  ref = qexp.FloatReference(model, data, config.eval)
  base_hash = qexp.base_checkpoint_hash(config.workdir)
  named = [(point_name(sweep_lib.apply_overrides(config, ov)), ov) for ov in points]

  def run_point(name, ov):
    c = sweep_lib.apply_overrides(config, ov)
    out = os.path.join(config.out_dir, 'points', name)
    if c.quant.method == 'rtn':  # served with the KV format the QAT points train with
      q = c.quant.copy_and_resolve_references()
      q.kv = kv_name(c)
      return qexp.quantize_and_evaluate(ref, q, out, base_hash)
    return qat_point(ref, c, out, base_hash, log)

  rows = qeval.run_sweep(named, run_point, os.path.join(config.out_dir, 'results.jsonl'),
                         log=log)
  float_row = {'name': 'float', 'method': 'float', 'weight_format': 'f32',
               'ppl': ref.ppl['ppl'], 'weight_bytes': ref.bytes, 'bytes_ratio': 1.0,
               'greedy_agreement': 1.0, 'status': 'ok'}
  rows = [float_row] + recovered(rows, ref.ppl['ppl'])
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:
    f.write(qeval.markdown_table(rows, COLUMNS) + '\n')
  with open(os.path.join(config.out_dir, 'summary.json'), 'w') as f:
    json.dump([{k: r.get(k) for k, _ in COLUMNS} for r in rows], f, indent=2, default=str)
  qeval.plot_ppl_vs_bytes(rows[1:], os.path.join(config.out_dir, 'ppl_vs_bytes.png'),
                          title=f'RTN vs QAT vs QAT + distillation ({len(rows) - 1} points)',
                          baseline=float_row)
  return rows


def main(argv):
  del argv
  config = _CONFIG.value
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  rows = run_qat_sweep(config, sweep_lib.load_sweep(path)())
  print(qeval.markdown_table(rows, COLUMNS))


if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/qat_sweep.py', lock_config=True)
  app.run(main)
