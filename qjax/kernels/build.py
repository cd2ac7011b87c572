"""Build the optional decode matmul kernel (`gemv.cc`) into `qjax/kernels/build/`.

    python -m qjax.kernels.build          # what `make install` runs; never fails the install

Needs g++ (or $CXX) and the XLA FFI headers that jaxlib ships (`jax.ffi.include_dir()`).
Compiled with -march=native for the machine it runs on: rebuild on another CPU. gemv.cc
includes the AVX-512 forms (gemv_avx512.inc) or the AVX2 + FMA ones (gemv_avx2.inc), as the
CPU has them (`qjax.kernels.isa()`); a CPU with neither fails the compile. Anything missing
prints one line and exits 0; qjax then uses its pure-XLA paths
(`qjax.kernels.available()` says which).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

SOURCE = pathlib.Path(__file__).with_name('gemv.cc')
LIBRARY = pathlib.Path(__file__).parent / 'build' / 'libqjax_gemv.so'


def build(verbose: bool = True, library: pathlib.Path = LIBRARY) -> bool:
  """Compile the kernel; True when the library is in place.

  Args:
    verbose: print one line saying what happened.
    library: where to write it (and its jax stamp, `library.with_suffix('.jax')`); the
      default is where `qjax.kernels` loads it from.

  Returns:
    Whether `library` now exists (freshly built).
  """
  say = print if verbose else (lambda *a: None)
  cxx = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
  if not cxx:
    say('qjax.kernels: no C++ compiler (g++); the optional CPU kernel is not built, the XLA '
        'paths are used.')
    return False
  try:
    import jax  # pylint: disable=g-import-not-at-top
    include = jax.ffi.include_dir()
  except Exception as e:  # pylint: disable=broad-except
    say(f'qjax.kernels: no XLA FFI headers ({e}); the optional CPU kernel is not built.')
    return False
  library.parent.mkdir(parents=True, exist_ok=True)
  tmp = library.with_suffix('.so.tmp')
  cmd = [cxx, '-O3', '-march=native', '-ffast-math', '-fPIC', '-shared', '-std=c++17',
         '-w', f'-I{include}', str(SOURCE), '-o', str(tmp)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    say(f'qjax.kernels: compiling failed ({e}); the XLA paths are used.')
    return False
  if r.returncode:
    lines = r.stderr.strip().splitlines() or ['?']
    # the first error, not the 'In file included from' line an error in an .inc starts with
    first = next((line for line in lines if 'error' in line), lines[0])
    say(f'qjax.kernels: compiling failed ({first}); the XLA paths are used.')
    return False
  tmp.replace(library)
  # The FFI ABI belongs to the jaxlib whose headers built it: loading checks this stamp.
  library.with_suffix('.jax').write_text(jax.__version__)
  say(f'qjax.kernels: built {library}')
  return True


if __name__ == '__main__':
  build()
  sys.exit(0)
