"""qjax.aot.toolchain without a toolchain: what it pins, where it looks, what it says when the
toolchain is missing."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from qjax.aot import toolchain


def test_requirements_pin_the_installed_jax():
  req = toolchain.requirements()
  assert list(req) == ['libtpu', 'cuda']
  v = jax.__version__
  minor = '.'.join(v.split('.')[:2])
  assert req['cuda'] == ((f'jax-cuda12-plugin=={v}', f'jax-cuda12-pjrt=={v}'),
                         (f'jax-cuda13-plugin=={v}', f'jax-cuda13-pjrt=={v}'),
                         (f'jax-cuda12-plugin>={minor},<={v}', f'jax-cuda12-pjrt>={minor},<={v}'))
  extra = [r.split(';')[0].replace(' ', '') for r in importlib.metadata.requires('jax') or ()
           if r.startswith('libtpu') and 'extra == "tpu"' in r]
  (pin,), (fallback,) = req['libtpu']
  assert pin == (extra[0] if extra else 'libtpu')
  if pin.startswith('libtpu=='):  # 'libtpu==0.0.42.*' falls back below 0.0.43
    major, minor_, patch = pin.split('==')[1].split('.')[:3]
    assert fallback == f'libtpu<{major}.{minor_}.{int(patch) + 1}'


class _Pip:
  """`subprocess.run` of pip against an index of `available` {package: version}: installs
  (writes a dist-info) only when every spec names an available version."""

  def __init__(self, available):
    self.available, self.calls = available, []

  def __call__(self, cmd, **_):
    specs = cmd[cmd.index('--target') + 2:]
    target = pathlib.Path(cmd[cmd.index('--target') + 1])
    self.calls.append(specs)
    found = {}
    for spec in specs:
      name = re.split(r'[<>=]', spec)[0]
      version = self.available.get(name)
      if version is None or ('==' in spec and spec.split('==')[1].rstrip('.*') not in version):
        return subprocess.CompletedProcess(cmd, 1, '', f'No matching distribution for {spec}')
      found[name] = version
    for name, version in found.items():
      (target / f"{name.replace('-', '_')}-{version}.dist-info").mkdir(parents=True)
    return subprocess.CompletedProcess(cmd, 0, '', '')


def test_install_takes_the_first_alternative_the_index_has_and_records_it(monkeypatch,
                                                                          tmp_path):
  v = jax.__version__
  (pin,), _ = toolchain.requirements()['libtpu']
  libtpu = pin.split('==')[1].rstrip('.*') + '.1' if '==' in pin else '0.0.1'
  pip = _Pip({'libtpu': libtpu, 'jax-cuda13-plugin': v, 'jax-cuda13-pjrt': v})
  monkeypatch.setattr(toolchain.subprocess, 'run', pip)
  folder = tmp_path / 'tc'
  folder.mkdir()
  (folder / 'stale').write_text('from an earlier install')
  manifest = toolchain.install(folder, say=lambda _: None)
  assert pip.calls[1:] == [[f'jax-cuda12-plugin=={v}', f'jax-cuda12-pjrt=={v}'],
                           [f'jax-cuda13-plugin=={v}', f'jax-cuda13-pjrt=={v}']]
  assert manifest['libtpu'] == libtpu and manifest['jax-cuda13-plugin'] == v
  assert 'not on the package index' in manifest['fallbacks']['cuda']
  assert 'libtpu' not in manifest.get('fallbacks', {})
  assert toolchain.read_manifest(folder) == manifest
  assert not (folder / 'stale').exists()  # the new install replaced the folder
  assert sorted(p.name for p in tmp_path.iterdir()) == ['tc']
  calls = len(pip.calls)
  assert toolchain.install(folder, say=lambda _: None) == manifest  # idempotent
  assert len(pip.calls) == calls


def test_install_names_what_it_tried_when_the_index_has_nothing(monkeypatch, tmp_path):
  monkeypatch.setattr(toolchain.subprocess, 'run', _Pip({}))
  with pytest.raises(RuntimeError, match=r'could not install libtpu .*tried libtpu'):
    toolchain.install(tmp_path / 'tc', say=lambda _: None)


def test_the_folder_is_per_jax_and_python_and_the_variable_overrides_it(monkeypatch, tmp_path):
  monkeypatch.delenv(toolchain.ENV_VAR, raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  py = f'py{sys.version_info.major}{sys.version_info.minor}'
  assert toolchain.default_dir() == tmp_path / 'qjax' / 'aot' / f'jax{jax.__version__}-{py}'
  monkeypatch.setenv(toolchain.ENV_VAR, str(tmp_path / 'mine'))
  assert toolchain.default_dir() == tmp_path / 'mine'


def test_status_of_an_empty_folder_names_the_install_command(tmp_path):
  st = toolchain.status(tmp_path)
  assert (st['tpu'], st['gpu'], st['manifest']) == (False, False, None)
  assert st['folder'] == str(tmp_path)
  assert 'python -m qjax.aot.install' in st['hint'] and str(tmp_path) in st['hint']


def test_status_finds_what_an_install_leaves(tmp_path):
  (tmp_path / 'libtpu').mkdir()
  (tmp_path / 'libtpu' / 'libtpu.so').write_bytes(b'')
  assert toolchain.status(tmp_path)['tpu'] and not toolchain.status(tmp_path)['gpu']
  (tmp_path / 'jax_plugins' / 'xla_cuda12').mkdir(parents=True)
  (tmp_path / toolchain.MANIFEST).write_text('{"jax": "0.0.0", "libtpu": "0.0.1"}')
  st = toolchain.status(tmp_path)
  assert st['tpu'] and st['gpu'] and st['hint'] is None
  assert st['manifest'] == {'jax': '0.0.0', 'libtpu': '0.0.1'}


@pytest.mark.parametrize('platform', ['tpu', 'gpu'])
def test_a_missing_toolchain_is_an_error_that_says_how_to_install_it(platform, tmp_path):
  with pytest.raises(RuntimeError, match=rf'no compile-only {platform.upper()} toolchain in '
                     rf'.*-m qjax\.aot\.install.*{toolchain.ENV_VAR}'):
    toolchain.activate(platform, tmp_path)
