r"""Post-training quantization of a trained run, with evidence.

  python -m experiments.quantize --config=configs/quantize.py --config.workdir=results/tiny_lm \
      --config.quant.bits=4 --config.quant.group_size=128 [--config.quant.method=gptq]

Loads the latest checkpoint, quantizes through a QuantPolicy with `quant.method` (RTN, or a
calibrated method of `qjax.algorithms.apply_method` fed by the config's calibration set:
`calib.*`, hashed into the record), evaluates the quantized model
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
from qjax.algorithms import apply_method  # noqa: E402
from qjax.nn import QuantPolicy, QuantRule, set_kv_format, weight_bytes  # noqa: E402
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
  return (f'{q.method}-{format_label(q)}' + ('' if q.act == 'none' else f'-a{q.act}') +
          (f'-kv{q.kv}' if q.get('kv') else ''))


def calibration_set(calib, data) -> tuple[np.ndarray, str]:
  """(token ids [n, seq_len], description) of a calib config: random windows of its source.

  `calib.source` '' reads `data.train` (the run's training split, never its validation);
  otherwise a text file tokenized with `data.tokenizer`.
  """
  if calib.source:
    ids = np.asarray(data.tokenizer.encode(qdata.load_text(calib.source)))
    where = calib.source
  else:
    ids, where = data.train, f'{data.source} (training split)'
  try:
    tokens = qdata.random_windows(ids, calib.num_sequences, calib.seq_len, calib.seed)
  except ValueError as e:
    raise ValueError(f'calibration set from {where!r}: {e} (config calib.num_sequences / '
                     'calib.seq_len)') from None
  desc = (f'{where}, {calib.num_sequences} random windows of {calib.seq_len} tokens '
          f'(seed {calib.seed})')
  bos = getattr(data, 'window_bos', None)  # models evaluated with BOS first (Gemma)
  if bos is not None:
    tokens[:, 0] = bos
    desc += f', first token of each set to BOS (id {bos}) as in evaluation'
  return tokens, desc


class FloatReference:
  """The float model's evaluation, computed once and shared by every point of a sweep.

  `windows` ([n, T + 1] token ids) replaces the default cut of `data.valid` into windows of
  the model's max_len (a real model's protocol, e.g. Gemma's BOS-per-window).
  """

  def __init__(self, model, data, e, windows=None):
    self.model, self.data, self.e = model, data, e
    self.windows = (qdata.eval_windows(data.valid, model.config.max_len, e.windows)
                    if windows is None else np.asarray(windows))
    self.ref_tokens = jnp.asarray(self.windows[:e.ref_batch, :-1])
    self.prompts = jnp.asarray(self.windows[e.ref_batch:e.ref_batch + e.greedy_prompts,
                                            :e.prompt_len])
    self.ppl = qeval.perplexity(model, self.windows, e.batch)
    self.logits = qeval.logits(model, self.ref_tokens)
    self.bytes = weight_bytes(model)['total']
    self._calib = {}

  def calibration(self, calib) -> tuple[np.ndarray, str]:
    """`calibration_set(calib, self.data)`, tokenized once per distinct calib config."""
    key = json.dumps(calib.to_dict(), sort_keys=True)
    if key not in self._calib:
      self._calib[key] = calibration_set(calib, self.data)
    return self._calib[key]


def quantize(ref: FloatReference, q, calib=None, options=None):
  """(qmodel, report, calibration record, policy) of `ref.model` under quant config `q`.

  RTN needs neither `calib` nor `options`; the calibrated methods take their calibration
  set from `calib` (a `configs.quantize.calib_config()`) and their options from
  `options[q.method]` (a `configs.quantize.method_options()`).
  """
  policy = make_policy(q)
  if q.method == 'rtn':
    return (*apply_method(ref.model, policy, 'rtn', None), policy)
  if calib is None:
    raise ValueError(f'quant.method={q.method!r} needs a calibration set: give the config a '
                     "calib section (configs/quantize.py calib_config()).")
  tokens, source = ref.calibration(calib)
  opts = dict(options[q.method]) if options is not None and q.method in options else {}
  opts.update(sequential=calib.sequential, batch_size=calib.batch_size, source=source,
              seed=calib.seed)
  return (*apply_method(ref.model, policy, q.method, tokens, opts), policy)


def quantize_and_evaluate(ref: FloatReference, q, out_dir: str, base_hash: str,
                          reload_check: bool = True, calib=None, options=None,
                          warm_repeat: bool = False, base_source: str = 'experiments/train.py',
                          extra_metrics=None) -> dict:
  """Quantize `ref.model` per `q` (see `quantize`), evaluate against float, save with a record.

  `warm_repeat` quantizes a second time and reports that time too: the first includes XLA
  compiles, the second is the algorithm's own cost. `extra_metrics(qmodel, calibration
  record) -> dict` adds columns to the row (e.g. a second dataset's perplexity).
  """
  t0 = time.perf_counter()
  qmodel, report, calibration, policy = quantize(ref, q, calib, options)
  t_quant = time.perf_counter() - t0
  # A quantized KV cache: evaluation runs through it (the full forward quantizes K/V as the
  # cache stores them; greedy generation fills a cache of that format).
  kv = set_kv_format(qmodel, q.get('kv') or None, 'quant.kv')
  warm = None
  if warm_repeat:
    t1 = time.perf_counter()
    quantize(ref, q, calib, options)
    warm = time.perf_counter() - t1
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
         'quantize_seconds': t_quant, 'unused_rules': [r.pattern for r in report.unused_rules],
         'kv_cache_format': kv.name if kv else None}
  row['bytes_ratio'] = row['weight_bytes'] / ref.bytes
  q_before, q_after = row['quantized_layer_bytes']
  row['quantized_bytes_ratio'] = q_after / q_before if q_before else None
  if warm is not None:
    row['warm_seconds'] = warm
  if q.method == 'llm_int8':
    row['int8_fraction'] = calibration['llm_int8']['int8_fraction']
  if calibration.get('data'):
    row['calibration_tokens_sha256'] = calibration['data']['token_sha256']
  if extra_metrics is not None:
    row.update(extra_metrics(qmodel, calibration))
  # ---- save + conversion record
  exempt = [l.path for l in report.layers if not l.quantized]
  record = {
      'base_checkpoint': {'sha256': base_hash, 'source': base_source},
      'tokenizer': ref.data.tokenizer.name, 'source_dtype': ref.model.config.param_dtype,
      'weight_formats': {l.path: l.weight for l in report.layers},
      'activation_formats': {l.path: l.act for l in report.layers},
      'group_size': q.group_size or None, 'granularity': q.granularity,
      'method': q.method,
      'scale_method': f'{q.calibration} ({"symmetric" if q.symmetric else "asymmetric"}), '
                      f'scales in {q.scale_dtype}' + (
                          '' if q.method == 'rtn' else f'; then {q.method} (see calibration)'),
      'zero_point_method': 'none (symmetric)' if q.symmetric else
                           'round(qmin - min/scale), stored in the scale dtype',
      'exempt_modules': exempt,
      'calibration': calibration,
      'compute_dtype': ref.model.config.dtype,
      'accumulation_dtype': 'int32 for integer dots, float32 otherwise',
      'compute_path': {'policy': policy.path, 'resolved': resolved_path(q, policy)},
      'kv_cache_format': (f'{kv.name} (quantized on write, per token and kv head)' if kv else
                          f'{ref.model.config.dtype} (not quantized)'),
      'adapter_merge_status': 'no adapters',
      'evaluation': {k: row[k] for k in ('ppl', 'float_ppl', 'max_abs_logit_diff', 'kl',
                                         'greedy_agreement', 'weight_bytes', 'int8_fraction')
                     if k in row},
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
  row = quantize_and_evaluate(ref, c.quant, out, base_checkpoint_hash(c.workdir),
                              calib=c.calib, options=c.options)
  print(json.dumps(row, indent=2, default=str))
  print(f'\nfloat ppl {ref.ppl["ppl"]:.4f} -> {row["name"]} ppl {row["ppl"]:.4f}; '
        f'weights {row["weight_bytes"]:,} B ({row["bytes_ratio"]:.3f}x float); '
        f'record: {out}/conversion_record.json')


if __name__ == '__main__':
  # Flags are defined here, not at import, so experiments can import each other.
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/quantize.py', lock_config=True)
  app.run(main)
