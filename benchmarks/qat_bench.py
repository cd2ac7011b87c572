r"""QAT and distillation benchmark on the small trained model: recovery and a smaller student.

Run (after training the base model, see configs/qat_sweep.py):
  XLA_FLAGS= .venv/bin/python -m benchmarks.qat_bench --workdir=/tmp/qat_base \
      --out_dir=/tmp/qat_bench [--qat_steps=40] [--student_steps=300]

1. Recovery: at 3 and 2 bits (per-channel and g32), PTQ-RTN vs QAT vs QAT + distillation
   (the config's QAT settings): perplexity, the fraction of RTN's perplexity loss (against
   the float model) each recovers, and the training cost (steps, wall time with compiles).
   Points are run through the resumable QAT sweep (<out_dir>/recovery/results.jsonl). The
   float model trained the same steps the same way is listed too: the base model is small
   and briefly trained, so part of a QAT point's gain is simply more training:
   `recovered_vs_tuned` measures recovery against that fine-tuned float model instead.
2. A smaller student (half the teacher's layers): the float teacher vs the student distilled
   from it vs the same student trained from scratch on labels, same init, batches and steps.
Writes <out_dir>/bench.json and prints both tables. Timings are wall clock on whatever the
machine is doing (check `uptime`): compare steps, and wall times only within one run.
"""

import argparse
import json
import os
import time

from flax import nnx

from configs import qat_sweep
from qjax import eval as qeval
from qjax import pipeline
from qjax.nn import Transformer, param_count
from qjax.train import data as qdata
from qjax.train import student_config


def recovery(args, model, data) -> list[dict]:
  """Part 1: RTN / QAT / QAT + distillation at 3 and 2 bits."""
  c = qat_sweep.get_config()
  c.workdir, c.out_dir = args.workdir, os.path.join(args.out_dir, 'recovery')
  c.qat.steps = args.qat_steps
  points = [{'quant.bits': b, 'quant.group_size': g, 'quant.method': m}
            for b in (3, 2) for g in (0, 32) for m in qat_sweep.METHODS]
  rows = pipeline.run_qat_sweep(c, points, model, data)
  # The same training on the float model: how much of QAT's gain is just more training.
  tuned = nnx.clone(model)
  stats = pipeline.train_loop(tuned, data, c.qat, model.config.max_len)
  windows = qdata.eval_windows(data.valid, model.config.max_len, c.eval.windows)
  rows.insert(1, {'name': f'float +{c.qat.steps} steps', 'method': 'float fine-tune',
                  'weight_format': 'f32', 'status': 'ok', **stats,
                  'ppl': qeval.perplexity(tuned, windows, c.eval.batch)['ppl']})
  for r in rows:  # against what the same training gives the float model
    if r.get('recovered') is not None:
      r['recovered_vs_tuned'] = (r['rtn_ppl'] - r['ppl']) / (r['rtn_ppl'] - rows[1]['ppl'])
  return [{k: r.get(k) for k in ('name', 'method', 'weight_format', 'ppl', 'rtn_ppl',
                                 'recovered', 'recovered_vs_tuned', 'train_steps',
                                 'train_seconds', 'weight_bytes')}
          for r in rows]


def small_student(args, teacher, data, config) -> list[dict]:
  """Part 2: teacher vs distilled half-depth student vs the same student from scratch."""
  windows = qdata.eval_windows(data.valid, config.data.seq_len, config.train.eval_windows)
  scfg = student_config(teacher.config, num_layers=max(1, teacher.config.num_layers // 2))
  qc = qat_sweep.qat_config()
  qc.steps, qc.batch, qc.lr = args.student_steps, config.train.batch, config.train.lr
  qc.warmup, qc.weight_decay = config.train.warmup, config.train.weight_decay
  qc.alpha, qc.temperature, qc.seed = args.alpha, args.temperature, config.seed
  rows = [{'model': 'float teacher', 'layers': teacher.config.num_layers,
           'params': param_count(teacher), 'steps': config.train.steps,
           'ppl': qeval.perplexity(teacher, windows, config.train.eval_batch)['ppl']}]
  for name, t in (('student, distilled', teacher), ('student, from scratch', None)):
    student = Transformer(scfg, rngs=nnx.Rngs(config.seed + 1))  # same init for both
    stats = pipeline.train_loop(student, data, qc, config.data.seq_len, teacher=t)
    rows.append({'model': name, 'layers': scfg.num_layers, 'params': param_count(student),
                 'steps': qc.steps, 'train_seconds': stats['train_seconds'],
                 'ppl': qeval.perplexity(student, windows, config.train.eval_batch)['ppl']})
  return rows


def _table(rows) -> str:
  cols = list(rows[0])
  for r in rows[1:]:
    cols += [k for k in r if k not in cols]
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else ('' if v is None else str(v))
  lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
  lines += ['| ' + ' | '.join(fmt(r.get(k)) for k in cols) + ' |' for r in rows]
  return '\n'.join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default='/tmp/qat_base', help='a finished experiments/train.py run')
  p.add_argument('--out_dir', default='/tmp/qat_bench')
  p.add_argument('--qat_steps', type=int, default=qat_sweep.qat_config().steps)
  p.add_argument('--student_steps', type=int, default=300)
  p.add_argument('--alpha', type=float, default=0.5)
  p.add_argument('--temperature', type=float, default=2.0)
  p.add_argument('--skip', choices=('none', 'recovery', 'student'), default='none')
  args = p.parse_args()
  t0 = time.perf_counter()
  model, config, data = pipeline.load_trained(args.workdir)
  out = {'workdir': args.workdir, 'args': vars(args)}
  if args.skip != 'recovery':
    out['recovery'] = recovery(args, model, data)
    print('\n## Recovery at 3 and 2 bits\n\n' + _table(out['recovery']), flush=True)
  if args.skip != 'student':
    out['student'] = small_student(args, model, data, config)
    print('\n## Half-depth student\n\n' + _table(out['student']), flush=True)
  out['seconds'] = time.perf_counter() - t0
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, 'bench.json'), 'w') as f:
    json.dump(out, f, indent=2, default=str)
  print(f'\nwrote {args.out_dir}/bench.json ({out["seconds"]:.0f} s)')


if __name__ == '__main__':
  main()
