"""benchmarks/accelerator_run.sh, the one command for a lent accelerator, checked on CPU in its
dry-run mode: it parses, every test path and script it would run exists (a renamed directory
fails here, not on a machine whose minutes are counted), and a bad argument is refused."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'benchmarks' / 'accelerator_run.sh'


def _run(*args, **env):
  return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True,
                        env={**os.environ, **env}, cwd=ROOT, timeout=60)


def test_dry_run_names_only_paths_that_exist(tmp_path):
  done = _run('--dry-run', OUT=str(tmp_path / 'out'))
  assert done.returncode == 0, done.stderr
  commands = [line[2:] for line in done.stdout.splitlines() if line.startswith('+ ')]
  pytest_cmd = next(c for c in commands if ' -m pytest ' in c)
  assert pytest_cmd.startswith('timeout -s INT 300 ')
  paths = [w for w in pytest_cmd.split() if w.startswith('tests')]
  assert len(paths) >= 10
  missing = [p for p in paths if not (ROOT / p).exists()]
  assert not missing, f'accelerator_run.sh names test paths that do not exist: {missing}'
  # Every test directory with tests is in the default list, so nothing is left unrun.
  dirs = {p.name for p in (ROOT / 'tests').iterdir() if p.is_dir() and any(p.glob('test_*.py'))}
  assert dirs <= {pathlib.Path(p).name for p in paths}
  check_cmd = next(c for c in commands if 'device_check.sh' in c)
  assert '--budget_s=240' in check_cmd and (ROOT / 'benchmarks' / 'device_check.sh').exists()


def test_parts_and_bad_arguments(tmp_path):
  suite = _run('suite', '--dry-run', OUT=str(tmp_path))
  assert suite.returncode == 0 and 'device_check.sh' not in suite.stdout
  check = _run('check', '--dry-run', CHECK_S='100', OUT=str(tmp_path))
  assert check.returncode == 0 and ' -m pytest ' not in check.stdout
  assert '--budget_s=100' in check.stdout
  bad = _run('everything')
  assert bad.returncode == 2 and "unknown argument 'everything'" in bad.stderr
