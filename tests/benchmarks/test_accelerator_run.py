"""benchmarks/accelerator_run.sh, the one command that checks qjax on a GPU or TPU, checked on
CPU in its dry-run mode: it parses, every test path and script it would run exists (a renamed
directory fails here, not on the accelerator), the directories that have not run on a GPU come
first, the suite and the check together stay within 540 s, and a bad argument is refused."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'benchmarks' / 'accelerator_run.sh'


def _run(*args, timeout=60, **env):
  # The suite it starts is a pytest run of its own, not this one's xdist worker.
  base = {k: v for k, v in os.environ.items() if not k.startswith('PYTEST_')}
  return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True,
                        env={**base, **env}, cwd=ROOT, timeout=timeout)


def _test_dirs() -> set:
  """Directories under tests/ holding test files of the repository (git's, where the tree is
  a checkout: a folder of tests not yet committed is not the suite's)."""
  try:
    files = subprocess.run(['git', 'ls-files', 'tests'], cwd=ROOT, capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
  except (OSError, subprocess.SubprocessError):
    files = [str(p.relative_to(ROOT)) for p in (ROOT / 'tests').rglob('test_*.py')]
  parts = [pathlib.PurePosixPath(f).parts for f in files]
  return {p[1] for p in parts if len(p) > 2 and p[-1].startswith('test_')}


def test_dry_run_names_only_paths_that_exist(tmp_path):
  done = _run('--dry-run', OUT=str(tmp_path / 'out'))
  assert done.returncode == 0, done.stderr
  commands = [line[2:] for line in done.stdout.splitlines() if line.startswith('+ ')]
  pytest_cmd = next(c for c in commands if ' -m pytest ' in c)
  assert pytest_cmd.startswith('timeout -s INT 240 ')
  paths = [w for w in pytest_cmd.split() if w.startswith('tests')]
  # The directories that have not run on a GPU come before those that ran on the H200.
  assert paths.index('tests/core') > max(paths.index(p) for p in (
      'tests/checkpoints', 'tests/train', 'tests/algorithms', 'tests/kernels', 'tests/pipeline',
      'tests/benchmarks'))
  assert len(paths) >= 10
  missing = [p for p in paths if not (ROOT / p).exists()]
  assert not missing, f'accelerator_run.sh names test paths that do not exist: {missing}'
  # Every test directory of the suite is in the default list, so nothing is left unrun.
  dirs = _test_dirs()
  assert {'core', 'benchmarks'} <= dirs
  assert dirs <= {pathlib.Path(p).name for p in paths}
  check_cmd = next(c for c in commands if 'device_check.sh' in c)
  assert '--budget_s=300' in check_cmd and (ROOT / 'benchmarks' / 'device_check.sh').exists()
  # Both parts' bounds leave 60 s of a 600 s run for their start-up (installs, imports).
  budget = int(next(w for w in check_cmd.split() if w.startswith('--budget_s='))[11:])
  assert int(pytest_cmd.split()[3]) + budget <= 540


def test_parts_and_bad_arguments(tmp_path):
  suite = _run('suite', '--dry-run', OUT=str(tmp_path))
  assert suite.returncode == 0 and 'device_check.sh' not in suite.stdout
  check = _run('check', '--dry-run', CHECK_S='100', CHECK_ARGS='--engine=w8a8 --hf=no',
               OUT=str(tmp_path))
  assert check.returncode == 0 and ' -m pytest ' not in check.stdout
  assert '--budget_s=100 --engine=w8a8 --hf=no' in check.stdout
  bad = _run('everything')
  assert bad.returncode == 2 and "unknown argument 'everything'" in bad.stderr


def test_a_real_run_on_the_cpu_passes_and_writes_both_parts(tmp_path):
  """Not a dry run: one quick test for the suite and a smoke device check of one model, on
  the CPU; exit 0 with the suite's junit XML and the check's files. A failing suite makes the
  exit status non-zero (the status is read from pytest, not from a later command)."""
  out = tmp_path / 'out'
  env = dict(PYTHON=sys.executable, JAX_PLATFORMS='cpu', OUT=str(out), CACHE_DIR='',
             WORKERS='1', SUITE_S='240', CHECK_S='200',
             TESTS='tests/aot/test_aot_toolchain.py::test_status_of_an_empty_folder_names_the_'
                   'install_command',
             CHECK_ARGS='--smoke --models=gemma3_270m --formats=bf16 --engine= --hf=no '
                        '--attention=no --threads=2')
  done = _run('all', timeout=420, **env)
  assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
  assert 'tests="1"' in (out / 'suite.xml').read_text()
  assert '1 passed' in (out / 'suite.log').read_text()
  check = json.loads((out / 'device_check' / 'device_check.json').read_text())
  assert [(r['model'], r['format']) for r in check['rows']] == [('gemma3_270m', 'bf16')]
  assert 'error' not in check['rows'][0]
  assert (out / 'device_check' / 'device_check.md').is_file()

  failing = tmp_path / 'failing'
  failing.mkdir()
  (failing / 'test_fails.py').write_text('def test_fails():\n  assert False\n')
  done = _run('suite', timeout=240, **dict(env, TESTS=str(failing), OUT=str(tmp_path / 'f')))
  assert done.returncode == 1, (done.stdout[-3000:], done.stderr[-3000:])
