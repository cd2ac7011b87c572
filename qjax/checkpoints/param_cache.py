"""The on-disk cache of converted checkpoints (dequantized GGUF weights, built tokenizers).

Entries live under `cache_root()/<kind>/<source sha256>/`, so a changed source file never
hits a stale entry; `CONVERSION_VERSION` is part of the path too, so a change to the
conversion code invalidates old entries instead of silently reusing them. Parameters are
stored as safetensors (no pickle) with their config in the header metadata.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
from typing import Iterator, Mapping, Optional

import jax
import numpy as np

from qjax.checkpoints.records import file_sha256

CONVERSION_VERSION = 'v1'  # bump when a conversion's output changes
# safetensors dtype names -> numpy (the ones numpy spells differently).
_SAFETENSORS_DTYPES = {'F32': 'float32', 'F16': 'float16', 'F64': 'float64', 'BF16': 'bfloat16',
                       'I8': 'int8', 'U8': 'uint8', 'I16': 'int16', 'I32': 'int32',
                       'I64': 'int64', 'BOOL': 'bool'}


def cache_root() -> pathlib.Path:
  """$QJAX_CACHE_DIR, or ~/.cache/qjax."""
  return pathlib.Path(os.environ.get('QJAX_CACHE_DIR', pathlib.Path.home() / '.cache' / 'qjax'))


def entry_dir(kind: str, sha256: str, cache_dir: Optional[os.PathLike] = None) -> pathlib.Path:
  root = pathlib.Path(cache_dir) if cache_dir is not None else cache_root()
  return root / kind / f'{sha256}-{CONVERSION_VERSION}'


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
  del size, mtime_ns  # part of the memo key only: a rewritten file is hashed again
  return file_sha256(path)


def sha256_of(path: os.PathLike) -> str:
  """sha256 of a file, memoised per (path, size, mtime) so one process hashes it once."""
  st = os.stat(path)
  return _sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)


_HASH_BLOCK_BYTES = 16 << 20  # a large array is hashed this many bytes of rows at a time


def params_sha256(params: Mapping[str, np.ndarray]) -> str:
  """Content hash of a {name: array} mapping (names, dtypes, shapes, bytes).

  Equal to `records.content_sha256(dict(params))`, but reads one array at a time (and a
  `LazyParams` array in blocks of rows), so hashing a cache entry never holds all of it.
  """
  h = hashlib.sha256()
  for key in sorted(params):
    rows = getattr(params, 'rows', None)
    if rows is not None:
      dtype, shape = params.dtype_shape(key)
    else:
      a = np.ascontiguousarray(np.asarray(params[key]))
      dtype, shape = a.dtype, a.shape
    path = jax.tree_util.keystr((jax.tree_util.DictKey(key),))
    h.update(json.dumps([path, jax.numpy.dtype(dtype).name, list(shape)]).encode())
    inner = hashlib.sha256()
    if rows is None:
      inner.update(a.reshape(-1).view(np.uint8))
    else:
      row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * jax.numpy.dtype(dtype).itemsize)
      step = max(1, _HASH_BLOCK_BYTES // row_bytes)
      n = shape[0] if shape else 1
      for start in range(0, n, step):
        block = np.ascontiguousarray(params[key] if not shape else rows(
            key, start, min(n, start + step)))
        inner.update(block.reshape(-1).view(np.uint8))
    h.update(inner.digest())
  return h.hexdigest()


def save_params(path: pathlib.Path, params: Mapping[str, np.ndarray], metadata: dict) -> None:
  """Write params as safetensors with JSON-encoded metadata and their content hash
  ('content_sha256', checked by `verify_params`), atomically."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f'.tmp{os.getpid()}')
  arrays = {k: np.ascontiguousarray(v) for k, v in params.items()}
  metadata = dict(metadata, content_sha256=params_sha256(arrays))
  save_file(arrays, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})
  os.replace(tmp, path)


def verify_params(params: 'LazyParams', where: str) -> None:
  """Raise ValueError unless a cache entry's arrays match the content hash it was saved with.

  The entry's name (the source's sha256) says what it should hold; this proves it does.
  """
  want = params.metadata.get('content_sha256')
  if want is None:
    raise ValueError(f'{where}: the cache entry has no content_sha256 (written by an older '
                     'qjax); it is rebuilt.')
  got = params_sha256(params)
  if got != want:
    raise ValueError(f'{where}: the cache entry\'s arrays hash to {got[:16]}..., not the '
                     f'{want[:16]}... they were saved with: the entry is corrupted.')


class LazyParams(Mapping):
  """A safetensors file as a read-on-access {name: np.ndarray} mapping (bounded memory)."""

  def __init__(self, path: os.PathLike):
    # The safetensors layout read with plain file reads, not a memory map: pages of a mapped
    # file count in the process's RSS once touched, so hashing or quantizing a 1.07 GB entry
    # through a map would make the whole entry resident.
    self._path = os.fspath(path)
    with open(self._path, 'rb') as f:
      size = int.from_bytes(f.read(8), 'little')
      header = json.loads(f.read(size))
    self._base = 8 + size
    meta = header.pop('__metadata__', None) or {}
    self._entries = {k: (jax.numpy.dtype(_SAFETENSORS_DTYPES.get(v['dtype'], v['dtype'])),
                         tuple(v['shape']), tuple(v['data_offsets']))
                     for k, v in header.items()}
    self._keys = tuple(sorted(self._entries, key=lambda k: self._entries[k][2]))
    self.metadata = {k: json.loads(v) for k, v in meta.items()}

  def _read(self, key: str, start_row: int, stop_row: Optional[int]) -> np.ndarray:
    if key not in self._entries:
      raise KeyError(key)
    dtype, shape, (begin, end) = self._entries[key]
    if not shape:
      start_row, stop_row, out_shape = 0, None, ()
    else:
      stop_row = shape[0] if stop_row is None else min(stop_row, shape[0])
      start_row = min(max(start_row, 0), stop_row)
      out_shape = (stop_row - start_row,) + shape[1:]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else 0
    offset = begin + start_row * row_bytes
    out = np.empty(out_shape, dtype)
    with open(self._path, 'rb') as f:
      f.seek(self._base + offset)
      got = f.readinto(out.reshape(-1).view(np.uint8))
    if got != out.nbytes:
      raise ValueError(f'{self._path}: {key!r} is truncated (read {got} of {out.nbytes} '
                       'bytes); the cache entry is rebuilt on the next load.')
    return out

  def __getitem__(self, key: str) -> np.ndarray:
    return self._read(key, 0, None)

  def dtype_shape(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) of one array, without reading it."""
    if key not in self._entries:
      raise KeyError(key)
    return self._entries[key][:2]

  def rows(self, key: str, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of one array, read without reading the rest of it."""
    return self._read(key, start, stop)

  def __iter__(self) -> Iterator[str]:
    return iter(self._keys)

  def __len__(self) -> int:
    return len(self._keys)
