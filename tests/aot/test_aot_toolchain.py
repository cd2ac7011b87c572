"""qjax.aot.toolchain without a toolchain: what it pins, where it looks, what it says when the
toolchain is missing."""

import importlib.metadata
import sys

import jax
import pytest

from qjax.aot import toolchain


def test_requirements_pin_the_installed_jax():
  req = toolchain.requirements()
  assert set(req) == {'libtpu', 'jax-cuda12-plugin', 'jax-cuda12-pjrt'}
  v = jax.__version__
  minor = '.'.join(v.split('.')[:2])
  assert req['jax-cuda12-plugin'] == (f'jax-cuda12-plugin=={v}',
                                      f'jax-cuda12-plugin>={minor},<={v}')
  assert req['jax-cuda12-pjrt'] == (f'jax-cuda12-pjrt=={v}', f'jax-cuda12-pjrt>={minor},<={v}')
  extra = [r.split(';')[0].replace(' ', '') for r in importlib.metadata.requires('jax') or ()
           if r.startswith('libtpu') and 'extra == "tpu"' in r]
  pin, fallback = req['libtpu']
  assert pin == (extra[0] if extra else 'libtpu')
  if pin.startswith('libtpu=='):  # 'libtpu==0.0.42.*' falls back below 0.0.43
    major, minor_, patch = pin.split('==')[1].split('.')[:3]
    assert fallback == f'libtpu<{major}.{minor_}.{int(patch) + 1}'


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
