"""matplotlib is the optional 'plots' extra: every qjax module imports without it, and asking
for a plot says how to install it."""

import importlib.util
import subprocess
import sys

import pytest

from qjax.eval import report

_IMPORT_ALL = '''
import importlib, pkgutil, sys
sys.modules['matplotlib'] = None  # `import matplotlib` raises ImportError
import qjax
names = [m.name for m in pkgutil.walk_packages(qjax.__path__, 'qjax.')
         if '.kernels.build' not in m.name]
for name in names:
  importlib.import_module(name)
assert not any(k.startswith('matplotlib.') for k in sys.modules)
print(len(names))
'''


def test_every_module_imports_without_matplotlib(subprocess_xla_flags):
  out = subprocess.run([sys.executable, '-c', _IMPORT_ALL], capture_output=True, text=True,
                       env={'XLA_FLAGS': subprocess_xla_flags, 'JAX_PLATFORMS': 'cpu',
                            'PATH': ''}, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert int(out.stdout.split()[-1]) > 100  # it walked the whole package


def test_asking_for_a_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, 'matplotlib', None)
  with pytest.raises(report.PlotsUnavailable, match=r"pip install 'qjax\[plots\]'"):
    report.pyplot()
  # A figure-writing function warns and returns None: the run's tables do not depend on it.
  with pytest.warns(UserWarning, match=r"plot_ppl_vs_bytes: figure not written"):
    assert report.plot_ppl_vs_bytes([], str(tmp_path / 'a.png')) is None
  assert not (tmp_path / 'a.png').exists()


@pytest.mark.plots
def test_plots_marked_tests_run_where_matplotlib_is_installed():
  """The `plots` marker (tests/conftest.py) skips only where matplotlib is missing."""
  assert importlib.util.find_spec('matplotlib') is not None
  assert report.pyplot().get_backend().lower() == 'agg'
