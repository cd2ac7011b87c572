"""benchmarks/accelerator_run.sh, the one command that checks qjax on a GPU or TPU, checked on
CPU in its dry-run mode: it parses, every test path and script it would run exists (a renamed
directory fails here, not on the accelerator), the directories that have not run on a GPU come
first, the suite and the check together stay within 540 s, and a bad argument is refused."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'benchmarks' / 'accelerator_run.sh'


def _run(*args, **env):
  return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True,
                        env={**os.environ, **env}, cwd=ROOT, timeout=60)


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
