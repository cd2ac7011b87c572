"""Build the decode matmul kernel (`gemv.cc`) into a per-user cache, once per build key.

`qjax.kernels` calls `ensure()` on first use, so an install needs no build step;
`python -m qjax.kernels.build` does the same ahead of time (`make install` runs it).

Where: `$QJAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/qjax/kernels`, else
`~/.cache/qjax/kernels`; never the source tree. One folder per key,
`<isa>-jax<version>-<hash>`, the hash over (jax and jaxlib versions, compiler and its
version, compiler flags, the ISA's CPU flags, the kernel sources): another jax, compiler,
CPU kind or source edit gets its own library, and a cache shared by several machines (a
network home) holds one library per CPU kind. Concurrent first uses (pytest-xdist workers,
several processes) serialise on a file lock; the library and its manifest are written to
temporary names and renamed, so a reader never sees a torn file. The manifest records the
library's sha256, checked before every load: a library truncated, overwritten or flipped on
disk is rebuilt (`ensure`) and never loaded (`qjax.kernels.load_library`), since dlopen of a
damaged library can crash the interpreter (SIGBUS, SIGSEGV) where Python cannot catch it.

ISA: not `-march=native` but an explicit instruction-set level (`ISAS`), the highest this
CPU has (or `$QJAX_KERNEL_ISA`, a lower one on purpose), so a library runs on every CPU with
that level's flags and the manifest records exactly which flags it needs (`kernels` refuses
one whose flags the running CPU lacks, which `-march=native` could not state). Needs g++
(or $CXX) and the XLA FFI headers that jaxlib ships (`jax.ffi.include_dir()`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
from typing import Optional

SOURCES = ('gemv.cc', 'gemv_avx2.inc', 'gemv_avx512.inc')
NAME = 'libqjax_gemv.so'
MANIFEST = 'manifest.json'
FAILED = 'build_failed.txt'
# ISA levels, best first: (CPU flags as /proc/cpuinfo names them, compiler flags). gemv.cc
# picks its AVX-512 forms from the compiler's __AVX512*__ macros, else the AVX2 ones.
ISAS = {
    'avx512_bf16': (('avx2', 'fma', 'avx512f', 'avx512bw', 'avx512vl', 'avx512dq',
                     'avx512_vnni', 'avx512_bf16'),
                    ('-mavx2', '-mfma', '-mavx512f', '-mavx512bw', '-mavx512vl', '-mavx512dq',
                     '-mavx512vnni', '-mavx512bf16')),
    'avx512': (('avx2', 'fma', 'avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512_vnni'),
               ('-mavx2', '-mfma', '-mavx512f', '-mavx512bw', '-mavx512vl', '-mavx512dq',
                '-mavx512vnni')),
    'avx2': (('avx2', 'fma'), ('-mavx2', '-mfma')),
}
# The parts of -ffast-math the loops need (reassociation for vectorised sums), without
# -ffast-math / -funsafe-math-optimizations themselves: with either, g++ links crtfastmath.o,
# whose constructor turns on flush-to-zero and denormals-are-zero for the whole process when
# the library loads, so numpy and XLA in that process would silently flush subnormals.
BASE_FLAGS = ('-O3', '-fassociative-math', '-fno-signed-zeros', '-fno-trapping-math',
              '-freciprocal-math', '-fno-math-errno', '-ffinite-math-only', '-fPIC', '-shared',
              '-std=c++17', '-w')


def cache_root() -> pathlib.Path:
  """The cache folder (module docstring): $QJAX_KERNEL_CACHE, $XDG_CACHE_HOME or ~/.cache."""
  if os.environ.get('QJAX_KERNEL_CACHE'):
    return pathlib.Path(os.environ['QJAX_KERNEL_CACHE']).expanduser()
  xdg = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return pathlib.Path(xdg) / 'qjax' / 'kernels'


def best_isa(cpu: Optional[frozenset]) -> Optional[str]:
  """The best level of `ISAS` whose flags `cpu` has, or None (not x86-64, or no AVX2 + FMA)."""
  if cpu is None:
    return None
  return next((name for name, (need, _) in ISAS.items() if set(need) <= cpu), None)


def missing_flags(manifest: dict, cpu: Optional[frozenset]) -> list:
  """The CPU flags a built library needs (its manifest's 'cpu_flags') that `cpu` lacks."""
  return sorted(set(manifest.get('cpu_flags', ['(no recorded ISA)'])) - set(cpu or ()))


def compiler() -> Optional[str]:
  """$CXX, else g++ or c++ on PATH; None when there is none."""
  return os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')


def _compiler_version(cxx: str) -> str:
  try:
    r = subprocess.run([cxx, '--version'], capture_output=True, text=True, timeout=60,
                       check=False)
    return (r.stdout.strip().splitlines() or ['?'])[0]
  except OSError as e:
    return f'? ({e})'


def _sources_sha256() -> str:
  h = hashlib.sha256()
  for name in SOURCES:
    h.update(name.encode() + b'\0' + (pathlib.Path(__file__).parent / name).read_bytes())
  return h.hexdigest()


def build_key(isa: str, cxx: str) -> tuple[str, dict]:
  """(folder name, the facts it hashes) of a build for `isa` with compiler `cxx`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  facts = {'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'compiler': cxx,
           'compiler_version': _compiler_version(cxx),
           'flags': list(BASE_FLAGS + ISAS[isa][1]), 'isa': isa,
           'cpu_flags': list(ISAS[isa][0]), 'source_sha256': _sources_sha256()}
  digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
  return f'{isa}-jax{jax.__version__}-{digest}', facts


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """An exclusive advisory lock on `path` (fcntl; the kernel only builds on Linux)."""
  import fcntl  # pylint: disable=g-import-not-at-top
  with open(path, 'a+') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def file_sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def damage(manifest: dict, library: pathlib.Path) -> Optional[str]:
  """Why `library` is not the file its manifest records (None when its sha256 matches)."""
  want = manifest.get('library_sha256')
  if want is None:
    return 'its manifest records no library sha256 (an older cache)'
  got = file_sha256(library)
  if got != want:
    return (f'its sha256 {got[:12]}... is not the {want[:12]}... recorded when it was built '
            f'({library.stat().st_size} bytes: truncated, overwritten or damaged on disk)')
  return None


def read_manifest(folder: pathlib.Path) -> Optional[dict]:
  """A built library's manifest, or None when the folder holds no complete build."""
  try:
    manifest = json.loads((folder / MANIFEST).read_text())
  except (OSError, ValueError):
    return None
  return manifest if (folder / NAME).is_file() else None


def _compile(cxx: str, facts: dict, folder: pathlib.Path) -> Optional[str]:
  """Compile into `folder` (temporary names, then renamed); None on success, else why not."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    include = jax.ffi.include_dir()
  except Exception as e:  # pylint: disable=broad-except
    return f'no XLA FFI headers (jax.ffi.include_dir(): {e})'
  if not (pathlib.Path(include) / 'xla' / 'ffi' / 'api' / 'ffi.h').is_file():
    return f'no XLA FFI headers (xla/ffi/api/ffi.h not under {include})'
  tmp = folder / f'{NAME}.{os.getpid()}.tmp'
  cmd = [cxx, *facts['flags'], f'-I{include}',
         str(pathlib.Path(__file__).with_name('gemv.cc')), '-o', str(tmp)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f'{cxx} failed ({e})'
  if r.returncode:
    lines = r.stderr.strip().splitlines() or ['?']
    # the first error, not the 'In file included from' line an error in an .inc starts with
    return f'{cxx} failed: ' + next((ln for ln in lines if 'error' in ln), lines[0]).strip()
  tmp.replace(folder / NAME)
  manifest = dict(facts, built=datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec='seconds'), command=' '.join(cmd[:-2]),
                  library_sha256=file_sha256(folder / NAME))
  tmp_manifest = folder / f'{MANIFEST}.{os.getpid()}.tmp'
  tmp_manifest.write_text(json.dumps(manifest, indent=1))
  tmp_manifest.replace(folder / MANIFEST)  # last: its presence marks a complete build
  return None


def ensure(cpu: Optional[frozenset], root: Optional[pathlib.Path] = None,
           retry_failed: bool = False, say=None) -> tuple[Optional[pathlib.Path], str]:
  """The library for this CPU from the cache, built first if needed.

  Args:
    cpu: the running CPU's flags (`qjax.kernels.cpu_flags()`); None off Linux x86-64.
    root: the cache folder (default `cache_root()`).
    retry_failed: build again where an earlier build for the same key failed (otherwise
      that failure, recorded in the key's folder, is returned at once).
    say: called with one line before a compile starts (it takes seconds: docs/cpu_kernel.md).

  Returns:
    (library path, how it was obtained: 'cached' / 'built' / 'rebuilt (...)'), or
    (None, why there is none).
  """
  isa = best_isa(cpu)
  if isa is None:
    return None, ('no kernel for this CPU (it needs Linux x86-64 with AVX2 + FMA)'
                  if cpu is not None else 'no kernel for this platform (Linux x86-64 only)')
  want = os.environ.get('QJAX_KERNEL_ISA')
  if want:  # a lower level on purpose: one library for a mixed fleet, or to test its forms
    if want not in ISAS:
      return None, (f'QJAX_KERNEL_ISA={want!r} is not a level; use one of {tuple(ISAS)} or '
                    'unset it')
    lacking = sorted(set(ISAS[want][0]) - cpu)
    if lacking:
      return None, (f'QJAX_KERNEL_ISA={want} needs CPU flags {lacking} that this CPU lacks; '
                    f'use {isa} or lower, or unset it')
    isa = want
  cxx = compiler()
  if cxx is None:
    return None, 'no C++ compiler (g++ or $CXX) to build it'
  name, facts = build_key(isa, cxx)
  root = pathlib.Path(root) if root is not None else cache_root()
  folder = root / name
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(root / f'{name}.lock'):
      return _ensure_locked(cxx, isa, facts, folder, cpu, retry_failed, say)
  except OSError as e:
    return None, f'cache {root} not usable ({e}; set QJAX_KERNEL_CACHE to a writable folder)'


def _ensure_locked(cxx, isa, facts, folder, cpu, retry_failed, say):
  """`ensure` once the key's lock is held."""
  manifest = read_manifest(folder)
  if manifest is not None:
    missing = missing_flags(manifest, cpu)
    damaged = damage(manifest, folder / NAME)
    if (not missing and not damaged
        and manifest.get('source_sha256') == facts['source_sha256']):
      return folder / NAME, 'cached'
    # A library this key should not hold (a copied, hand-edited or damaged cache): never
    # load it.
    how = (f'rebuilt (the cached library needs {", ".join(missing)}, which this CPU lacks)'
           if missing else f'rebuilt (the cached library: {damaged})' if damaged
           else 'rebuilt (the cached library is from other sources)')
    if say is not None and damaged and 'library_sha256' in manifest:
      say(f'qjax.kernels: the cached CPU kernel {folder / NAME} is damaged ({damaged}); '
          'rebuilding it')
    (folder / MANIFEST).unlink()
  elif (folder / FAILED).is_file() and not retry_failed:
    return None, (f'{(folder / FAILED).read_text().strip()} (an earlier build, recorded in '
                  f'{folder}; python -m qjax.kernels.build retries)')
  else:
    how = 'built'
  if say is not None:
    say(f'qjax.kernels: compiling the CPU kernel ({isa}) into {folder} (once per jax, '
        'compiler and CPU kind)')
  why = _compile(cxx, facts, folder)
  if why is not None:
    (folder / FAILED).write_text(why + '\n')
    return None, why
  (folder / FAILED).unlink(missing_ok=True)
  return folder / NAME, how
