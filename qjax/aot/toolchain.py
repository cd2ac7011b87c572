"""The compile-only toolchains: libtpu (TPU) and the CUDA PJRT plugin (GPU), kept apart.

Compiling for a TPU or GPU without one needs the compiler that jax would run there: libtpu
for TPUs, `jax-cuda12-plugin` + `jax-cuda12-pjrt` (or their CUDA 13 builds) for NVIDIA GPUs,
each of the release the installed jax pins (`requirements`). They are installed into a
folder of their own (`pip install --no-deps --target`), never into the environment: with
libtpu importable, every jax process that does not set `JAX_PLATFORMS=cpu` tries the TPU
backend and takes libtpu's machine-wide lockfile, so a second process (a pytest worker)
fails. `activate()` reaches them from one process, after that process's own backends are up,
so nothing else in it sees them.

Folder: `$QJAX_AOT_TOOLCHAIN`, else `~/.cache/qjax/aot/jax<version>-py<major><minor>` (under
`$XDG_CACHE_HOME` when set). `python -m qjax.aot.install` installs there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Iterator, Optional

import jax

ENV_VAR = 'QJAX_AOT_TOOLCHAIN'
MANIFEST = 'qjax_aot_toolchain.json'
_ACTIVE: dict = {}


def default_dir() -> pathlib.Path:
  """Where the toolchain for this jax and Python lives (module docstring)."""
  env = os.environ.get(ENV_VAR, '').strip()
  if env:
    return pathlib.Path(env).expanduser()
  cache = pathlib.Path(os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache')
  py = f'py{sys.version_info.major}{sys.version_info.minor}'
  return cache / 'qjax' / 'aot' / f'jax{jax.__version__}-{py}'


def libtpu_pin() -> Optional[str]:
  """The libtpu requirement jax's `[tpu]` extra names (e.g. 'libtpu==0.0.42.*'), or None."""
  for req in importlib.metadata.requires('jax') or ():
    if req.startswith('libtpu') and 'extra == "tpu"' in req:
      return req.split(';')[0].strip().replace(' ', '')
  return None


def requirements() -> dict:
  """{component: alternatives}: what pip installs for each component, each alternative a
  tuple of requirements installed together, the first one the package index has.

  'libtpu': the pin of jax's `[tpu]` extra, else the newest release of the same series (below
  the next pin). 'cuda': the CUDA plugin and its PJRT runtime of the installed jax version, for
  CUDA 12 (what jax's `[cuda]` extra names), else CUDA 13 (jax 0.12.1 is published only
  there), else the newest CUDA 12 release of the same minor version. A plugin older than jaxlib
  cannot read the Pallas Triton kernels jaxlib writes ("reading newer builtin dialect version
  than supported"), hence an exact version first, whichever CUDA. Which one was installed is
  recorded in the folder's manifest and in every report.
  """
  version = jax.__version__
  minor = '.'.join(version.split('.')[:2])
  pin = libtpu_pin() or 'libtpu'
  m = re.fullmatch(r'libtpu==(\d+)\.(\d+)\.(\d+)(?:\.\*)?', pin)
  libtpu_fallback = f'libtpu<{m[1]}.{m[2]}.{int(m[3]) + 1}' if m else 'libtpu'
  cuda = lambda major, spec: (f'jax-cuda{major}-plugin{spec}', f'jax-cuda{major}-pjrt{spec}')
  return {
      'libtpu': ((pin,), (libtpu_fallback,)),
      'cuda': (cuda(12, f'=={version}'), cuda(13, f'=={version}'),
               cuda(12, f'>={minor},<={version}')),
  }


def read_manifest(folder: Optional[pathlib.Path] = None) -> Optional[dict]:
  """The installed components and versions, or None where nothing is installed."""
  path = pathlib.Path(folder or default_dir()) / MANIFEST
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _package(spec: str) -> str:
  return re.split(r'[<>=!~ ]', spec, maxsplit=1)[0]


def _installed(have: Optional[dict], wanted: dict) -> bool:
  """Whether a manifest is of an install of `wanted` for this jax: one that recorded the same
  requirements, or one without them (an earlier layout) that needed no fallback."""
  if not have or have.get('jax') != jax.__version__:
    return False
  if 'requirements' in have:
    return have['requirements'] == wanted
  return not have.get('fallbacks') and all(
      have.get(_package(spec)) for alternatives in wanted.values() for spec in alternatives[0])


def install(folder: Optional[pathlib.Path] = None, *, say=print) -> dict:
  """Install libtpu and the CUDA plugin (no dependencies) into `folder`; idempotent.

  The install is made in a folder beside it, which then replaces `folder`, so that a process
  reading the toolchain never sees half of one.

  Returns:
    The manifest: {package: installed version, 'jax': jax's version, 'python': ...,
    'requirements': what was asked, 'fallbacks': {component: why}} .

  Raises:
    RuntimeError: pip failed for a component with every alternative (pip's output named).
  """
  folder = pathlib.Path(folder or default_dir())
  wanted = json.loads(json.dumps(requirements()))
  have = read_manifest(folder)
  if _installed(have, wanted):
    return have
  stage, old = (folder.with_name(folder.name + suffix) for suffix in ('.installing', '.old'))
  shutil.rmtree(stage, ignore_errors=True)
  stage.mkdir(parents=True)
  manifest = {'jax': jax.__version__, 'python': sys.version.split()[0], 'requirements': wanted}
  for component, alternatives in requirements().items():
    for specs in alternatives:
      say(f"qjax.aot: installing {' '.join(specs)} into {folder}")
      run = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',
                            '--target', str(stage), *specs],
                           capture_output=True, text=True, check=False)
      if run.returncode == 0:
        break
    else:
      raise RuntimeError(f"qjax.aot: pip could not install {component} into {folder} (tried "
                         f"{'; '.join(' '.join(a) for a in alternatives)}):\n"
                         f'{run.stderr[-2000:]}')
    for spec in specs:
      manifest[_package(spec)] = _version_in(stage, _package(spec))
    if specs != alternatives[0]:
      manifest.setdefault('fallbacks', {})[component] = (
          f"{' '.join(alternatives[0])}: not on the package index; installed {' '.join(specs)}")
  (stage / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
  shutil.rmtree(old, ignore_errors=True)
  if folder.exists():
    folder.rename(old)
  stage.rename(folder)
  shutil.rmtree(old, ignore_errors=True)
  return manifest


def _version_in(folder: pathlib.Path, component: str) -> Optional[str]:
  name = component.replace('-', '_')
  for info in folder.glob(f'{name}-*.dist-info'):
    return info.name[len(name) + 1:-len('.dist-info')]
  return None


def status(folder: Optional[pathlib.Path] = None) -> dict:
  """What `activate` would find: {'folder', 'tpu', 'gpu', 'manifest', 'hint'}."""
  folder = pathlib.Path(folder or default_dir())
  tpu = (folder / 'libtpu' / 'libtpu.so').is_file()
  gpu = (folder / 'jax_plugins').is_dir() and any((folder / 'jax_plugins').glob('xla_cuda*'))
  return {'folder': str(folder), 'tpu': tpu, 'gpu': gpu, 'manifest': read_manifest(folder),
          'hint': None if tpu and gpu else
          f'python -m qjax.aot.install (installs into {folder}; ~0.5-1.2 GB)'}


def _plugin_module(folder: pathlib.Path) -> Optional[str]:
  for d in sorted((folder / 'jax_plugins').glob('xla_cuda*')):
    return f'jax_plugins.{d.name}'
  return None


@contextlib.contextmanager
def _env(**values) -> Iterator[None]:
  old = {k: os.environ.get(k) for k in values}
  os.environ.update({k: v for k, v in values.items() if v is not None})
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


# libtpu reads these at load; without them it prints that it could not find a TPU host.
_TPU_ENV = {'TPU_ACCELERATOR_TYPE': 'v5litepod-1', 'TPU_SKIP_MDS_QUERY': '1',
            'TPU_WORKER_HOSTNAMES': 'localhost', 'TPU_WORKER_ID': '0',
            'ALLOW_MULTIPLE_LIBTPU_LOAD': '1', 'TF_CPP_MIN_LOG_LEVEL': '2'}


def activate(platform: str, folder: Optional[pathlib.Path] = None) -> None:
  """Make `platform`'s compile-only toolchain ('tpu' or 'gpu') reachable in this process.

  The process's own backends start first (`jax.devices()`), so the TPU library and the CUDA
  plugin are seen only by the compile-only topologies `qjax.aot` builds.

  Raises:
    RuntimeError: the toolchain is not installed (the command that installs it named).
  """
  if platform in _ACTIVE:
    return
  folder = pathlib.Path(folder or default_dir())
  st = status(folder)
  if not st[platform]:
    raise RuntimeError(f'qjax.aot: no compile-only {platform.upper()} toolchain in {folder}; '
                       f'install it with `{sys.executable} -m qjax.aot.install` (or set '
                       f'{ENV_VAR} to a folder that has one).')
  jax.devices()  # this process's backends come up without the toolchain
  if platform == 'tpu':
    _ACTIVE['tpu'] = str(folder / 'libtpu' / 'libtpu.so')
    return
  if str(folder) not in sys.path:
    sys.path.append(str(folder))
  importlib.invalidate_caches()
  module = importlib.import_module(_plugin_module(folder))
  # No GPU here: skip the plugin's check of the CUDA runtime libraries (compiling needs none).
  with _env(JAX_SKIP_CUDA_CONSTRAINTS_CHECK='1'):
    module.initialize()
  _ACTIVE['gpu'] = module.__name__


@contextlib.contextmanager
def tpu_env() -> Iterator[None]:
  """The environment libtpu is loaded in (the library's path, quiet host discovery)."""
  values = dict(_TPU_ENV, TPU_LIBRARY_PATH=_ACTIVE.get('tpu'))
  with _env(**values):
    yield
