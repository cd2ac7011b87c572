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
import stat
import sys
from typing import Any, Iterable

import jax
import numpy as np

from qjax import target as qjax_target
from qjax.core import decode_paths

RECORD_NAME = 'conversion_record.json'
REQUIRED_FIELDS = (
    'base_checkpoint', 'tokenizer', 'source_dtype', 'weight_formats', 'activation_formats',
    'group_size', 'scale_method', 'zero_point_method', 'exempt_modules', 'calibration',
    'compute_dtype', 'accumulation_dtype', 'compute_path', 'kv_cache_format', 'runtime',
    'hardware', 'adapter_merge_status', 'artifacts')
_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy', 'ml_dtypes',
             'ml-collections', 'qjax')


def file_sha256(path: str) -> str:
  """sha256 of a regular file's bytes."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      h.update(chunk)
  return h.hexdigest()


def _check_entry(path: str, root_real: str, root: str) -> None:
  """Refuse what hashing could hang on or escape through: FIFOs, devices, sockets, outward
  symlinks (a symlink to /dev/zero would be read forever)."""
  st = os.lstat(path)
  if stat.S_ISLNK(st.st_mode):
    target = os.path.realpath(path)
    if os.path.commonpath([target, root_real]) != root_real:
      raise ValueError(f'{path!r} is a symlink to {target!r}, outside the checkpoint directory '
                       f'{root!r}; a checkpoint must hold its own files (copy the file in).')
    if not os.path.exists(path):
      raise ValueError(f'{path!r} is a symlink to {os.readlink(path)!r}, which does not exist '
                       '(a dangling link: its target was moved or deleted); restore the file '
                       'or save the checkpoint again.')
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
      raise ValueError(f'{path!r} is a symlink to a directory; a checkpoint directory holds '
                       'plain files and directories only (copy it in).')
  if not stat.S_ISREG(st.st_mode):
    kind = ('a FIFO' if stat.S_ISFIFO(st.st_mode) else 'a device' if
            stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
            'a socket' if stat.S_ISSOCK(st.st_mode) else 'not a regular file')
    raise ValueError(f'{path!r} is {kind}; a checkpoint directory may hold regular files only '
                     '(remove it).')


def _files(root: str) -> Iterable[str]:
  root_real = os.path.realpath(root)
  for dirpath, dirnames, names in os.walk(root):
    dirnames.sort()
    for d in dirnames:  # os.walk does not descend into symlinked dirs: refuse them instead
      if os.path.islink(os.path.join(dirpath, d)):
        _check_entry(os.path.join(dirpath, d), root_real, root)
    for n in sorted(names):
      full = os.path.join(dirpath, n)
      rel = os.path.relpath(full, root)
      if rel != RECORD_NAME:
        _check_entry(full, root_real, root)
        yield rel


def tree_sha256(root: str) -> dict[str, str]:
  """{relative path: sha256} of every file under `root` (the record itself excluded).

  Raises:
    ValueError: `root` is missing, or holds a FIFO, device, socket or a symlink leading out
      of it (named), which hashing would hang on or escape through.
  """
  if not os.path.isdir(root):
    raise ValueError(f'checkpoint directory {root!r} does not exist; pass the directory '
                     'written by the training or quantization run.')
  return {rel: file_sha256(os.path.join(root, rel)) for rel in sorted(_files(root))}


def _leaf_bytes(leaf) -> tuple[str, tuple[int, ...], np.ndarray]:
  """dtype name, shape and the leaf's bytes as a uint8 view (no copy of a contiguous array)."""
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  a = np.ascontiguousarray(np.asarray(leaf))
  return a.dtype.name, tuple(a.shape), a.reshape(-1).view(np.uint8)


def check_tree_hashes(root: str, expected: dict[str, str], *, missing, changed, extra) -> None:
  """Raise ValueError unless the regular files under `root` hash exactly to `expected`.

  `missing(rel)`, `changed(rel, actual_sha, expected_sha)` and `extra(rels)` build the
  messages, so each caller names its own artifact and fix.
  """
  actual = tree_sha256(root)
  for rel, sha in expected.items():
    if rel not in actual:
      raise ValueError(missing(rel))
    if actual[rel] != sha:
      raise ValueError(changed(rel, actual[rel], sha))
  surplus = sorted(set(actual) - set(expected))
  if surplus:
    raise ValueError(extra(surplus))


def content_sha256(tree: Any) -> str:
  """One sha256 over a pytree's arrays: each leaf's path, dtype, shape and bytes, in order.

  Unlike `tree_sha256` of the files Orbax writes (random chunk names, timestamps, absolute
  paths), this depends on the values only, so two runs that compute the same arrays give
  the same hash: a rerun can prove it reproduced a result.

  Args:
    tree: any pytree of arrays (e.g. `nnx.state(model)`).

  Returns:
    The hex digest.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype, shape, data = _leaf_bytes(leaf)
    h.update(json.dumps([jax.tree_util.keystr(path), dtype, list(shape)]).encode())
    h.update(hashlib.sha256(data).digest())
  return h.hexdigest()


def digest(hashes: dict[str, str]) -> str:
  """One sha256 over a {path: sha256} map (order independent)."""
  return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def runtime_info() -> dict:
  """Library versions and the CPU decode paths (the 'runtime and kernel version' of the
  record): whether the CPU kernel ran, and why not (`decode_paths.cpu_decode_forms`)."""
  out = {'python': sys.version.split()[0]}
  for p in _PACKAGES:
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      out[p] = None
  out['cpu_decode'] = decode_paths.cpu_decode_forms()
  return out


def hardware_info() -> dict:
  """The host that wrote the record and the target its programs were traced for."""
  d = jax.devices()[0]
  return {'backend': jax.default_backend(), 'device_kind': d.device_kind,
          'device_count': jax.device_count(), 'platform': platform.platform(),
          'processor': platform.processor() or platform.machine(), 'cpu_count': os.cpu_count(),
          'target': qjax_target.current().facts()}


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


# Types a loader relies on (None allowed where listed). The other REQUIRED_FIELDS are
# descriptive and free-form ('none' is an allowed value of each).
FIELD_TYPES = {
    'artifacts': (dict,), 'record_sha256': (str,), 'content_sha256': (str,),
    'model_config': (dict,), 'policy': (dict,), 'einsum_quant': (dict,),
    'kv_qformat': (dict, type(None)), 'qarray_layout': (int,), 'logits_fingerprint': (dict,),
    'base_checkpoint': (dict, str),
}
HASH_FIELD = 'record_sha256'


def _normalized(record: dict) -> dict:
  """The record as JSON stores it (tuples -> lists, objects -> str), so a hash computed
  before writing equals the one recomputed after reading."""
  return json.loads(json.dumps(record, sort_keys=True, default=str))


def record_sha256(record: dict) -> str:
  """sha256 over every field of a record but `record_sha256` itself.

  It covers the fields that rebuild the model (model config, policy, KV format, Einsum
  descriptions), which no artifact hash does: editing one by hand must not load silently.
  """
  body = {k: v for k, v in _normalized(record).items() if k != HASH_FIELD}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def validate_record(record: Any, path: str) -> None:
  """Raise ValueError naming `path` and the field when `record` breaks the schema.

  Args:
    record: a parsed conversion record.
    path: its file (for the message).
  """
  if not isinstance(record, dict):
    raise ValueError(f'{path}: a conversion record is a JSON object, got '
                     f'{type(record).__name__}; the file is not a qjax record (re-run the '
                     'conversion).')
  missing = [f for f in REQUIRED_FIELDS if f not in record]
  if missing:
    raise ValueError(f'{path}: the conversion record has no field(s) {missing}; it is '
                     'incomplete or was edited: re-run the conversion.')
  for field, types in FIELD_TYPES.items():
    if field not in record:
      continue
    value = record[field]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
      want = ' or '.join('null' if t is type(None) else t.__name__ for t in types)
      raise ValueError(f'{path}: field {field!r} is {type(value).__name__} '
                       f'{str(value)[:60]!r}, expected {want}; the record was edited '
                       'or corrupted: re-run the conversion.')
  for rel, sha in record['artifacts'].items():
    if not isinstance(sha, str):
      raise ValueError(f"{path}: field 'artifacts' maps {rel!r} to {sha!r}, expected a sha256 "
                       'hex string; re-run the conversion.')


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
  return _sign_and_write(_normalized(record), os.path.join(out_dir, RECORD_NAME))


def _sign_and_write(record: dict, path: str) -> str:
  """Hash `record` (without its old hash) into HASH_FIELD, validate it, write it atomically."""
  record.pop(HASH_FIELD, None)
  record[HASH_FIELD] = record_sha256(record)
  validate_record(record, path)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def read_record(out_dir: str, verify: bool = True) -> dict:
  """Read a conversion record; validate its schema, its own hash and every artifact's sha256.

  Args:
    out_dir: the conversion output directory.
    verify: check the record hash and the artifact hashes (the schema is always checked).

  Returns:
    The record.

  Raises:
    ValueError: no record, unreadable JSON, a bad field, an edited record, a missing,
      modified or unexpected artifact (each names the file and the field or artifact).
  """
  path = os.path.join(out_dir, RECORD_NAME)
  if not os.path.isfile(path):
    writers = ('python -m experiments.convert --config.source=HF_DIR --config.out=OUT (a HF '
               'checkpoint) or python -m experiments.quantize writes one')
    if not os.path.isdir(out_dir):
      raise ValueError(f'{out_dir!r} does not exist or is not a directory, so it has no '
                       f'{RECORD_NAME}; pass a qjax conversion output ({writers}).')
    if os.path.isfile(os.path.join(out_dir, 'config.json')):
      raise ValueError(f'{out_dir!r} has no {RECORD_NAME}: it is a HF checkpoint, not a qjax '
                       'conversion output; convert it first (python -m experiments.convert '
                       f'--config.source={out_dir} --config.out=OUT --config.method=float to '
                       'keep it unquantized) and pass OUT.')
    raise ValueError(f'{out_dir!r} has no {RECORD_NAME}; it is not a qjax conversion output '
                     f'({writers}).')
  try:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON ({e}); the record is truncated or corrupted: '
                     're-run the conversion.') from None
  validate_record(record, path)
  if verify:
    if HASH_FIELD not in record:
      raise ValueError(f'{path}: the record has no {HASH_FIELD!r} (written before records '
                       'were hashed, or the field was removed); re-run the conversion.')
    if record_sha256(record) != record[HASH_FIELD]:
      raise ValueError(f'{path}: the record\'s content does not match its {HASH_FIELD} '
                       f'({record[HASH_FIELD][:16]}...): a field was edited after the '
                       'conversion (e.g. model_config or policy, which rebuild the model); '
                       're-run the conversion or restore the original record.')
    check_tree_hashes(
        out_dir, record['artifacts'],
        missing=lambda rel: (f'artifact {rel!r} listed in {path} is missing from {out_dir!r}; '
                             'the checkpoint is incomplete: re-run the conversion.'),
        changed=lambda rel, got, want: (
            f'artifact {rel!r} in {out_dir!r} has sha256 {got[:16]}... but the conversion '
            f'record says {want[:16]}...: the file was modified or corrupted; re-run the '
            'conversion or restore the original file.'),
        extra=lambda rels: (f'{out_dir!r} holds files the conversion record does not list: '
                            f'{rels[:5]}; remove them or re-run the conversion.'))
  return record


def verify_base(record: dict, *, file: str | None = None, tree: Any = None) -> str:
  """Check a record's base checkpoint against the base when it is available.

  Args:
    record: a conversion record.
    file: the base checkpoint file (e.g. the GGUF), compared with base_checkpoint['sha256'].
    tree: the base model's arrays (`nnx.state(float_model)`), compared with
      base_checkpoint['content_sha256'] when the record has one.

  Returns:
    What was verified, in words (for the validation report).

  Raises:
    ValueError: a hash differs (names both), or a given base has no hash to compare with.
  """
  base = record.get('base_checkpoint')
  base = base if isinstance(base, dict) else {'sha256': base}
  done = []
  if file is not None:
    want = base.get('sha256')
    if not isinstance(want, str):
      raise ValueError(f'verify_base: the record states no base sha256 to check {file!r} '
                       'against; re-run the conversion with a hashed base.')
    got = file_sha256(file)
    if got != want:
      raise ValueError(f'verify_base: {file!r} has sha256 {got[:16]}... but the record\'s '
                       f'base checkpoint is {want[:16]}...: this model was converted from '
                       'another base; validate against the base it names.')
    done.append(f'base file sha256 {got[:16]}... matches')
  if tree is not None:
    want = base.get('content_sha256')
    if want is None:
      done.append('base arrays: the record states no content_sha256 (not checked)')
    else:
      got = content_sha256(tree)
      if got != want:
        raise ValueError(f'verify_base: the base model\'s content_sha256 {got[:16]}... differs '
                         f'from the record\'s {want[:16]}...: this model was converted from '
                         'another base; validate against the base it names.')
      done.append(f'base content_sha256 {got[:16]}... matches')
  return '; '.join(done) if done else 'base not available: not verified'


def amend_record(out_dir: str, fields: dict, *, replaced: str = '') -> str:
  """Add `fields` to a verified record (e.g. a link to its validation report) and re-hash.

  The record's own hash and every artifact are checked first, except files under `replaced`
  (a subdirectory such as 'validation/', whose files the caller has just (re)written); the
  artifacts are then hashed anew (so those files become covered) and the record re-signed.

  Returns:
    The record's path.
  """
  path = os.path.join(out_dir, RECORD_NAME)
  record = read_record(out_dir, verify=False)
  if HASH_FIELD not in record or record_sha256(record) != record[HASH_FIELD]:
    raise ValueError(f'{path}: the record\'s content does not match its {HASH_FIELD}; it was '
                     'edited after the conversion: refusing to amend it (re-run the conversion).')
  skip = lambda rel: replaced and rel.replace(os.sep, '/').startswith(replaced)  # noqa: E731
  actual = {r: s for r, s in tree_sha256(out_dir).items() if not skip(r)}
  expected = {r: s for r, s in record['artifacts'].items() if not skip(r)}
  if actual != expected:
    bad = sorted(set(actual) ^ set(expected) | {r for r in actual if expected.get(r) != actual[r]})
    raise ValueError(f'{out_dir!r}: artifacts {bad[:5]} differ from the record; refusing to '
                     'amend it (re-run the conversion).')
  record = _normalized(dict(record, **fields))
  record['artifacts'] = tree_sha256(out_dir)
  return _sign_and_write(record, path)
