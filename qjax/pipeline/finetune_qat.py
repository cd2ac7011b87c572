"""QAT + distillation of a real model (Gemma 3 270M) from a PTQ start, against the same
number of steps of plain fine-tuning of the float model; rows of a resumable sweep.

Point kinds (`config.point.kind`):

* 'float': the float model's perplexity;
* 'ptq': the PTQ start (`config.quant`, e.g. GPTQ int4 g128), served with `config.qat.kv`;
* 'qat': `prepare_qat` from that PTQ result (its codes dequantized into the trainable
  weights, LSQ scales initialised from its scales), distilled from the frozen float model
  (`distill_loss`: alpha * CE + (1 - alpha) T^2 KL at temperature T) for `qat.steps` steps,
  converted to real codes (`qjax.train.convert`) and scored; with `qat.kv` the keys and
  values are fake-quantized as that KV cache stores them, in training and scoring;
* 'float_ft': the float model fine-tuned with plain cross entropy, the same steps and data.

The tied embedding (also the float head) is frozen in both trainings (`qat.freeze`): the
student's copy then shares the teacher's buffer, and neither carries optimizer state for
its 168M parameters. Training text is never scored (the scored windows are cut first).
`recovered` = (ptq ppl - qat ppl) / (ptq ppl - float ppl); `recovered_vs_ft` uses the
fine-tuned float model's ppl instead (what the same steps do without quantization).
"""

from __future__ import annotations

import os
import time

import jax
import optax
from flax import nnx

from qjax import eval as qeval
from qjax import train as qtrain
from qjax.nn import set_kv_format
from qjax.pipeline import ptq
from qjax.pipeline.finetune import FinetuneContext, all_rows, run_steps
from qjax.train import distill as qdistill
from qjax.train import lora
from qjax.train.lean_step import lean_step
from qjax.train.optim import make_optimizer

KINDS = ('float', 'ptq', 'qat', 'float_ft')
COLUMNS = (('name', 'point'), ('kind', 'kind'), ('weight_format', 'weights'),
           ('kv', 'KV cache'), ('ppl', 'ppl'), ('recovered', 'recovered (vs float)'),
           ('recovered_vs_ft', 'recovered (vs float FT)'), ('train_steps', 'steps'),
           ('trainable_params', 'trainable params'), ('step_seconds', 'step s'),
           ('train_peak_rss_mib', 'peak RSS MiB'),
           ('steady_peak_rss_mib', 'peak RSS after step 1, MiB'),
           ('train_peak_device_mib', 'peak device MiB'),
           ('train_loss_first', 'loss first'), ('train_loss_last', 'loss last'))


def _wrt(freeze: str):
  """What trains: weights and learned scales, but not the modules named `freeze`."""
  if not freeze:
    return qtrain.TRAINABLE
  return nnx.All(qtrain.TRAINABLE, nnx.Not(nnx.PathContains(freeze)))


def _optimizer(model, qc, wrt):
  tx = make_optimizer(qc.lr, qc.steps, qc.warmup, qc.weight_decay, qc.clip_norm)
  state = nnx.state(model, wrt)
  if not jax.tree.leaves(nnx.state(model, qtrain.QATScale)):
    return nnx.Optimizer(model, tx, wrt=wrt)
  labels = jax.tree.map(lambda v: 'scales' if isinstance(v, qtrain.QATScale) else 'weights',
                        state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.Optimizer(model, optax.multi_transform(
      {'weights': tx, 'scales': qtrain.relative_adam(qc.scale_lr)}, labels), wrt=wrt)


@nnx.jit
def teacher_hidden(teacher, tokens_BT):
  """The frozen teacher's last hidden states [B, T, D] (its own jitted call: the training
  step then holds no teacher activations, and its logits are formed chunk by chunk)."""
  return lora.hidden(teacher, tokens_BT)


def distill_step(student, opt, teacher, wrt, alpha: float, temperature: float, remat: bool,
                 chunk: int):
  """step(h_BTD, batch_BT1) -> loss: `chunked_distill_loss` of the student's hidden states
  against the teacher's (`teacher_hidden`), the teacher's head applied chunk by chunk; the
  trained weights and the optimizer state are donated (`lean_step`: no second copy of the
  weights and Adam moments per step)."""
  def loss_fn(m, t, h_BTD, batch_BT1):
    tokens_BT, labels_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
    return qdistill.chunked_distill_loss(
        m.logits, lora.hidden(m, tokens_BT, remat), labels_BT, chunk=chunk,
        teacher_logits=t.logits, h_BTD=h_BTD, alpha=alpha, temperature=temperature)[0]
  return lean_step(student, opt, wrt, loss_fn, frozen=(teacher,))


def ce_step(model, opt, wrt, remat: bool, chunk: int):
  """step(batch_BT1) -> loss: plain cross entropy, chunked logits, donated state."""
  def loss_fn(m, batch_BT1):
    return qdistill.chunked_distill_loss(m.logits, lora.hidden(m, batch_BT1[:, :-1], remat),
                                         batch_BT1[:, 1:], chunk=chunk)[0]
  return lean_step(model, opt, wrt, loss_fn)


def _trainable(model, wrt) -> int:
  return sum(int(a.size) for a in jax.tree.leaves(nnx.state(model, wrt)))


def qat_point(ctx: FinetuneContext, c, log=print) -> dict:
  """QAT + distillation from the PTQ start (module docstring)."""
  q, qc = c.quant, c.qat
  qdistill.check_distill(qc.alpha, qc.temperature)
  start, _, _, policy = ctx.quantized_base(q, c.get('calib'), c.get('options'),
                                           keep_float=True)
  teacher = ctx.float_model()  # frozen
  student, _ = qtrain.prepare_qat(start, policy, learn_scales=True, kv=qc.kv or None)
  if student.embed.quant.fake_fmt is None and qc.freeze == 'embed':
    # The float, frozen embedding: share the teacher's buffer instead of holding a copy.
    student.embed.w.set_value(teacher.embed.w.get_value())
  wrt = _wrt(qc.freeze)
  opt = _optimizer(student, qc, wrt)
  step = distill_step(student, opt, teacher, wrt, float(qc.alpha), float(qc.temperature),
                      bool(qc.remat), int(qc.loss_chunk))
  t0 = time.perf_counter()
  stats = run_steps(lambda b: step(teacher_hidden(teacher, b[:, :-1]), b), ctx, qc, log)
  row = {**stats, 'train_seconds': time.perf_counter() - t0,
         'trainable_params': _trainable(student, wrt)}
  del opt
  served, _ = qtrain.convert(student, policy)
  row['fake_quant_ppl'] = ctx.ppl(student)
  del student
  row['ppl'] = ctx.ppl(served)
  return row


def float_ft_point(ctx: FinetuneContext, c, log=print) -> dict:
  """Plain fine-tuning of the float model: cross entropy, the QAT point's steps and data."""
  qc = c.qat
  ctx.drop_bases()
  model = nnx.clone(ctx.float_model())
  ctx.drop_float()
  wrt = nnx.All(nnx.Param, nnx.Not(nnx.PathContains(qc.freeze))) if qc.freeze else nnx.Param
  opt = _optimizer(model, qc, wrt)
  step = ce_step(model, opt, wrt, bool(qc.remat), int(qc.loss_chunk))
  t0 = time.perf_counter()
  stats = run_steps(step, ctx, qc, log)
  row = {**stats, 'train_seconds': time.perf_counter() - t0,
         'trainable_params': _trainable(model, wrt)}
  del opt
  row['ppl'] = ctx.ppl(model)
  return row


def point_name(c) -> str:
  kv = f'-kv{c.qat.kv}' if c.qat.kv else ''
  kind = c.point.kind
  if kind == 'float':
    return 'float'
  if kind == 'float_ft':
    return f'float-ft-{c.qat.steps}steps'
  name = ptq.point_name(c.quant)
  return (f'{name}{kv}' if kind == 'ptq' else
          f'qat+distill-{c.qat.steps}steps-from-{name}{kv}')


def qat_sweep_point(ctx: FinetuneContext, c, log=print) -> dict:
  """One point of kind `c.point.kind`."""
  kind = c.point.kind
  if kind not in KINDS:
    raise ValueError(f'point.kind={kind!r} is unknown; use one of {KINDS}.')
  base = {'weight_format': 'float32' if kind in ('float', 'float_ft') else
          f'{c.quant.method} {ptq.format_label(c.quant)}', 'kv': c.qat.kv or 'float'}
  if kind == 'float':
    return {**base, 'kv': 'float', 'ppl': ctx.ppl(ctx.float_model())}
  if kind == 'ptq':
    qm = ctx.quantized_base(c.quant, c.get('calib'), c.get('options'), keep_float=True)[0]
    set_kv_format(qm, c.qat.kv or None, 'qat.kv')
    try:
      return {**base, 'ppl': ctx.ppl(qm)}
    finally:
      set_kv_format(qm, None)
  if kind == 'qat':
    return {**base, **qat_point(ctx, c, log)}
  return {**base, 'kv': 'float', **float_ft_point(ctx, c, log)}


def with_recovery(rows: list[dict]) -> list[dict]:
  """Rows with `recovered` / `recovered_vs_ft` on the QAT rows (against the PTQ row of the
  same weights and KV format, the float row, and the float fine-tune row)."""
  ok = [r for r in rows if r.get('status') == 'ok']
  fl = next((r['ppl'] for r in ok if r['kind'] == 'float'), None)
  ft = next((r['ppl'] for r in ok if r['kind'] == 'float_ft'), None)
  starts = {(r['weight_format'], r['kv']): r['ppl'] for r in ok if r['kind'] == 'ptq'}
  out = []
  for r in rows:
    r = dict(r)
    start = starts.get((r.get('weight_format'), r.get('kv')))
    if r.get('kind') == 'qat' and r.get('status') == 'ok' and start is not None:
      r['ptq_ppl'] = start
      if fl is not None and start > fl:
        r['recovered'] = (start - r['ppl']) / (start - fl)
      if ft is not None and start > ft:
        r['recovered_vs_ft'] = (start - r['ppl']) / (start - ft)
    out.append(r)
  return out


def run_qat_gemma_sweep(config, points: list[dict], ctx: FinetuneContext, log=print):
  """Every point, resumable; writes <out_dir>/results.jsonl and table.md; rows with recovery."""
  from qjax.pipeline.sweeps import apply_overrides, point_config_sha256  # pylint: disable=g-import-not-at-top
  named = [(point_name(apply_overrides(config, ov)), ov) for ov in points]
  keys = {n: {'base': ctx.base_hash, 'config': point_config_sha256(apply_overrides(config, ov))}
          for n, ov in named}

  def run_point(name, ov):
    del name
    c = apply_overrides(config, ov)
    return {'kind': c.point.kind, **qat_sweep_point(ctx, c, log)}

  results = os.path.join(config.out_dir, 'results.jsonl')
  rows = with_recovery(qeval.run_sweep(named, run_point, results, log=log, keys=keys))
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:  # every point so far
    f.write(qeval.markdown_table(with_recovery(all_rows(results)), COLUMNS) + '\n')
  return rows
