r"""KV-cache QAT on the small trained model: does training with a quantized cache close its gap?

Run (after training the base model, see configs/qat_sweep.py):
  XLA_FLAGS= .venv/bin/python -m benchmarks.kv_qat_bench --workdir=/tmp/qat_base \
      --out_dir=/tmp/kv_qat_bench [--kv=int4] [--steps=40]

For float weights and for int4-g32 weights (QAT, LSQ scales), the same short run (the QAT
config's optimizer, batches and steps) is made twice from the trained model: without a KV
format, and with `prepare_qat(..., kv=<kv>)`. Each result is evaluated with a float cache and
with the quantized one (perplexity by the full forward, which quantizes K/V exactly as that
cache does: tests/nn/test_kv_format.py). `gap` = ppl(quantized cache) - ppl(float cache).
The untouched model's numbers are listed first. Writes <out_dir>/kv_bench.json.
Expected run time: ~1.5 min (40 steps) / ~3 min (150 steps) on a shared 2-core CPU.
Expected result: KV QAT narrows the gap (mostly by raising the float-cache ppl). The measured
run: docs/training.md (KV-cache QAT).
"""

import argparse
import json
import os

from flax import nnx

from configs import qat_sweep
from qjax import eval as qeval
from qjax import pipeline
from qjax.nn import QuantPolicy, QuantRule, with_kv_format
from qjax.train import convert, data as qdata, prepare_qat


def evaluate(model, windows, batch, kv) -> dict:
  """Perplexity with a float cache and with a `kv` one, and their gap."""
  f = qeval.perplexity(with_kv_format(model, None), windows, batch)['ppl']
  q = qeval.perplexity(with_kv_format(model, kv), windows, batch)['ppl']
  return {'ppl_float_cache': f, f'ppl_{kv}_cache': q, 'gap': q - f}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default='/tmp/qat_base', help='a finished experiments/train.py run')
  p.add_argument('--out_dir', default='/tmp/kv_qat_bench')
  p.add_argument('--kv', default='int4', help='KV cache format (qjax.nn.kvcache.KV_FORMATS)')
  p.add_argument('--steps', type=int, default=qat_sweep.qat_config().steps)
  args = p.parse_args()
  model, _, data = pipeline.load_trained(args.workdir)
  c = qat_sweep.get_config()
  c.qat.steps = args.steps
  windows = qdata.eval_windows(data.valid, model.config.max_len, c.eval.windows)
  rows = [{'weights': 'float', 'kv_qat': 'none', 'steps': 0,
           **evaluate(model, windows, c.eval.batch, args.kv)}]
  q = c.quant
  q.bits, q.group_size, q.method = 4, 32, 'qat'
  settings = [('float', QuantPolicy((QuantRule('.*', exempt=True),)), False),
              ('int4-g32', pipeline.make_policy(q), True)]
  for weights, policy, learn in settings:
    c.qat.learn_scales = learn
    for kv in (None, args.kv):
      qat, _ = prepare_qat(nnx.clone(model), policy, learn_scales=learn, kv=kv)
      stats = pipeline.train_loop(qat, data, c.qat, model.config.max_len, log=lambda s: None)
      served, _ = convert(qat, policy)
      rows.append({'weights': weights, 'kv_qat': kv or 'none', 'steps': stats['train_steps'],
                   'train_loss': stats['train_loss'],
                   **evaluate(served, windows, c.eval.batch, args.kv)})
      print(json.dumps(rows[-1]), flush=True)
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, 'kv_bench.json'), 'w') as f:
    json.dump({'args': vars(args), 'rows': rows}, f, indent=2)
  cols = list(rows[0]) + ['train_loss']
  print('\n| ' + ' | '.join(cols) + ' |\n|' + '---|' * len(cols))
  for r in rows:
    print('| ' + ' | '.join(f'{r[k]:.4f}' if isinstance(r.get(k), float) else str(r.get(k, ''))
                            for k in cols) + ' |')


if __name__ == '__main__':
  main()
