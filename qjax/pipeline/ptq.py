"""One PTQ point, with evidence: quantize a float model, evaluate it against the float one,
save it with its conversion record and check that the reload reproduces it bit for bit.

`FloatReference` evaluates the float model once (perplexity windows, reference logits,
greedy prompts); `quantize_and_evaluate` turns one quant config into a results row. Both
are used by `python -m experiments.quantize`, the sweeps and the QAT sweep.
"""

from __future__ import annotations

import json
import os
import re
import time

import jax.numpy as jnp
import numpy as np

from qjax import checkpoints as qckpt
from qjax import eval as qeval
from qjax import target as qjax_target
from qjax.algorithms import apply_method
from qjax.core import QFormat, choose_path, default_layout
from qjax.nn import (QuantPolicy, QuantRule, einsum_layers, layer_paths, set_kv_format,
                     weight_bytes)
from qjax.train import data as qdata

# The evaluation columns a conversion record repeats, when the row has them.
RECORD_EVALUATION = ('ppl', 'float_ppl', 'max_abs_logit_diff', 'kl', 'greedy_agreement',
                     'weight_bytes', 'int8_fraction')


def make_policy(q) -> QuantPolicy:
  """The QuantPolicy a quant config describes: exempt regex first, then everything else.

  Args:
    q: a `configs/quantize.py` quant section (kind, bits, group_size, act, exempt, ...).

  Returns:
    The QuantPolicy.
  """
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
  """A PTQ point's name: method, format, activations and KV cache, e.g. 'gptq-int3-g128'."""
  return (f'{q.method}-{format_label(q)}' + ('' if q.act == 'none' else f'-a{q.act}') +
          (f'-kv{q.kv}' if q.get('kv') else ''))


def calibration_set(calib, data) -> tuple[np.ndarray, str]:
  """The token windows a calibrated method reads.

  Args:
    calib: a `configs/quantize.py` calib section. `calib.source` '' reads `data.train` (the
      run's training split, never its validation); otherwise a text file tokenized with
      `data.tokenizer`.
    data: the run's TextData; a `window_bos` attribute (Gemma) puts BOS first in every window.

  Returns:
    (token ids [num_sequences, seq_len], a description for the record).
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

  Attributes: model, data, e (the eval config), windows ([n, T + 1] scored windows),
  ref_tokens (the logit-comparison batch), prompts (greedy prompts), ppl, logits, bytes.
  """

  def __init__(self, model, data, e, windows=None):
    """Evaluate `model` on `data.valid` per eval config `e`.

    Args:
      model: the float Transformer.
      data: its TextData (tokenizer, train/valid ids).
      e: a `configs/quantize.py` eval section (windows, batch, ref_batch, greedy_*).
      windows: [n, T + 1] token ids replacing the default cut of `data.valid` into windows
        of the model's max_len (a real model's protocol, e.g. Gemma's BOS-per-window).
    """
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

  def float_row(self) -> dict:
    """The float model's row of a sweep table."""
    return {'name': 'float', 'method': 'float', 'weight_format': 'f32',
            'ppl': self.ppl['ppl'], 'weight_bytes': self.bytes, 'bytes_ratio': 1.0,
            'greedy_agreement': 1.0, 'status': 'ok'}


def quantize(ref: FloatReference, q, calib=None, options=None):
  """Quantize `ref.model` under quant config `q`.

  Args:
    ref: the float reference (its model and, for calibrated methods, its data).
    q: the quant section; `q.method` is 'rtn' or a `qjax.algorithms.apply_method` method.
    calib: the calib section (`configs.quantize.calib_config()`); calibrated methods only.
    options: per-method options (`configs.quantize.method_options()`), `options[q.method]`.

  Returns:
    (qmodel, report, calibration record, policy).
  """
  policy = make_policy(q)
  check_exempt(ref.model, q.exempt)
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


def check_exempt(model, exempt: str) -> None:
  """Refuse a `quant.exempt` regex that keeps no layer float (a typo would quantize the very
  layers it meant to protect, e.g. the embedding).

  Raises:
    ValueError: naming the pattern and the model's layer paths.
  """
  if not exempt:
    return
  try:
    pattern = re.compile(exempt)
  except re.error as e:
    raise ValueError(f'quant.exempt={exempt!r} is not a valid regex ({e}).') from None
  paths = [p for p, _ in einsum_layers(model)]
  if not any(pattern.fullmatch(p) for p in paths):
    raise ValueError(f'quant.exempt={exempt!r} matches no layer (re.fullmatch), so nothing '
                     f'would stay float; layer paths are {paths[:4]}... (e.g. "embed|lm_head"), '
                     "or pass --config.quant.exempt='' to quantize every layer.")


def evaluate(ref: FloatReference, qmodel):
  """The columns every quantized point reports against the float model.

  A quantized KV cache set on `qmodel` is used by the forward and by greedy generation.

  Args:
    ref: the float reference.
    qmodel: the quantized (or QAT-converted) model.

  Returns:
    (columns: ppl, logit differences, KL, greedy agreement, weight bytes; the quantized
    model's logits on `ref.ref_tokens`, for the reload check).
  """
  ppl = qeval.perplexity(qmodel, ref.windows, ref.e.batch)
  qlogits = qeval.logits(qmodel, ref.ref_tokens)
  return {'ppl': ppl['ppl'], 'float_ppl': ref.ppl['ppl'],
          'ppl_delta': ppl['ppl'] - ref.ppl['ppl'], 'eval_tokens': ppl['tokens'],
          **qeval.logit_diff(ref.logits, qlogits),
          'kl': qeval.kl_divergence(ref.logits, qlogits),
          **qeval.greedy_agreement(ref.model, qmodel, ref.prompts, ref.e.greedy_tokens),
          'weight_bytes': weight_bytes(qmodel)['total'], 'float_weight_bytes': ref.bytes}, qlogits


def save_and_verify(out_dir: str, qmodel, policy, record: dict, tokens, logits) -> None:
  """Save `qmodel` with its record, reload it and require its `logits` on `tokens` bit for bit.

  Raises:
    RuntimeError: the reloaded model's logits differ (names `out_dir`).
  """
  qckpt.save_quantized(out_dir, qmodel, policy, record)
  loaded, _ = qckpt.load_quantized(out_dir)
  if not np.array_equal(np.asarray(qeval.logits(loaded, tokens)), np.asarray(logits)):
    raise RuntimeError(f'{out_dir}: the reloaded quantized model does not reproduce its '
                       'logits bit for bit.')


def quantize_and_evaluate(ref: FloatReference, q, out_dir: str, base_hash: str,
                          reload_check: bool = True, calib=None, options=None,
                          warm_repeat: bool = False, base_source: str = 'experiments/train.py',
                          extra_metrics=None) -> dict:
  """Quantize `ref.model` per `q` (see `quantize`), evaluate against float, save with a record.

  Args:
    ref: the float reference.
    q, calib, options: as for `quantize`.
    out_dir: where the quantized model and its conversion record go.
    base_hash: the float checkpoint: its files' sha256, or a dict of facts about it
      (`pipeline.trained_checkpoint`: sha256, content_sha256, step, finished, ...), recorded
      as the record's base_checkpoint.
    reload_check: reload the saved model and require bit-identical logits.
    warm_repeat: quantize a second time and report that time too (the first includes XLA
      compiles; the second is the algorithm's own cost).
    base_source: where the float checkpoint came from, for the record.
    extra_metrics: `(qmodel, calibration record) -> dict` of extra columns (e.g. a second
      dataset's perplexity).

  Returns:
    The results row (name, ppl, logit/greedy/byte columns, timings, out_dir).
  """
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f'out_dir {out_dir!r} exists and is a file; pass a directory path (new, '
                     'or a previous output) or remove the file.')
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
  columns, qlogits = evaluate(ref, qmodel)
  row = {'name': point_name(q), 'method': q.method, 'weight_format': format_label(q),
         **columns,
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
  record = qckpt.conversion_record(
      base_checkpoint={**(base_hash if isinstance(base_hash, dict) else {'sha256': base_hash}),
                       'source': base_source},
      tokenizer=ref.data.tokenizer.name, source_dtype=ref.model.config.param_dtype,
      layers=report.layers, group_size=q.group_size or None, granularity=q.granularity,
      method=q.method,
      scale_method=f'{q.calibration} ({"symmetric" if q.symmetric else "asymmetric"}), '
                   f'scales in {q.scale_dtype}' + (
                       '' if q.method == 'rtn' else f'; then {q.method} (see calibration)'),
      zero_point_method='none (symmetric)' if q.symmetric else
                        'round(qmin - min/scale), stored in the scale dtype',
      calibration=calibration, compute_dtype=ref.model.config.dtype,
      compute_path={'policy': policy.path, 'resolved': resolved_path(policy, qmodel),
                    'layers': layer_paths(qmodel)},
      kv_cache_format=(f'{kv.name} (quantized on write, per token and kv head)' if kv else
                       f'{ref.model.config.dtype} (not quantized)'),
      evaluation={k: row[k] for k in RECORD_EVALUATION if k in row})
  if reload_check:
    save_and_verify(out_dir, qmodel, policy, record, ref.ref_tokens, qlogits)
    row['reload_bit_identical'] = True
  else:
    qckpt.save_quantized(out_dir, qmodel, policy, record)
  row['seconds'] = time.perf_counter() - t0
  row['out_dir'] = out_dir
  return row


def resolved_path(policy, model=None) -> str:
  """The qeinsum paths the policy's layers take on the target (`qjax.target`), for the record.

  With the quantized `model`, the paths its layers take at decode and prefill shapes
  (`qjax.nn.layer_paths`, per layer in the record's 'layers'), counted; without it, the path
  family of the policy's last rule (`qjax.core.choose_path`).
  """
  target = qjax_target.current()
  where = f'on {target.platform} ({target.device_kind})'
  if model is not None:
    counts = {}
    for entry in layer_paths(model).values():
      key = f"decode {entry['decode']['path']}, prefill {entry['prefill']['path']}"
      counts[key] = counts.get(key, 0) + 1
    if counts:
      shown = '; '.join(f'{k} ({n} layer{"s" * (n != 1)})' for k, n in sorted(counts.items()))
      return f'{shown} {where} (qjax.core.paths.choose; per layer in compute_path.layers)'
  if policy.path != 'auto':
    return policy.path
  rule = policy.rules[-1]
  layout = default_layout()
  return (f'{choose_path(rule.weight, rule.act, layout=layout)} {where}, {layout} codes '
          '(qjax.core.choose_path, qjax.core.layouts; see qjax/core/qdot.py)')


def base_checkpoint_hash(workdir: str) -> str:
  """One sha256 over every file of a training run's checkpoints/ (the record's base hash)."""
  return qckpt.digest(qckpt.tree_sha256(os.path.join(workdir, 'checkpoints')))
