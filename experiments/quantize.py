r"""Post-training quantization (round-to-nearest) of a trained run, with evidence.

  python experiments/quantize.py --config=configs/quantize.py --config.workdir=results/tiny_lm \
      --config.quant.bits=4 --config.quant.group_size=128

Loads the latest checkpoint, quantizes through a QuantPolicy, evaluates the quantized model
against the float one on the same tokens (validation perplexity, logit differences on a fixed
reference batch, greedy agreement, weight bytes), saves the quantized model (Orbax) with a
conversion record, reloads it and checks that its logits reproduce bit for bit.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qjax import checkpoints as qckpt  # noqa: E402
from qjax import eval as qeval  # noqa: E402
from qjax.core import QFormat  # noqa: E402
from qjax.nn import QuantPolicy, QuantRule, quantize_model, weight_bytes  # noqa: E402
from qjax.train import data as qdata  # noqa: E402

from experiments import train as train_lib  # noqa: E402


def make_policy(q) -> QuantPolicy:
  """The QuantPolicy a quant config describes: exempt regex first, then everything else."""
  if q.kind == 'int':
    weight = QFormat(bits=q.bits, kind='int', symmetric=q.symmetric,
                     group_size=q.group_size or None, scale_dtype=q.scale_dtype,
                     calibration=q.calibration, calibration_arg=q.calibration_arg or None)
  else:
    weight = QFormat(bits=8, kind=q.kind, group_size=q.group_size or None,
                     scale_dtype=q.scale_dtype)
  acts = {'none': None, 'int8': QFormat(bits=8), 'e4m3': QFormat(bits=8, kind='e4m3')}
  if q.act not in acts:
    raise ValueError(f'quant.act={q.act!r} is unknown; use one of {sorted(acts)}.')
  rules = []
  if q.exempt:
    rules.append(QuantRule(q.exempt, exempt=True))
  rules.append(QuantRule('.*', weight, act=acts[q.act], granularity=q.granularity))
  return QuantPolicy(tuple(rules), path=q.path)


def format_label(q) -> str:
  """Short weight-format label of a quant config, e.g. 'int4-g128', 'int8-channel-asym'."""
  g = f'g{q.group_size}' if q.group_size else q.granularity
  kind = f'int{q.bits}' if q.kind == 'int' else f'fp8{q.kind}'
  return f'{kind}-{g}' + ('' if q.symmetric else '-asym')


def point_name(q) -> str:
  return f'{q.method}-{format_label(q)}' + ('' if q.act == 'none' else f'-a{q.act}')


class FloatReference:
  """The float model's evaluation, computed once and shared by every point of a sweep."""

  def __init__(self, model, data, e):
    self.model, self.data, self.e = model, data, e
    self.windows = qdata.eval_windows(data.valid, model.config.max_len, e.windows)
    self.ref_tokens = jnp.asarray(self.windows[:e.ref_batch, :-1])
    self.prompts = jnp.asarray(self.windows[e.ref_batch:e.ref_batch + e.greedy_prompts,
                                            :e.prompt_len])
    self.ppl = qeval.perplexity(model, self.windows, e.batch)
    self.logits = qeval.logits(model, self.ref_tokens)
    self.bytes = weight_bytes(model)['total']


def quantize_and_evaluate(ref: FloatReference, q, out_dir: str, base_hash: str,
                          reload_check: bool = True) -> dict:
  """Quantize `ref.model` per `q`, evaluate against the float model, save with a record."""
  t0 = time.perf_counter()
  policy = make_policy(q)
  qmodel, report = quantize_model(ref.model, policy)
  t_quant = time.perf_counter() - t0
  ppl = qeval.perplexity(qmodel, ref.windows, ref.e.batch)
  qlogits = qeval.logits(qmodel, ref.ref_tokens)
  row = {'name': point_name(q), 'method': q.method,
         'weight_format': format_label(q),
         'ppl': ppl['ppl'], 'float_ppl': ref.ppl['ppl'], 'ppl_delta': ppl['ppl'] - ref.ppl['ppl'],
         'eval_tokens': ppl['tokens'], **qeval.logit_diff(ref.logits, qlogits),
         'kl': qeval.kl_divergence(ref.logits, qlogits),
         **qeval.greedy_agreement(ref.model, qmodel, ref.prompts, ref.e.greedy_tokens),
         'weight_bytes': weight_bytes(qmodel)['total'], 'float_weight_bytes': ref.bytes,
         'quantized_layer_bytes': list(report.quantized_bytes()),
         'quantize_seconds': t_quant, 'unused_rules': [r.pattern for r in report.unused_rules]}
  row['bytes_ratio'] = row['weight_bytes'] / ref.bytes
  # ---- save + conversion record
  exempt = [l.path for l in report.layers if not l.quantized]
  record = {
      'base_checkpoint': {'sha256': base_hash, 'source': 'experiments/train.py'},
      'tokenizer': ref.data.tokenizer.name, 'source_dtype': ref.model.config.param_dtype,
      'weight_formats': {l.path: l.weight for l in report.layers},
      'activation_formats': {l.path: l.act for l in report.layers},
      'group_size': q.group_size or None, 'granularity': q.granularity,
      'scale_method': f'{q.calibration} ({"symmetric" if q.symmetric else "asymmetric"}), '
                      f'scales in {q.scale_dtype}',
      'zero_point_method': 'none (symmetric)' if q.symmetric else
                           'round(qmin - min/scale), stored in the scale dtype',
      'exempt_modules': exempt,
      'calibration': {'data': None, 'procedure': 'none: round-to-nearest (RTN) needs no '
                      'calibration data; weight ranges from the weights themselves'},
      'compute_dtype': ref.model.config.dtype,
      'accumulation_dtype': 'int32 for integer dots, float32 otherwise',
      'compute_path': {'policy': policy.path, 'resolved': resolved_path(q, policy)},
      'kv_cache_format': f'{ref.model.config.dtype} (not quantized)',
      'adapter_merge_status': 'no adapters',
      'evaluation': {k: row[k] for k in ('ppl', 'float_ppl', 'max_abs_logit_diff',
                                         'greedy_agreement', 'weight_bytes')},
  }
  qckpt.save_quantized(out_dir, qmodel, policy, record)
  if reload_check:
    loaded, _ = qckpt.load_quantized(out_dir)
    same = np.array_equal(np.asarray(qeval.logits(loaded, ref.ref_tokens)), np.asarray(qlogits))
    if not same:
      raise RuntimeError(f'{out_dir}: the reloaded quantized model does not reproduce its '
                         'logits bit for bit.')
    row['reload_bit_identical'] = True
  row['seconds'] = time.perf_counter() - t0
  row['out_dir'] = out_dir
  return row


def resolved_path(q, policy) -> str:
  """The qeinsum path the policy's layers take on this backend, stated for the record."""
  from qjax.core import choose_path  # pylint: disable=g-import-not-at-top
  if policy.path != 'auto':
    return policy.path
  rule = policy.rules[-1]
  return (f'{choose_path(rule.weight, rule.act)} on {jax.default_backend()} '
          '(qjax.core.choose_path; see qjax/core/qdot.py)')


def base_checkpoint_hash(workdir: str) -> str:
  ckpt = os.path.join(workdir, 'checkpoints')
  return qckpt.digest(qckpt.tree_sha256(ckpt))


def main(argv):
  del argv
  c = _CONFIG.value
  model, _, data = train_lib.load_trained(c.workdir)
  ref = FloatReference(model, data, c.eval)
  out = c.out_dir or os.path.join(c.workdir, 'quantized', point_name(c.quant))
  row = quantize_and_evaluate(ref, c.quant, out, base_checkpoint_hash(c.workdir))
  print(json.dumps(row, indent=2, default=str))
  print(f'\nfloat ppl {ref.ppl["ppl"]:.4f} -> {row["name"]} ppl {row["ppl"]:.4f}; '
        f'weights {row["weight_bytes"]:,} B ({row["bytes_ratio"]:.3f}x float); '
        f'record: {out}/conversion_record.json')


if __name__ == '__main__':
  # Flags are defined here, not at import, so experiments can import each other.
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/quantize.py', lock_config=True)
  app.run(main)
