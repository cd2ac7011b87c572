"""Build the optional decode matmul kernel (`gemv.cc`) into `qjax/kernels/build/`.

    python -m qjax.kernels.build          # what `make install` runs; never fails the install

Needs g++ (or $CXX) and the XLA FFI headers that jaxlib ships (`jax.ffi.include_dir()`).
Compiled with -march=native for the machine it runs on: rebuild on another CPU. Anything
missing prints one line and exits 0; qjax then uses its pure-XLA paths
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


def build(verbose: bool = True) -> bool:
  """Compile the kernel; True when the library is in place.

  Args:
    verbose: print one line saying what happened.

  Returns:
    Whether `LIBRARY` now exists (freshly built).
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
  LIBRARY.parent.mkdir(parents=True, exist_ok=True)
  tmp = LIBRARY.with_suffix('.so.tmp')
  cmd = [cxx, '-O3', '-march=native', '-ffast-math', '-fPIC', '-shared', '-std=c++17',
         '-w', f'-I{include}', str(SOURCE), '-o', str(tmp)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    say(f'qjax.kernels: compiling failed ({e}); the XLA paths are used.')
    return False
  if r.returncode:
    first = (r.stderr.strip().splitlines() or ['?'])[0]
    say(f'qjax.kernels: compiling failed ({first}); the XLA paths are used.')
    return False
  tmp.replace(LIBRARY)
  # The FFI ABI belongs to the jaxlib whose headers built it: loading checks this stamp.
  LIBRARY.with_suffix('.jax').write_text(jax.__version__)
  say(f'qjax.kernels: built {LIBRARY}')
  return True


if __name__ == '__main__':
  build()
  sys.exit(0)
