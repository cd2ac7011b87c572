"""Save and load a quantized model with its conversion record, verifying artifact hashes.

The output directory holds `state/` (Orbax, the QArrays' packed codes and scales) and
`conversion_record.json`. The record carries everything needed to rebuild the structure
(the model config and the policy), so `load_quantized(dir)` needs nothing else, and it
refuses to load when any artifact's sha256 differs from the record.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from qjax.checkpoints.orbax_io import restore_state, save_state
from qjax.checkpoints.records import read_record, write_record
from qjax.core import QFormat
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, quantize_model


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
    record: conversion facts (see `records.REQUIRED_FIELDS`); 'policy' and 'model_config'
      are added here.

  Returns:
    The record's path.
  """
  save_state(out_dir, qmodel)
  record = dict(record, policy=policy_to_dict(policy),
                model_config=dataclasses.asdict(qmodel.config))
  return write_record(out_dir, record)


def load_quantized(out_dir: str, verify: bool = True):
  """(qmodel, record) from `save_quantized`'s directory; refuses modified artifacts."""
  record = read_record(out_dir, verify=verify)
  cfg = TransformerConfig(**record['model_config'])
  policy = policy_from_dict(record['policy'])
  qmodel = restore_state(out_dir, lambda: quantize_model(
      Transformer(cfg, rngs=nnx.Rngs(0)), policy)[0])
  return qmodel, record
