"""The kernel's build cache (qjax.kernels._build) and the loader's instruction-set check."""

import ctypes
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import qjax
from qjax import kernels
from qjax.kernels import _build

AVX2_CPU = frozenset(_build.ISAS['avx2'][0])  # an AVX2 + FMA machine without AVX-512
CAN_BUILD = (_build.best_isa(kernels.cpu_flags()) is not None and
             _build.compiler() is not None)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv('QJAX_KERNEL_CACHE', str(tmp_path / 'k'))
  assert _build.cache_root() == tmp_path / 'k'
  monkeypatch.delenv('QJAX_KERNEL_CACHE')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert _build.cache_root() == tmp_path / 'xdg' / 'qjax' / 'kernels'


def test_isa_levels_and_missing_flags():
  assert _build.best_isa(None) is None
  assert _build.best_isa(frozenset({'sse4_2', 'avx'})) is None  # no AVX2 + FMA: no kernel
  assert _build.best_isa(AVX2_CPU) == 'avx2'
  avx512 = AVX2_CPU | set(_build.ISAS['avx512'][0])
  assert _build.best_isa(avx512) == 'avx512'
  assert _build.best_isa(avx512 | {'avx512_bf16'}) == 'avx512_bf16'
  manifest = {'cpu_flags': list(_build.ISAS['avx512'][0])}
  assert 'avx512_vnni' in _build.missing_flags(manifest, AVX2_CPU)
  assert _build.missing_flags(manifest, avx512) == []
  assert _build.missing_flags({}, avx512) == ['(no recorded ISA)']  # no record: never load


def test_key_changes_with_isa_compiler_and_sources(monkeypatch):
  a, facts = _build.build_key('avx2', '/usr/bin/g++')
  assert a.startswith(f'avx2-jax{jax.__version__}-') and facts['cpu_flags'] == ['avx2', 'fma']
  assert _build.build_key('avx2', '/usr/bin/g++')[0] == a
  assert _build.build_key('avx512', '/usr/bin/g++')[0] != a
  assert _build.build_key('avx2', '/usr/bin/clang++')[0] != a
  monkeypatch.setattr(_build, '_sources_sha256', lambda: '0' * 64)
  assert _build.build_key('avx2', '/usr/bin/g++')[0] != a


@pytest.mark.skipif(not CAN_BUILD, reason='needs a C++ compiler and an x86-64 CPU with AVX2')
def test_builds_into_a_temporary_cache_loads_and_refuses_a_foreign_isa(tmp_path):
  # One AVX2-level build (it runs on every CPU that can build at all) for the whole story:
  # concurrent first uses, loading, the AVX2 numerics, and the refusals.
  # Two concurrent first uses of an empty cache: one compiles under the lock, the other waits
  # and finds it.
  results = []
  threads = [threading.Thread(target=lambda: results.append(_build.ensure(AVX2_CPU, tmp_path)))
             for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(how for _, how in results) == ['built', 'cached'], results
  library = results[0][0]
  assert library == results[1][0] and library.parent.parent == tmp_path
  manifest = json.loads((library.parent / _build.MANIFEST).read_text())
  assert manifest['isa'] == 'avx2' and manifest['cpu_flags'] == ['avx2', 'fma']
  assert manifest['library_sha256'] == _build.file_sha256(library)
  assert '-march=native' not in manifest['flags'] and '-mavx2' in manifest['flags']
  # loads on this CPU (a superset of AVX2), and says which forms it holds
  lib = kernels.load_library(library, kernels.cpu_flags())
  lib.QjaxGemvIsa.restype = ctypes.c_char_p
  assert lib.QjaxGemvIsa() == b'avx2'
  # Loading it left the process's float mode alone: a -ffast-math link (crtfastmath.o) would
  # have turned on flush-to-zero, and numpy would flush this subnormal to 0.
  assert np.float32(1e-39) * np.float32(1) == np.float32(1e-39) != 0
  stamp = library.stat().st_mtime_ns
  assert _build.ensure(AVX2_CPU, tmp_path) == (library, 'cached')
  assert library.stat().st_mtime_ns == stamp  # not rebuilt
  # The machines alternate between AVX-512 and AVX2 CPUs: the AVX2 forms (gemv_avx2.inc) are
  # checked on either, by the numerics tests in a process that asks for that level and finds
  # this library in its cache.
  env = dict(os.environ, QJAX_KERNEL_ISA='avx2', QJAX_KERNEL_CACHE=str(tmp_path))
  env.pop('QJAX_CPU_KERNEL', None)
  r = subprocess.run(
      [sys.executable, '-m', 'pytest', str(pathlib.Path(__file__).with_name('test_kernels.py')),
       '-q', '-p', 'no:cacheprovider', '-k', 'available_exactly or matches or nan'],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert r.returncode == 0 and 'skipped' not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
  assert library.stat().st_mtime_ns == stamp
  # A library whose recorded ISA the running CPU lacks (an AVX-512 build seen from an AVX2
  # machine sharing the cache) is refused before dlopen, which would risk SIGILL ...
  (library.parent / _build.MANIFEST).write_text(json.dumps(
      dict(manifest, isa='avx512', cpu_flags=list(_build.ISAS['avx512'][0]))))
  with pytest.raises(RuntimeError, match='avx512_vnni.*lacks.*rebuild'):
    kernels.load_library(library, AVX2_CPU)
  # ... and the cache rebuilds it for this CPU instead of handing it out.
  rebuilt, how = _build.ensure(AVX2_CPU, tmp_path)
  assert rebuilt == library and how.startswith('rebuilt') and 'avx512_vnni' in how
  assert json.loads((library.parent / _build.MANIFEST).read_text())['cpu_flags'] == [
      'avx2', 'fma']
  # A library without a manifest: its instruction set is unknown, so it is not loaded.
  (library.parent / _build.MANIFEST).unlink()
  with pytest.raises(RuntimeError, match='instruction set is unknown'):
    kernels.load_library(library, kernels.cpu_flags())


def test_a_failed_build_is_recorded_and_not_retried(monkeypatch, tmp_path):
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-g++'))
  lib, why = _build.ensure(AVX2_CPU, tmp_path)
  assert lib is None and 'no-such-g++' in why
  lib, why = _build.ensure(AVX2_CPU, tmp_path)  # the recorded failure, without compiling
  assert lib is None and 'an earlier build' in why and 'python -m qjax.kernels.build' in why
  (tmp_path / 'a-file').write_text('')
  lib, why = _build.ensure(AVX2_CPU, tmp_path / 'a-file' / 'cache')  # cannot be made
  assert lib is None and 'not usable' in why and 'QJAX_KERNEL_CACHE' in why
  assert _build.ensure(None, tmp_path)[1].startswith('no kernel for this platform')
  assert 'AVX2 + FMA' in _build.ensure(frozenset({'avx'}), tmp_path)[1]


def test_a_chosen_isa_level_is_checked(monkeypatch, tmp_path):
  monkeypatch.setenv('QJAX_KERNEL_ISA', 'avx9')
  assert "QJAX_KERNEL_ISA='avx9' is not a level" in _build.ensure(AVX2_CPU, tmp_path)[1]
  monkeypatch.setenv('QJAX_KERNEL_ISA', 'avx512')
  why = _build.ensure(AVX2_CPU, tmp_path)[1]
  assert 'QJAX_KERNEL_ISA=avx512 needs' in why and 'avx512_vnni' in why and 'use avx2' in why


def test_no_compiler_warns_once_and_the_xla_paths_run(monkeypatch, tmp_path, caplog):
  # A fresh process's first use without g++: one warning line naming what is missing, then
  # the XLA fallback answers qeinsum (the process state is restored by monkeypatch).
  monkeypatch.setattr(kernels, '_STATE', {})
  monkeypatch.delenv('QJAX_CPU_KERNEL', raising=False)
  monkeypatch.delenv('CXX', raising=False)
  monkeypatch.setattr(_build.shutil, 'which', lambda name: None)
  monkeypatch.setenv('QJAX_KERNEL_CACHE', str(tmp_path))
  with caplog.at_level(logging.WARNING, logger='qjax.kernels'):
    assert not kernels.available() and not kernels.available()
  assert kernels.status() == 'not built (no C++ compiler (g++ or $CXX) to build it)'
  assert kernels.info()['library'] is None and kernels.isa() is None
  if _build.best_isa(kernels.cpu_flags()) is not None:
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and 'C++ compiler' in lines[0] and 'XLA fallback' in lines[0]
  w = jax.random.normal(jax.random.key(0), (128, 64))
  q = qjax.quantize(w, qjax.int_format(4, group_size=64, channel_axes=(1,)))
  x = jax.random.normal(jax.random.key(1), (1, 128))
  # the module-level helpers read kernels' state at trace time: an eager call sees it
  np.testing.assert_allclose(qjax.qeinsum('MK,KN->MN', x, q), x @ q.dequantize(), rtol=1e-4,
                             atol=1e-4)


def test_disabled_by_the_environment(monkeypatch):
  monkeypatch.setattr(kernels, '_STATE', {})
  monkeypatch.setenv('QJAX_CPU_KERNEL', '0')
  assert kernels.status() == 'disabled by QJAX_CPU_KERNEL=0'
  assert kernels.info()['build'] is None


def test_conversion_records_say_which_cpu_path_runs(monkeypatch):
  from qjax.checkpoints import records  # pylint: disable=g-import-not-at-top
  rt = records.runtime_info()['cpu_decode']
  assert rt['kernel'] == kernels.info()
  assert set(rt['decode_forms']) == {'int8/int4 weight-only', 'W8A8/W4A8', 'bf16'}
  assert ('kernel' in rt['decode_forms']['W8A8/W4A8']) == kernels.available()
  monkeypatch.setattr(kernels, '_STATE', {})
  monkeypatch.setenv('QJAX_CPU_KERNEL', '0')
  rt = records.runtime_info()['cpu_decode']
  assert rt['kernel']['status'] == 'disabled by QJAX_CPU_KERNEL=0'
  assert 'XLA' in rt['decode_forms']['W8A8/W4A8']


def _fake_build(folder, facts, payload=b'\x7fELF a library'):
  """What `_compile` leaves in `folder`, without a compiler: the library and its manifest."""
  (folder / _build.NAME).write_bytes(payload)
  (folder / _build.MANIFEST).write_text(json.dumps(dict(
      facts, library_sha256=_build.file_sha256(folder / _build.NAME))))


@pytest.mark.parametrize('damage', ['truncated', 'flipped', 'emptied', 'random'])
def test_a_damaged_library_is_rebuilt_and_never_loaded(monkeypatch, tmp_path, caplog, damage):
  # Truncated, it crashed the interpreter in dlopen (SIGBUS); flipped code, SIGSEGV; emptied
  # or random bytes fell back silently, never rebuilt. The manifest now records its sha256.
  monkeypatch.setenv('CXX', '/usr/bin/g++')
  monkeypatch.setattr(_build, '_compiler_version', lambda cxx: 'g++ 12')
  builds = []
  monkeypatch.setattr(_build, '_compile', lambda cxx, facts, folder: builds.append(
      _fake_build(folder, facts, b'\x7fELF build %d' % len(builds))))
  library, how = _build.ensure(AVX2_CPU, tmp_path)
  assert how == 'built' and len(builds) == 1
  manifest = json.loads((library.parent / _build.MANIFEST).read_text())
  assert manifest['library_sha256'] == _build.file_sha256(library)
  data = library.read_bytes()
  library.write_bytes({'truncated': data[:len(data) // 2],
                       'flipped': bytes(b ^ 0xFF for b in data[:8]) + data[8:],
                       'emptied': b'', 'random': os.urandom(len(data))}[damage])
  with pytest.raises(RuntimeError, match=r'is not the library that was built: its sha256 .* '
                                         'is not the .* recorded when it was built'):
    kernels.load_library(library, AVX2_CPU)  # refused before dlopen
  with caplog.at_level(logging.WARNING):
    again, how = _build.ensure(AVX2_CPU, tmp_path, say=logging.getLogger('t').warning)
  assert again == library and how.startswith('rebuilt (the cached library: its sha256')
  assert len(builds) == 2 and 'is damaged' in caplog.text and 'rebuilding it' in caplog.text
  assert _build.ensure(AVX2_CPU, tmp_path) == (library, 'cached') and len(builds) == 2


def test_a_manifest_without_a_library_hash_is_rebuilt(monkeypatch, tmp_path):
  monkeypatch.setenv('CXX', '/usr/bin/g++')
  monkeypatch.setattr(_build, '_compiler_version', lambda cxx: 'g++ 12')
  monkeypatch.setattr(_build, '_compile', lambda cxx, facts, folder: _fake_build(folder, facts))
  library, _ = _build.ensure(AVX2_CPU, tmp_path)
  manifest = json.loads((library.parent / _build.MANIFEST).read_text())
  del manifest['library_sha256']  # what caches written before the hash hold
  (library.parent / _build.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(RuntimeError, match='records no library sha256'):
    kernels.load_library(library, AVX2_CPU)
  assert 'records no library sha256' in _build.ensure(AVX2_CPU, tmp_path)[1]
