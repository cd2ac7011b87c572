r"""PTQ algorithms sweep: RTN / GPTQ / AWQ weight-only and W8A8 plain / SmoothQuant / LLM.int8().

  .venv/bin/python benchmarks/ptq_sweep.py --config=configs/ptq_algorithms.py \
      --config.workdir=/tmp/ptq_lm

Every point quantizes the trained model of `workdir` with `qjax.algorithms.apply_method`
(calibration: random windows of the run's training split) and is evaluated against the float
model exactly as experiments/quantize.py evaluates RTN (its FloatReference: validation
perplexity, logits on a reference batch, greedy agreement). Writes `<out_dir>/table.md` and
`<out_dir>/results.json` (rows and each point's calibration record).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import numpy as np  # noqa: E402

from qjax import eval as qeval  # noqa: E402
from qjax.algorithms.apply import apply_method  # noqa: E402
from qjax.nn import weight_bytes  # noqa: E402

from experiments import quantize as qexp  # noqa: E402
from experiments import train as train_lib  # noqa: E402

# Pipes inside a header are escaped, or Markdown splits the column.
COLUMNS = (('name', 'point'), ('ppl', 'val ppl'), ('ppl_delta', 'Δ ppl'),
           ('max_abs_logit_diff', r'max \|Δlogit\|'),
           ('mean_abs_logit_diff', r'mean \|Δlogit\|'),
           ('kl', 'KL'), ('greedy_agreement', 'greedy agree'), ('bytes_ratio', 'bytes/float'),
           ('quantize_seconds', 'quant s (cold)'), ('warm_seconds', 'quant s (warm)'),
           ('int8_fraction', 'int8 frac'))


def calibration_tokens(train_ids: np.ndarray, n: int, seq_len: int, seed: int) -> np.ndarray:
  """`n` random windows of `seq_len` tokens from the training split (never validation)."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, train_ids.size - seq_len, size=n)
  return np.stack([train_ids[s:s + seq_len] for s in starts]).astype(np.int32)


def evaluate(ref: qexp.FloatReference, qmodel) -> dict:
  """The metrics experiments/quantize.py reports for a quantized model."""
  ppl = qeval.perplexity(qmodel, ref.windows, ref.e.batch)
  qlogits = qeval.logits(qmodel, ref.ref_tokens)
  row = {'ppl': ppl['ppl'], 'float_ppl': ref.ppl['ppl'], 'ppl_delta': ppl['ppl'] - ref.ppl['ppl'],
         **qeval.logit_diff(ref.logits, qlogits), 'kl': qeval.kl_divergence(ref.logits, qlogits),
         **qeval.greedy_agreement(ref.model, qmodel, ref.prompts, ref.e.greedy_tokens),
         'weight_bytes': weight_bytes(qmodel)['total']}
  row['bytes_ratio'] = row['weight_bytes'] / ref.bytes
  return row


def _suffix(extra: dict) -> str:
  return ''.join(f'+{k}={v}' for k, v in extra.items())


def run_point(ref, c, method: str, overrides: dict, extra: dict, calib: np.ndarray,
              log=print) -> dict:
  """Quantize one point (method, quant-template overrides, option overrides) and evaluate."""
  q = c.quant.copy_and_resolve_references()
  q.update(overrides)
  q.method = method
  policy = qexp.make_policy(q)
  options = {**dict(c.options[method]), 'sequential': c.calib.sequential,
             'batch_size': c.calib.batch_size, 'source': c.calib_source, 'seed': c.calib.seed,
             **extra}
  t0 = time.perf_counter()
  qmodel, report, record = apply_method(ref.model, policy, method, calib, options)
  row = {'name': qexp.point_name(q) + _suffix(extra), 'method': method,
         'weight_format': qexp.format_label(q), 'options': extra,
         'quantize_seconds': time.perf_counter() - t0}
  if c.warm_repeat:  # the same point again: XLA compiles are cached, the algorithm is not
    t0 = time.perf_counter()
    apply_method(ref.model, policy, method, calib, options)
    row['warm_seconds'] = time.perf_counter() - t0
  row.update(evaluate(ref, qmodel))
  if method == 'llm_int8':
    row['int8_fraction'] = record['llm_int8']['int8_fraction']
  row['calibration'] = record
  row['report'] = str(report)
  log(f"{row['name']:<36} ppl {row['ppl']:.4f} (Δ {row['ppl_delta']:+.4f})  "
      f"quant {row['quantize_seconds']:.1f}s / warm {row.get('warm_seconds', 0):.1f}s")
  return row


def main(argv):
  del argv
  c = _CONFIG.value.copy_and_resolve_references()
  model, _, data = train_lib.load_trained(c.workdir)
  ref = qexp.FloatReference(model, data, c.eval)
  calib = calibration_tokens(data.train, c.calib.num_sequences, c.calib.seq_len, c.calib.seed)
  c.calib_source = (f'{data.source} (training split), {c.calib.num_sequences} random windows '
                    f'of {c.calib.seq_len} tokens')
  print(f'float: val ppl {ref.ppl["ppl"]:.4f} on {ref.ppl["tokens"]} tokens; calibration '
        f'{calib.shape} from the training split', flush=True)
  rows = []
  for method, overrides, extra in c.points:
    rows.append(run_point(ref, c, method, dict(overrides), dict(extra), calib,
                          log=lambda s: print(s, flush=True)))
  table = qeval.markdown_table(rows, COLUMNS)
  os.makedirs(c.out_dir, exist_ok=True)
  header = (f'PTQ sweep of {c.workdir} ({model.config.num_layers} layers, d_model '
            f'{model.config.d_model}); float val ppl {ref.ppl["ppl"]:.4f} on '
            f'{ref.ppl["tokens"]} tokens; calibration: {c.calib_source}, seed {c.calib.seed}, '
            f"{'sequential' if c.calib.sequential else 'non-sequential'}.\n\n")
  with open(os.path.join(c.out_dir, 'table.md'), 'w') as f:
    f.write(header + table + '\n')
  with open(os.path.join(c.out_dir, 'results.json'), 'w') as f:
    json.dump({'float_ppl': ref.ppl, 'config': c.to_dict(), 'rows': rows}, f, indent=1,
              default=str)
  print('\n' + header + table)


if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/ptq_algorithms.py',
                                            lock_config=False)
  app.run(main)
