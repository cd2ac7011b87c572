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
                     '(run experiments/quantize.py to produce one).')
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
