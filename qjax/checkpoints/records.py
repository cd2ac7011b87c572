"""Conversion records: the audit trail of a quantized checkpoint (seed ch. 33, level 4).

A record states what was converted and how, on what, with which software and hardware, and
the sha256 of every artifact written, so that a loader can refuse a file that changed. The
fields follow the quantisation chapter's list: base checkpoint hash, tokenizer, source dtype,
weight and activation formats, group size, scale and zero-point method, exempt modules,
calibration data and procedure, compute/accumulation dtype, KV-cache format, runtime and
kernel versions, hardware, adapter merge status, output artifact hashes.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from typing import Iterable

import jax

RECORD_NAME = 'conversion_record.json'
REQUIRED_FIELDS = (
    'base_checkpoint', 'tokenizer', 'source_dtype', 'weight_formats', 'activation_formats',
    'group_size', 'scale_method', 'zero_point_method', 'exempt_modules', 'calibration',
    'compute_dtype', 'accumulation_dtype', 'compute_path', 'kv_cache_format', 'runtime',
    'hardware', 'adapter_merge_status', 'artifacts')
_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy', 'ml_dtypes',
             'ml-collections', 'qjax')


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      h.update(chunk)
  return h.hexdigest()


def _files(root: str) -> Iterable[str]:
  for dirpath, _, names in os.walk(root):
    for n in sorted(names):
      rel = os.path.relpath(os.path.join(dirpath, n), root)
      if rel != RECORD_NAME:
        yield rel


def tree_sha256(root: str) -> dict[str, str]:
  """{relative path: sha256} of every file under `root` (the record itself excluded)."""
  if not os.path.isdir(root):
    raise ValueError(f'checkpoint directory {root!r} does not exist; pass the directory '
                     'written by the training or quantization run.')
  return {rel: file_sha256(os.path.join(root, rel)) for rel in sorted(_files(root))}


def digest(hashes: dict[str, str]) -> str:
  """One sha256 over a {path: sha256} map (order independent)."""
  return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def runtime_info() -> dict:
  """Library versions (the 'runtime and kernel version' of the record)."""
  out = {'python': sys.version.split()[0]}
  for p in _PACKAGES:
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      out[p] = None
  return out


def hardware_info() -> dict:
  d = jax.devices()[0]
  return {'backend': jax.default_backend(), 'device_kind': d.device_kind,
          'device_count': jax.device_count(), 'platform': platform.platform(),
          'processor': platform.processor() or platform.machine(), 'cpu_count': os.cpu_count()}


ACCUMULATION = 'int32 for integer dots, float32 otherwise'
# Filled in by `write_record` once the artifacts exist.
_WRITTEN_FIELDS = ('runtime', 'hardware', 'artifacts')


def conversion_record(*, base_checkpoint: dict, tokenizer: str, source_dtype: str,
                      layers, group_size, granularity: str, method: str, scale_method: str,
                      zero_point_method: str, calibration: dict, compute_dtype: str,
                      compute_path, kv_cache_format: str, evaluation: dict,
                      adapter_merge_status: str = 'no adapters',
                      accumulation_dtype: str = ACCUMULATION, **extra) -> dict:
  """The conversion record of one quantized model, before `write_record` completes it.

  Every entry point that converts a model (PTQ, QAT, a real checkpoint's sweep) builds its
  record here, so the fields are the same everywhere.

  Args:
    base_checkpoint: {'sha256': ..., 'source': ...} of the float model converted.
    tokenizer: the tokenizer's name.
    source_dtype, compute_dtype: the float model's parameter and compute dtypes.
    layers: the quantization report's layers (`QuantReport.layers`: `.path`, `.weight`,
      `.act`, `.quantized`); the per-layer formats and the exempt modules come from them.
    group_size: the weight group size (None per channel); granularity: the rule's setting.
    method: 'rtn', 'gptq', ..., 'qat', 'qat+distill'.
    scale_method, zero_point_method: how scales and zero points were chosen, in words.
    calibration: the calibration data and procedure (the algorithms' record, or QAT's).
    compute_path: the qeinsum path (a name, or {'policy': ..., 'resolved': ...}).
    kv_cache_format: the KV cache format, in words.
    evaluation: the headline metrics of the converted model.
    adapter_merge_status, accumulation_dtype: as the names say.
    **extra: further fields a caller records (none is dropped).

  Returns:
    The record (a dict holding every REQUIRED_FIELDS entry but runtime, hardware, artifacts).
  """
  layers = list(layers)
  record = {
      'base_checkpoint': dict(base_checkpoint),
      'tokenizer': tokenizer, 'source_dtype': source_dtype,
      'weight_formats': {l.path: l.weight for l in layers},
      'activation_formats': {l.path: l.act for l in layers},
      'group_size': group_size, 'granularity': granularity, 'method': method,
      'scale_method': scale_method, 'zero_point_method': zero_point_method,
      'exempt_modules': [l.path for l in layers if not l.quantized],
      'calibration': calibration,
      'compute_dtype': compute_dtype, 'accumulation_dtype': accumulation_dtype,
      'compute_path': compute_path, 'kv_cache_format': kv_cache_format,
      'adapter_merge_status': adapter_merge_status, 'evaluation': dict(evaluation),
      **extra,
  }
  missing = [f for f in REQUIRED_FIELDS if f not in record and f not in _WRITTEN_FIELDS]
  if missing:  # REQUIRED_FIELDS grew without this builder: say so at once, not at write
    raise ValueError(f'conversion_record builds no {missing}; add them to the builder.')
  return record


def write_record(out_dir: str, record: dict) -> str:
  """Complete `record` with artifact hashes, runtime and hardware, and write it as JSON.

  Args:
    out_dir: the directory holding the converted artifacts (hashed now, after they exist).
    record: the conversion facts; runtime/hardware/artifacts/created are filled in here.

  Returns:
    The record's path.
  """
  record = dict(record)
  record.setdefault('runtime', runtime_info())
  record.setdefault('hardware', hardware_info())
  record['artifacts'] = tree_sha256(out_dir)
  record['created'] = datetime.datetime.now(datetime.timezone.utc).isoformat()
  missing = [f for f in REQUIRED_FIELDS if f not in record]
  if missing:
    raise ValueError(f'conversion record is missing {missing}; a conversion cannot be '
                     'audited without them (fill them in, "none" is an allowed value).')
  path = os.path.join(out_dir, RECORD_NAME)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, path)
  return path


def read_record(out_dir: str, verify: bool = True) -> dict:
  """Read a conversion record and (by default) verify every artifact's sha256.

  Raises:
    ValueError: no record, a missing artifact, or a hash mismatch (names the file).
  """
  path = os.path.join(out_dir, RECORD_NAME)
  if not os.path.isfile(path):
    raise ValueError(f'{out_dir!r} has no {RECORD_NAME}; it is not a qjax conversion output '
                     '(run `python -m experiments.quantize` to produce one).')
  with open(path) as f:
    record = json.load(f)
  if verify:
    actual = tree_sha256(out_dir)
    for rel, sha in record['artifacts'].items():
      if rel not in actual:
        raise ValueError(f'artifact {rel!r} listed in {path} is missing from {out_dir!r}; the '
                         'checkpoint is incomplete: re-run the conversion.')
      if actual[rel] != sha:
        raise ValueError(f'artifact {rel!r} in {out_dir!r} has sha256 {actual[rel][:16]}... but '
                         f'the conversion record says {sha[:16]}...: the file was modified or '
                         'corrupted; re-run the conversion or restore the original file.')
    extra = sorted(set(actual) - set(record['artifacts']))
    if extra:
      raise ValueError(f'{out_dir!r} holds files the conversion record does not list: '
                       f'{extra[:5]}; remove them or re-run the conversion.')
  return record
