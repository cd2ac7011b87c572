"""Save and load a quantized model with its conversion record, verifying artifact hashes.

The output directory holds `state/` (Orbax, the QArrays' packed codes and scales) and
`conversion_record.json`. The record carries everything needed to rebuild the structure
(the model config and the policy; for a QAT-converted model also the layers with a PACT
clip, 'act_clip_paths', and the attention's KV format, 'kv_qformat'), so
`load_quantized(dir)` needs nothing else, and it refuses to load when any artifact's sha256
differs from the record.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from qjax.checkpoints.orbax_io import restore_state, save_state
from qjax.checkpoints.records import read_record, write_record
from qjax.core import QFormat
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers,
                     kv_format, quantize_model, set_kv_format)
from qjax.nn.layers import QATScale


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


def save_quantized(out_dir: str, qmodel: nnx.Module, policy: QuantPolicy, record: dict) -> str:
  """Save `qmodel` (Orbax) and its conversion record (with artifact hashes) to `out_dir`.

  Args:
    out_dir: output directory (created).
    qmodel: the model returned by `quantize_model`.
    policy: the policy it was quantized with (recorded, to rebuild the structure on load).
    record: conversion facts (see `records.REQUIRED_FIELDS`); 'policy', 'model_config',
      'act_clip_paths' and 'kv_qformat' (`qat_structure`) are added here. When the model
      has a KV format, 'kv_cache_format' must name it.

  Returns:
    The record's path.
  """
  structure = qat_structure(qmodel)
  kv = structure['kv_qformat']
  if kv is not None and not str(record.get('kv_cache_format', '')).startswith(
      _fmt(kv).name):
    raise ValueError(f"save_quantized: record['kv_cache_format']="
                     f"{record.get('kv_cache_format')!r}, but the model stores K/V as "
                     f'{_fmt(kv).name} (qjax.nn.kv_format); start the field with that name.')
  save_state(out_dir, qmodel)
  record = dict(record, policy=policy_to_dict(policy),
                model_config=dataclasses.asdict(qmodel.config), **structure)
  return write_record(out_dir, record)


def qat_structure(qmodel: nnx.Module) -> dict:
  """What a QAT-converted model holds beyond its policy: its PACT clips and KV format.

  Returns:
    {'act_clip_paths': Einsum paths with a PACT clip (`act_clip`), 'kv_qformat': the
    attention's KV format as a dict, or None}.
  """
  return {'act_clip_paths': [p for p, l in einsum_layers(qmodel) if l.act_clip is not None],
          'kv_qformat': _fmt_dict(kv_format(qmodel))}


def _rebuild_qat_structure(qmodel: nnx.Module, record: dict) -> nnx.Module:
  """`qat_structure` of the record put back: placeholder PACT clips, the KV format."""
  layers = dict(einsum_layers(qmodel))
  for path in record.get('act_clip_paths') or ():
    if path not in layers:
      raise ValueError(f'load_quantized: the record lists a PACT clip on {path!r}, which the '
                       f'model has no Einsum at (paths look like {list(layers)[:3]}); the '
                       'record does not belong to this architecture.')
    layers[path].act_clip = nnx.data(QATScale(jnp.zeros((), jnp.float32)))
  set_kv_format(qmodel, _fmt(record.get('kv_qformat')), 'load_quantized: kv_qformat')
  return qmodel


def skeleton(record: dict) -> nnx.Module:
  """The quantized model's structure, with placeholder values, that `record` describes.

  `quantize_model` of a fresh model under the recorded policy, then the module swaps a PTQ
  method made (`record['calibration']['structure']`: LLM.int8() layers, explicit AWQ /
  SmoothQuant input scales) and the PACT clips and KV format of a QAT conversion
  (`qat_structure`), so an Orbax restore finds every variable it saved.
  """
  # Imported here: the algorithms import the checkpoint-free core only, never this module.
  from qjax.algorithms.apply import rebuild_structure  # pylint: disable=g-import-not-at-top
  cfg = TransformerConfig(**record['model_config'])
  policy = policy_from_dict(record['policy'])
  qmodel = quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)), policy)[0]
  calibration = record.get('calibration') or {}
  if calibration.get('structure'):
    qmodel = rebuild_structure(qmodel, calibration)
  if record.get('act_clip_paths') or record.get('kv_qformat'):  # a QAT conversion's
    qmodel = _rebuild_qat_structure(qmodel, record)
  return qmodel


def load_quantized(out_dir: str, verify: bool = True):
  """(qmodel, record) from `save_quantized`'s directory; refuses modified artifacts."""
  record = read_record(out_dir, verify=verify)
  qmodel = restore_state(out_dir, lambda: skeleton(record))
  return qmodel, record
