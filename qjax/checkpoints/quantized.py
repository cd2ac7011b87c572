"""Save and load a quantized model with its conversion record, verifying artifact hashes.

The output directory holds `state/` (Orbax, the QArrays' packed codes and scales) and
`conversion_record.json`. The record carries everything needed to rebuild the structure
(`structure_fields`: the model config, the policy, each Einsum's quantization description
'einsum_quant' and the attention's KV format 'kv_qformat'), so `load_quantized(dir)` needs
nothing else, and it refuses to load when any artifact's sha256 differs from the record.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qjax.checkpoints.orbax_io import restore_state, save_state
from qjax.checkpoints.params import param_shapes
from qjax.checkpoints.records import RECORD_NAME, content_sha256, read_record, write_record
from qjax.core import LAYOUT_VERSION, QFormat, check_finite, quantize, scale_shape
from qjax.core.numerics import check_scales
from qjax.nn import (EinsumQuant, QuantPolicy, QuantRule, Transformer, TransformerConfig,
                     einsum_layers, kv_format, quantize_model, set_kv_format)
from qjax.nn.layers import QWeight
from qjax.nn.policy import relayout_model, resolve_format
from qjax.nn.report import LayerReport, QuantReport


def _fmt_dict(f):
  return None if f is None else f.to_dict()


def _fmt(d):
  if d is None:
    return None
  d = dict(d)
  d['channel_axes'] = tuple(d.get('channel_axes', ()))
  return QFormat(**d)


def policy_to_dict(policy: QuantPolicy) -> dict:
  return {'strict': policy.strict, 'path': policy.path,
          'rules': [{'pattern': r.pattern, 'weight': _fmt_dict(r.weight),
                     'act': _fmt_dict(r.act), 'exempt': r.exempt,
                     'granularity': r.granularity} for r in policy.rules]}


def policy_from_dict(d: dict) -> QuantPolicy:
  rules = tuple(QuantRule(r['pattern'], _fmt(r['weight']), _fmt(r['act']), r['exempt'],
                          r['granularity']) for r in d['rules'])
  return QuantPolicy(rules, strict=d['strict'], path=d['path'])


def structure_fields(qmodel: nnx.Module, policy: QuantPolicy) -> dict:
  """The record fields from which `skeleton` rebuilds `qmodel`'s structure.

  Args:
    qmodel: a quantized Transformer (`quantize_model`, `apply_method`, a QAT conversion).
    policy: the policy its weights were quantized with.

  Returns:
    {'policy': the policy as a dict, 'model_config': the TransformerConfig as a dict,
    'einsum_quant': {path: `EinsumQuant.to_dict()`} of every Einsum whose description is not
    the default, 'kv_qformat': the attention's KV format as a dict, or None, 'qarray_layout':
    the QArray layout version (`qjax.core.LAYOUT_VERSION`)}.
  """
  return {'policy': policy_to_dict(policy),
          'model_config': dataclasses.asdict(qmodel.config),
          'einsum_quant': {p: l.quant.to_dict() for p, l in einsum_layers(qmodel)
                           if l.quant != EinsumQuant()},
          'kv_qformat': _fmt_dict(kv_format(qmodel)),
          'qarray_layout': LAYOUT_VERSION}


def fingerprint_tokens(config) -> np.ndarray:
  """The fixed [1, T] token ids a logits fingerprint is taken on (T = min(8, max_len))."""
  t = min(8, config.max_len)
  return ((np.arange(t) * 7919 + 3) % config.vocab_size).astype(np.int32)[None]


def logits_fingerprint(model: nnx.Module) -> dict:
  """The model's logits on `fingerprint_tokens`: their sha256, a sample and row statistics.

  A reload recomputes it (`check_fingerprint`): a record whose structure fields were changed
  (rope_base, a softcap, the MLP kind, an Einsum's description) gives other logits.

  Args:
    model: a Transformer (float or quantized).

  Returns:
    {'tokens', 'shape', 'sha256', 'sample' (the first 16 logits of every position),
    'row_mean', 'row_std' (over the vocabulary, per position), 'max_abs'}.
  """
  tokens = fingerprint_tokens(model.config)
  logits = np.asarray(model(jnp.asarray(tokens)), np.float32)[0]
  return {'tokens': tokens[0].tolist(), 'shape': list(logits.shape),
          'sha256': hashlib.sha256(logits.tobytes()).hexdigest(),
          'sample': logits[:, :16].ravel().tolist(),
          'row_mean': logits.mean(-1).tolist(), 'row_std': logits.std(-1).tolist(),
          'max_abs': float(np.abs(logits).max())}


def check_fingerprint(model: nnx.Module, expected: dict, where: str) -> None:
  """Raise ValueError when `model`'s logits fingerprint differs from `expected`.

  Bit-identical logits pass; otherwise the sample and row statistics must agree within
  1e-3 of the logits' scale (another backend rounds differently; a changed model does not
  come that close).
  """
  got = logits_fingerprint(model)
  if got['sha256'] == expected.get('sha256'):
    return
  tol = 1e-3 * max(1.0, float(expected.get('max_abs', 1.0)))
  worst = 0.0
  for key in ('sample', 'row_mean', 'row_std'):
    a, b = np.asarray(got[key]), np.asarray(expected.get(key, []), dtype=np.float64)
    if a.shape != b.shape:
      worst = float('inf')
      break
    worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
  if not worst <= tol:
    raise ValueError(f'{where}: the reloaded model\'s logits on the fingerprint tokens differ '
                     f'from the recorded ones by up to {worst:.4g} (tolerance {tol:.2g}): the '
                     'record describes another model than the saved weights (a structure '
                     'field such as model_config or policy changed); re-run the conversion.')


def _check_out_dir(out_dir: str) -> None:
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f'output directory {out_dir!r} exists and is a file; pass a directory '
                     'path (new or a previous output) or remove the file.')


def save_quantized(out_dir: str, qmodel: nnx.Module, policy: QuantPolicy, record: dict) -> str:
  """Save `qmodel` (Orbax) and its conversion record (with artifact hashes) to `out_dir`.

  Args:
    out_dir: output directory (created).
    qmodel: the model returned by `quantize_model` (or `apply_method`, or a QAT `convert`).
    policy: the policy it was quantized with (recorded, to rebuild the structure on load).
    record: conversion facts (see `records.REQUIRED_FIELDS`); the `structure_fields` are
      added here. When the model has a KV format, 'kv_cache_format' must name it.

  Returns:
    The record's path.
  """
  structure = structure_fields(qmodel, policy)
  kv = structure['kv_qformat']
  if kv is not None and not str(record.get('kv_cache_format', '')).startswith(
      _fmt(kv).name):
    raise ValueError(f"save_quantized: record['kv_cache_format']="
                     f"{record.get('kv_cache_format')!r}, but the model stores K/V as "
                     f'{_fmt(kv).name} (qjax.nn.kv_format); start the field with that name.')
  _check_out_dir(out_dir)
  # Checkpoints hold the packed layout whatever the model runs in (native codes on GPU/TPU,
  # qjax.core.layouts), so one saved anywhere loads anywhere.
  if any(l.quantized and l.w.get_value().qtype.layout != 'packed'
         for _, l in einsum_layers(qmodel)):
    qmodel = relayout_model(nnx.clone(qmodel), 'packed')
  save_state(out_dir, qmodel)
  structure['content_sha256'] = content_sha256(nnx.state(qmodel))
  structure['logits_fingerprint'] = logits_fingerprint(qmodel)
  return write_record(out_dir, dict(record, **structure))


def _legacy_einsum_quant(record: dict, qmodel: nnx.Module) -> dict:
  """'einsum_quant' for a record written before it existed (from 'act_clip_paths' and the
  PTQ method's `calibration.structure`), over the policy's descriptions."""
  quants = {p: l.quant for p, l in einsum_layers(qmodel)}
  calibration = record.get('calibration') or {}
  opts = calibration.get('options') or {}
  changes = {p: {'pact': True} for p in record.get('act_clip_paths') or ()}
  for p, kind in (calibration.get('structure') or {}).items():
    if kind == 'llm_int8':
      changes.setdefault(p, {}).update(outlier_threshold=opts.get('threshold', 6.0),
                                       outlier_weights=opts.get('outlier_weights', 'float'))
    elif kind == 'explicit_scale':
      changes.setdefault(p, {}).update(input_scale=True)
    else:
      raise ValueError(f"load_quantized: the record's calibration.structure names {kind!r} "
                       f"for {p!r}, which this version cannot rebuild (known: 'llm_int8', "
                       "'explicit_scale'); re-save the model with this version of qjax.")
  for p, change in changes.items():
    if p not in quants:
      raise ValueError(f'load_quantized: the record changes {p!r} ({change}), which the model '
                       f'has no Einsum at (paths look like {list(quants)[:3]}); the record '
                       'does not belong to this architecture.')
    quants[p] = quants[p].replace(**change)
  return {p: q.to_dict() for p, q in quants.items() if q != EinsumQuant()}


def skeleton(record: dict) -> nnx.Module:
  """The quantized model's structure, with placeholder values, that `record` describes.

  `quantize_model` of a fresh model under the recorded policy (the QWeights), then each
  Einsum's recorded description (`einsum_quant`, with placeholder values for the variables
  it implies) and the KV format, so an Orbax restore finds every variable it saved. Records
  written before 'einsum_quant' existed are read through their 'act_clip_paths' and
  `calibration.structure`.

  Args:
    record: a conversion record (`structure_fields` are what it reads).

  Returns:
    The model, ready for `restore_state`.
  """
  for field in ('model_config', 'policy'):
    if not isinstance(record.get(field), dict):
      raise ValueError(f'load_quantized: the record has no {field!r} object (got '
                       f'{type(record.get(field)).__name__}); it is not a save_quantized '
                       'record: re-run the conversion.')
  try:
    cfg = TransformerConfig(**record['model_config'])
  except (TypeError, ValueError) as e:
    raise ValueError(f"load_quantized: the record's field 'model_config' is invalid: {e}; "
                     're-run the conversion.') from None
  try:
    policy = policy_from_dict(record['policy'])
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"load_quantized: the record's field 'policy' is invalid "
                     f'({type(e).__name__}: {e}); re-run the conversion.') from None
  qmodel = quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)), policy, layout='packed')[0]
  layers = dict(einsum_layers(qmodel))
  if 'einsum_quant' in record:
    described = dict(record['einsum_quant'])
  else:
    described = _legacy_einsum_quant(record, qmodel)
  unknown = sorted(set(described) - set(layers))
  if unknown:
    raise ValueError(f"load_quantized: the record's einsum_quant describes {unknown}, which the "
                     f'model has no Einsum at (paths look like {list(layers)[:3]}); the record '
                     'does not belong to this architecture.')
  for path, layer in layers.items():
    try:
      quant = EinsumQuant.from_dict(described[path]) if path in described else EinsumQuant()
      layer.set_quant(quant, **layer.placeholder_values(quant))
    except ValueError as e:
      raise ValueError(f"load_quantized: the record's einsum_quant of {path!r}: {e}") from None
  set_kv_format(qmodel, _fmt(record.get('kv_qformat')), 'load_quantized: kv_qformat')
  return qmodel


def load_quantized(out_dir: str, verify: bool = True):
  """(qmodel, record) from `save_quantized`'s directory, verified.

  Args:
    out_dir: a `save_quantized` output.
    verify: check the record's own hash, the artifact hashes, the arrays' content hash and
      the logits fingerprint (False skips all four: for forensics only).

  Returns:
    (the quantized model in the backend's QArray layout, `qjax.core.layouts`; its record).

  Raises:
    ValueError: any check fails (the message names the file, field or artifact).
  """
  record = read_record(out_dir, verify=verify)
  layout = record.get('qarray_layout', 1)
  if layout != LAYOUT_VERSION:
    raise ValueError(f'load_quantized: {out_dir!r} stores QArrays in layout version {layout} '
                     f'(its record\'s qarray_layout; 1 = the rank+1 "grouped view" scales of an '
                     f'earlier qjax), but this qjax reads layout {LAYOUT_VERSION} (scales of the '
                     "data's rank). Re-run the conversion with this version of qjax.")
  qmodel = restore_state(out_dir, lambda: skeleton(record))
  if verify:
    where = os.path.join(out_dir, RECORD_NAME)
    for field in ('content_sha256', 'logits_fingerprint'):
      if field not in record:
        raise ValueError(f'{where}: the record has no {field!r} (written by an older qjax); '
                         're-run the conversion.')
    got = content_sha256(nnx.state(qmodel))
    if got != record['content_sha256']:
      raise ValueError(f"{where}: the restored arrays' content_sha256 {got[:16]}... differs "
                       f"from the record's {record['content_sha256'][:16]}...; re-run the "
                       'conversion.')
    check_fingerprint(qmodel, record['logits_fingerprint'], where)
  return relayout_model(qmodel), record  # the backend's layout (qjax.core.layouts)


# Weights above this many elements are quantized in blocks of rows (the Gemma embedding:
# 168M elements, 671 MB in float32), so the float copy alive at once is one block.
_STREAM_BLOCK_ELEMENTS = 2**21


def _abstract_model(cfg: TransformerConfig) -> nnx.Module:
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=1)
def _quantize_jit(w, fmt):
  return quantize(w, fmt)


def _quantize_weight(w, fmt, key: str):
  """`quantize` jitted, scales checked (as `quantize_model` does)."""
  q = _quantize_jit(w, fmt)
  check_scales(q.scale, fmt, f'quantize_streamed: the weight {key!r}')
  return q


def _rows_of(params, key: str, start: int, stop: int) -> np.ndarray:
  rows = getattr(params, 'rows', None)
  if rows is not None:
    return rows(key, start, stop)
  return np.asarray(params[key][start:stop])


def _quantize_streamed_weight(params, key: str, shape, dtype, fmt, source: str):
  """The QArray of float weight `key`, read and quantized a block of rows at a time."""
  n = int(np.prod(shape))
  per_row = tuple(scale_shape(shape, fmt))[0] == shape[0]
  block = max(1, _STREAM_BLOCK_ELEMENTS // max(1, n // shape[0]))
  if not per_row or shape[0] <= block:
    value = params[key]
    check_finite(value, f'{source}: parameter {key!r}', _CORRUPT)
    return _quantize_weight(jnp.asarray(value, dtype), fmt, key)
  leaves = None
  for start in range(0, shape[0], block):
    value = _rows_of(params, key, start, min(shape[0], start + block))
    check_finite(value, f'{source}: parameter {key!r} rows {start}..', _CORRUPT)
    q = _quantize_weight(jnp.asarray(value, dtype), fmt, key)
    del value
    parts = (q.data, q.scale, q.zero_point)
    if leaves is None:  # the whole weight's leaves, filled in place block by block
      leaves = [None if a is None else jnp.zeros((shape[0],) + a.shape[1:], a.dtype)
                for a in parts]
    leaves = _put_rows(leaves, parts, start)
  return q.rebuild(leaves)


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(leaves, parts, start):
  return [None if a is None else jax.lax.dynamic_update_slice_in_dim(a, p, start, 0)
          for a, p in zip(leaves, parts)]


_CORRUPT = ('the checkpoint is corrupted or was saved after a diverged run; use another copy '
            'of it.')


def quantize_streamed(cfg: TransformerConfig, params, policy: QuantPolicy, *,
                      source: str = 'checkpoint'):
  """`quantize_model(model_from_params(cfg, params), policy)` without the float model.

  Every weight is read from `params`, cast to `cfg.param_dtype`, quantized and dropped
  before the next is read (the embedding in blocks of rows when its scales are per row), so
  peak memory is the quantized model plus one float weight block, not the float model (Gemma
  3 270M: 1.07 GB in float32). Codes, scales and descriptions equal `quantize_model`'s.

  Args:
    cfg: the architecture.
    params: {qjax path: array in the qjax layout} (`param_cache.LazyParams` reads each on
      access, and blocks of rows with `rows`).
    policy: the quantization rules.
    source: what the params came from, named in error messages.

  Returns:
    (qmodel, QuantReport), as `quantize_model`.
  """
  model = _abstract_model(cfg)
  dtype = jnp.dtype(cfg.param_dtype)
  expected = param_shapes(cfg)
  missing = sorted(set(expected) - set(params))
  extra = sorted(set(params) - set(expected))
  if missing or extra:
    raise ValueError(f'{source}: parameters do not match the model config: missing '
                     f'{missing[:6]}, unexpected {extra[:6]}. The checkpoint and the config '
                     'describe different architectures.')
  reports, used, quantized = [], set(), {}
  for path, layer in einsum_layers(model):
    i, rule = policy.match(path)
    key = f'{path}/w'
    nbytes_float = int(np.prod(layer.weight_shape)) * dtype.itemsize
    if rule is None or rule.exempt:
      reason = 'no rule matched' if rule is None else f'exempt by rule {i} {rule.pattern!r}'
      if rule is not None:
        used.add(i)
      reports.append(LayerReport(path, 'float', 'float', reason, layer.weight_shape,
                                 nbytes_float, nbytes_float))
      continue
    used.add(i)
    fmt = resolve_format(rule, layer, path, policy.path)
    q = _quantize_streamed_weight(params, key, layer.weight_shape, dtype, fmt, source)
    quantized[key] = q
    layer.w = QWeight(q, logical_axes=layer.axes, qformat=fmt)
    layer.set_quant(layer.quant.replace(act_fmt=rule.act, path=policy.path, fake_fmt=None,
                                        learn_scale=False, fake_act_fmt=None))
    reports.append(LayerReport(path, fmt.name, rule.act.name if rule.act else 'float',
                               f'rule {i} {rule.pattern!r}', layer.weight_shape,
                               nbytes_float, q.nbytes))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key = '/'.join(str(p) for p in path)
    value = params[key]
    if tuple(np.shape(value)) != expected[key]:
      raise ValueError(f'{source}: parameter {key!r} has shape {tuple(np.shape(value))}, the '
                       f'model config implies {expected[key]}; the checkpoint does not match '
                       'its config.')
    check_finite(value, f'{source}: parameter {key!r}', _CORRUPT)
    var.set_value(jnp.asarray(value, dtype))
  unused = tuple(r for i, r in enumerate(policy.rules) if i not in used)
  if unused:
    msg = (f'quantize_streamed: {len(unused)} rule(s) matched no layer: '
           f'{[r.pattern for r in unused]} (patterns use re.fullmatch).')
    if policy.strict:
      raise ValueError(msg + ' Fix the patterns or pass strict=False.')
    warnings.warn(msg, stacklevel=2)
  _release_freed_heap()
  return relayout_model(model), QuantReport(tuple(reports), unused, 'quantize')


def _release_freed_heap() -> None:
  """Give the float blocks' freed heap back to the OS (glibc keeps it otherwise; its size after
  quantizing Gemma 3 270M: docs/models.md), so RSS tracks what is alive."""
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to do
    pass
