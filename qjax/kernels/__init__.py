"""An optional XLA:CPU kernel for decode-shape matmuls (`gemv.cc`, loaded through `jax.ffi`).

`y = x @ W` for a few rows of f32 activations and an int8, packed int4 or bf16 weight, with
f32 accumulation and group scales, reading each weight byte once: the path XLA:CPU lacks
(it widens a quantized weight into a float copy before every dot). With `act='int8'` the
activations are quantized inside the kernel (per row and weight group, `qeinsum`'s 'int8'
numerics) and multiplied on integer dots: the W8A8 / W4A8 decode path, several codes per
instruction instead of widening each to f32 (measured: docs/cpu_kernel.md).

Built on first use into a per-user cache (`_build.py`: `$QJAX_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/qjax/kernels` or `~/.cache/qjax/kernels`, one library per jax, compiler, CPU
instruction-set level and source hash, under a file lock), so any install has it where g++
and jaxlib's FFI headers exist. Before loading, the library's manifest is checked against
the running CPU (`cpu_flags()`): one built for flags this CPU lacks (a cache shared with a
bigger machine) is never loaded, but rebuilt for this CPU (`info()['build']` says which).
When it is missing (no compiler, no headers, a failed compile: one warning line at first use),
fails to load, or `QJAX_CPU_KERNEL=0` is set, `available()` is False and qjax runs its XLA
paths (`info()` says which and why). Within qjax this package imports `qjax.target` alone.

Two instruction sets, chosen when it is compiled (the CPU's best level of `_build.ISAS`;
`isa()` says which), with the same forms, layouts and numerics: 'avx512' (AVX-512
F/BW/VL/DQ/VNNI: vpdpbusd integer dots, AVX-512 BF16 dots for 'kn' bf16 where the CPU has
them) and 'avx2' (AVX2 + FMA: vpmaddubsw + vpmaddwd integer dots, bf16 widened to f32). A CPU
with neither has no kernel.

Layouts (`y_MF = x_MD @ w`, D contracted, F output, Q groups of scales along D): 'kn' weights
are (D, F), contracted axis first (every projection); 'nk' weights are (F, D), contracted axis
last (the tied head 'BTD,VD->BTV', F = V). int4 codes are qjax's packing (two per byte along
the last axis, low nibble first).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import platform
import sys
import threading
from typing import Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.kernels import _build

__all__ = ['KINDS', 'LAYOUTS', 'available', 'cpu_flags', 'gemv', 'info', 'isa', 'status']

KINDS = ('int8', 'int4', 'bf16')
LAYOUTS = ('kn', 'nk')
_SYMBOLS = {('kn', 'int8'): 'QjaxKnI8', ('kn', 'int4'): 'QjaxKnI4', ('kn', 'bf16'): 'QjaxKnBf16',
            ('nk', 'int8'): 'QjaxNkI8', ('nk', 'int4'): 'QjaxNkI4', ('nk', 'bf16'): 'QjaxNkBf16',
            # int8 activations (qeinsum's 'int8' numerics) on integer dots
            ('kn', 'int8_a8'): 'QjaxKnI8A8', ('kn', 'int4_a8'): 'QjaxKnI4A8',
            ('nk', 'int8_a8'): 'QjaxNkI8A8', ('nk', 'int4_a8'): 'QjaxNkI4A8'}
_LOG = logging.getLogger('qjax.kernels')
# The process's one load attempt (the library registers its FFI targets once per process):
# 'reason' (None when loaded), 'isa', 'library', 'build'. Guarded by _LOCK.
_LOCK = threading.Lock()
_STATE: dict = {}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> Optional[frozenset]:
  """The CPU's feature flags (/proc/cpuinfo), or None off Linux x86-64."""
  if sys.platform != 'linux' or platform.machine() not in ('x86_64', 'AMD64'):
    return None
  try:
    text = pathlib.Path('/proc/cpuinfo').read_text(errors='replace')
  except OSError:
    return None
  line = next((ln for ln in text.splitlines() if ln.startswith('flags')), '')
  return frozenset(line.partition(':')[2].split())


def load_library(library: pathlib.Path, cpu: Optional[frozenset]) -> ctypes.CDLL:
  """dlopen a built library after checking its manifest against the CPU flags `cpu`.

  Raises:
    RuntimeError: the manifest is missing, names CPU flags that `cpu` lacks (running it
      would die on an illegal instruction), or records another sha256 than the file has (a
      damaged library can crash the process in dlopen).
  """
  manifest = _build.read_manifest(pathlib.Path(library).parent)
  if manifest is None:
    raise RuntimeError(f'{library} has no {_build.MANIFEST}: its instruction set is unknown; '
                       'delete the folder and rebuild (python -m qjax.kernels.build).')
  damaged = _build.damage(manifest, pathlib.Path(library))
  if damaged:
    raise RuntimeError(f'{library} is not the library that was built: {damaged}; delete the '
                       'folder and rebuild (python -m qjax.kernels.build).')
  missing = _build.missing_flags(manifest, cpu)
  if missing:
    raise RuntimeError(f'{library} was built for {manifest.get("isa")} and needs CPU flags '
                       f'{missing} that this CPU lacks; delete the folder and rebuild '
                       '(python -m qjax.kernels.build).')
  return ctypes.cdll.LoadLibrary(str(library))


def _load() -> Optional[str]:
  """Find or build, check, load and register the library once; None when usable, else why."""
  with _LOCK:
    if 'reason' in _STATE:
      return _STATE['reason']
    reason = None
    if os.environ.get('QJAX_CPU_KERNEL', '1') == '0':
      reason = 'disabled by QJAX_CPU_KERNEL=0'
    else:
      library, how = _build.ensure(cpu_flags(), say=_LOG.warning)
      _STATE['build'] = how
      if library is None:
        reason = f'not built ({how})'
        if _build.best_isa(cpu_flags()) is not None:  # it could run here: say what is missing
          _LOG.warning('qjax.kernels: the CPU kernel is not built: %s; the XLA fallback paths '
                       'run (qjax.kernels.info()).', how)
      else:
        try:
          lib = load_library(library, cpu_flags())
          isa_fn = lib.QjaxGemvIsa
          isa_fn.restype = ctypes.c_char_p
          for (layout, kind), sym in _SYMBOLS.items():
            jax.ffi.register_ffi_target(f'qjax_gemv_{layout}_{kind}',
                                        jax.ffi.pycapsule(getattr(lib, sym)), platform='cpu')
          _STATE['isa'] = isa_fn().decode()
          _STATE['library'] = str(library)
        except Exception as e:  # pylint: disable=broad-except
          reason = f'failed to load ({type(e).__name__}: {e})'
          _LOG.warning('qjax.kernels: the CPU kernel %s; the XLA fallback paths run '
                       '(qjax.kernels.info()).', reason)
    _STATE['reason'] = reason
    return reason


def available() -> bool:
  """Whether the kernel is built, loaded and enabled (CPU only)."""
  return _load() is None


def status() -> str:
  """'available', or why the kernel is not used."""
  return _load() or 'available'


def isa() -> Optional[str]:
  """The instruction set the loaded kernel was built for, 'avx512' or 'avx2'; None when the
  kernel is not available (`status()` says why)."""
  return _STATE.get('isa') if _load() is None else None


def info() -> dict:
  """The kernel's state for records and benchmarks: what runs and why.

  Returns:
    {'status': `status()`, 'isa': `isa()`, 'cpu_isa': the running CPU's best level
    (`_build.ISAS`, None without AVX2 + FMA or off x86-64), 'library': the loaded file or
    None, 'build': how it was obtained ('cached', 'built', 'rebuilt (why)') or why not}.
    Where programs are traced for another platform (`qjax.target`), before anything asked
    for the kernel, it is not built just to report it: status 'not used (target <name>)'.
  """
  target = qjax_target.current()
  if 'reason' not in _STATE and not target.platform == 'cpu':
    return {'status': f'not used (target {target.platform})', 'isa': None,
            'cpu_isa': _build.best_isa(cpu_flags()), 'library': None, 'build': None}
  return {'status': status(), 'isa': isa(), 'cpu_isa': _build.best_isa(cpu_flags()),
          'library': _STATE.get('library'), 'build': _STATE.get('build')}


def gemv(x_MD: jax.Array, w: jax.Array, scale: Optional[jax.Array], layout: str,
         kind: str, act: Optional[str] = None) -> jax.Array:
  """`x @ W` on the CPU kernel, in f32.

  Args:
    x_MD: activations (M, D), any float dtype (computed in f32).
    w: 'kn': (D, F) int8 | (D, F/2) uint8 packed int4 | (D, F) bf16;
       'nk': (F, D) int8 | (F, D/2) uint8 | (F, D) bf16.
    scale: f32 group scales, 'kn': (Q, F) (groups of D/Q rows), 'nk': (F, Q); None for bf16.
    layout: 'kn' or 'nk' (module docstring).
    kind: 'int8', 'int4' or 'bf16'.
    act: None (f32 activations, weight-only numerics) or 'int8': activations quantized
      in the kernel per row and per group of scales (per row when Q = 1), scale amax / 127,
      round-half-even, +-127, exact integer dots, rescaled in f32: the numerics of
      qeinsum's 'int8' path. Needs D / Q a multiple of 4 ('kn') or of 64 / 128 ('nk' int8 /
      int4).

  Returns:
    y (M, F) f32; for int4 'kn', F = 2 * w.shape[1] (the padded length).
  """
  if layout not in LAYOUTS or kind not in KINDS or act not in (None, 'int8') or (
      act and kind == 'bf16'):
    raise ValueError(f'qjax.kernels.gemv: layout={layout!r}, kind={kind!r}, act={act!r}; use '
                     f'a layout in {LAYOUTS}, a kind in {KINDS} and act None or "int8" (int8 '
                     'and int4 weights only).')
  reason = _load()
  if reason is not None:
    raise RuntimeError(f'qjax.kernels.gemv: the CPU kernel is {reason}; check available() '
                       'first.')
  m = x_MD.shape[0]
  f = (2 * w.shape[1] if kind == 'int4' else w.shape[1]) if layout == 'kn' else w.shape[0]
  out = jax.ShapeDtypeStruct((m, f), jnp.float32)
  args = [x_MD.astype(jnp.float32), w]
  if kind != 'bf16':
    args.append(scale.astype(jnp.float32))
  name = f'qjax_gemv_{layout}_{kind}' + ('_a8' if act else '')
  return jax.ffi.ffi_call(name, out)(*args)
