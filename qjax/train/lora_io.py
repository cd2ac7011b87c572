"""Adapters saved alone: Orbax arrays + a hashed record that names the base they belong to.

    save_adapters(out_dir, model, policy)          # model from apply_adapters, trained
    model, record = load_adapters(out_dir, base)   # base: the same base model, unadapted

The record (`adapters.json`) holds the adapter policy, the shapes of every adapter, the
content hash of the adapter arrays, the sha256 of every file written, and the base model's
content hash (`base_sha256`: the arrays of every non-adapter variable, at the base layer's
own paths, so a base and the same base with adapters hash alike). `load_adapters` refuses a
base with another hash, an edited record and a changed file.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from qjax.checkpoints import records
from qjax.train.lora import AdapterPolicy, adapter_layers, apply_adapters

ADAPTER_RECORD = 'adapters.json'
_NOT_BASE = nnx.Any(nnx.LoRAParam, nnx.RngState)


def base_sha256(model: nnx.Module) -> str:
  """Content hash of the base model's arrays (adapters and RNG state excluded; a wrapped
  layer's arrays counted at its base layer's path, so wrapping does not change the hash)."""
  wrapped = {tuple(p.split('/')) for p, _ in adapter_layers(model)}
  flat = {}
  for path, value in nnx.to_flat_state(nnx.state(model, nnx.Not(_NOT_BASE))):
    keys = tuple(str(k) for k in path)
    for n in range(len(keys)):
      if keys[n] == 'base' and keys[:n] in wrapped:
        keys = keys[:n] + keys[n + 1:]
        break
    flat['/'.join(keys)] = value.get_value() if isinstance(value, nnx.Variable) else value
  return records.content_sha256({k: flat[k] for k in sorted(flat)})


def _adapter_state(model: nnx.Module):
  return nnx.state(model, nnx.LoRAParam)


def save_adapters(out_dir: str, model: nnx.Module, policy: AdapterPolicy,
                  extra: dict | None = None) -> str:
  """Save the adapters of `model` (not its base) and their record.

  Args:
    out_dir: output directory (created; a previous save there is replaced).
    model: a model from `apply_adapters`.
    policy: the policy the adapters were applied with.
    extra: further JSON fields for the record (training procedure, quality, ...).

  Returns:
    The record's path.
  """
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f'save_adapters: {out_dir!r} exists and is a file; pass a directory.')
  state = _adapter_state(model)
  if not jax.tree.leaves(state):
    raise ValueError('save_adapters: the model has no adapters (apply_adapters first).')
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(os.path.abspath(out_dir), 'state'), state, force=True)
  ckpt.wait_until_finished()
  record = {
      'adapter_policy': policy.to_dict(),
      'adapters': {p: {'rank': w.rank, 'scale': w.scale,
                       'a_shape': list(w.lora_a.shape), 'b_shape': list(w.lora_b.shape)}
                   for p, w in adapter_layers(model) if w.lora_a is not None},
      'base_sha256': base_sha256(model),
      'content_sha256': records.content_sha256(state),
      'artifacts': records.tree_sha256(out_dir),
      'runtime': records.runtime_info(),
      **(extra or {}),
  }
  record = json.loads(json.dumps(record, sort_keys=True, default=str))
  record[records.HASH_FIELD] = records.record_sha256(record)
  path = os.path.join(out_dir, ADAPTER_RECORD)
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)
  return path


def read_adapter_record(out_dir: str) -> dict:
  """The adapters' record, with its own hash and every file's sha256 verified."""
  path = os.path.join(out_dir, ADAPTER_RECORD)
  if not os.path.isfile(path):
    raise ValueError(f'{out_dir!r} has no {ADAPTER_RECORD}; it is not a save_adapters output.')
  with open(path, encoding='utf-8') as f:
    record = json.load(f)
  if records.record_sha256(record) != record.get(records.HASH_FIELD):
    raise ValueError(f'{path}: the record does not match its {records.HASH_FIELD}: a field was '
                     'edited after saving; re-save the adapters.')
  records.check_tree_hashes(
      out_dir, {**record['artifacts'], ADAPTER_RECORD: records.tree_sha256(out_dir).get(
          ADAPTER_RECORD, '')},
      missing=lambda rel: f'{out_dir!r}: adapter file {rel!r} is missing; re-save the adapters.',
      changed=lambda rel, got, want: (f'{out_dir!r}: adapter file {rel!r} has sha256 '
                                      f'{got[:16]}..., the record says {want[:16]}...: it was '
                                      'modified; re-save the adapters.'),
      extra=lambda rels: f'{out_dir!r} holds files the record does not list: {rels[:5]}.')
  return record


def load_adapters(out_dir: str, base: nnx.Module, *, rngs: nnx.Rngs | None = None):
  """Put saved adapters on `base` (in place) after checking it is the base they were trained on.

  Args:
    out_dir: a `save_adapters` output.
    base: the base model, without adapters (float, quantized or fake-quantized, as trained).
    rngs: for the skeleton's init and dropout (values are overwritten by the saved ones).

  Returns:
    (the adapted model, the record).

  Raises:
    ValueError: the base's content hash differs from the record's (another model, another
      quantization), or the record / files fail their hashes.
  """
  record = read_adapter_record(out_dir)
  got = base_sha256(base)
  if got != record['base_sha256']:
    raise ValueError(f'load_adapters: the base model has content hash {got[:16]}..., but the '
                     f"adapters in {out_dir!r} were trained on base {record['base_sha256'][:16]}"
                     '...; load them onto that base (same checkpoint, same quantization method '
                     'and format), or retrain the adapters on this one.')
  policy = AdapterPolicy.from_dict(record['adapter_policy'])
  model, _ = apply_adapters(base, policy, rngs=rngs or nnx.Rngs(0))
  state = _adapter_state(model)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  restored = ocp.StandardCheckpointer().restore(
      os.path.join(os.path.abspath(out_dir), 'state'), abstract)
  nnx.update(model, restored)
  if records.content_sha256(_adapter_state(model)) != record['content_sha256']:
    raise ValueError(f'load_adapters: the restored adapters of {out_dir!r} do not match the '
                     "record's content_sha256; re-save the adapters.")
  return model, record
