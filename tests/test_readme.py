"""The README runs as written: its Python blocks execute, its commands name things that exist,
and its `make demo` transcript has the shape of what the demo prints."""

import ast
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
MAX_LINES = 350


def _blocks(text: str) -> list[tuple[str, str]]:
  """(language, body) of every fenced code block."""
  return re.findall(r'^```(\w*)\n(.*?)^```', text, flags=re.M | re.S)


def _readme_blocks(lang: str) -> list[str]:
  return [body for kind, body in _blocks(README.read_text(encoding='utf-8')) if kind == lang]


def _env(xla_flags: str) -> dict:
  # The backend is the suite's (JAX_PLATFORMS from conftest: cpu unless a run asks for another).
  return {**os.environ, 'XLA_FLAGS': xla_flags}


def test_readme_fits_on_a_few_screens():
  n = len(README.read_text(encoding='utf-8').splitlines())
  assert n <= MAX_LINES, f'README.md has {n} lines (at most {MAX_LINES}): move detail to docs/'


def test_blocks_are_found():
  # The parser itself: a README without the blocks below would make the other tests vacuous.
  assert _readme_blocks('python') and _readme_blocks('bash')
  assert _blocks('```python\nx = 1\n```\ntext\n```\nout\n```\n') == [('python', 'x = 1\n'),
                                                                     ('', 'out\n')]


@pytest.mark.parametrize('index', range(len(_readme_blocks('python'))))
def test_python_block_runs(index, subprocess_xla_flags, tmp_path):
  code = _readme_blocks('python')[index]
  ast.parse(code)  # a syntax error names the block before a subprocess is started
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600, env=_env(subprocess_xla_flags))
  assert proc.returncode == 0, f'README python block {index} failed:\n{code}\n{proc.stderr[-3000:]}'


def _make_targets() -> set[str]:
  text = (ROOT / 'Makefile').read_text(encoding='utf-8')
  return set(re.findall(r'^([A-Za-z0-9_.-]+):', text, flags=re.M))


def _extras() -> set[str]:
  tree = ast.parse((ROOT / 'setup.py').read_text(encoding='utf-8'))
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == 'extras_require':
      return {k.value for k in node.value.keys}
  raise AssertionError('setup.py has no extras_require')


def _module_exists(name: str) -> bool:
  path = ROOT.joinpath(*name.split('.'))
  if path.with_suffix('.py').is_file() or (path / '__init__.py').is_file():
    return True
  return importlib.util.find_spec(name.split('.')[0]) is not None and '.' not in name


def _config_has(config_path: str, dotted: str) -> bool:
  sys.path.insert(0, str(ROOT))
  try:
    spec = importlib.util.spec_from_file_location('_readme_config', ROOT / config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    node = module.get_config()
  finally:
    sys.path.remove(str(ROOT))
  for key in dotted.split('.'):
    if key not in node:
      return False
    node = node[key]
  return True


def _check_command(words: list[str]) -> list[str]:
  """What a README command names that does not exist (empty if all is well)."""
  while words and re.fullmatch(r'[A-Z_]+=\S*', words[0]):  # environment assignments
    words = words[1:]
  if not words:
    return []
  program, args = words[0], words[1:]
  problems = []
  if program == 'make':
    problems += [f'make target {t!r}' for t in args if '=' not in t and t not in _make_targets()]
  elif program.endswith('/pip') or program == 'pip':
    for arg in args:
      match = re.fullmatch(r"\.\[(\w+)\]", arg.strip("'"))
      if match and match.group(1) not in _extras():
        problems.append(f'pip extra {match.group(1)!r}')
  elif re.search(r'python3?$', program):
    if args[:1] == ['-m'] and args[1] != 'venv' and not _module_exists(args[1]):
      problems.append(f'module {args[1]!r}')
    config = next((a.split('=', 1)[1] for a in args if a.startswith('--config=')), None)
    if config is not None:
      if not (ROOT / config).is_file():
        problems.append(f'config {config!r}')
      else:
        for arg in args:
          match = re.fullmatch(r'--config\.([\w.]+)=.*', arg)
          if match and not _config_has(config, match.group(1)):
            problems.append(f'config field {match.group(1)!r} of {config}')
  else:
    problems.append(f'unknown program {program!r} (teach this test what it is)')
  return problems


def test_bash_blocks_name_what_exists():
  problems = []
  for block in _readme_blocks('bash'):
    for line in block.splitlines():
      for command in re.split(r'&&|;', line.split('#', 1)[0]):
        if command.strip():
          problems += [f'{p} in: {line.strip()}' for p in _check_command(shlex.split(command))]
  assert not problems, 'README commands name things that do not exist:\n' + '\n'.join(problems)


def test_command_check_would_catch_one():
  assert _check_command(['make', 'no-such-target'])
  assert _check_command(['python', '-m', 'experiments.no_such_entry'])
  assert _check_command(['python', '-m', 'experiments.train', '--config=configs/nope.py'])
  assert _check_command(['python', '-m', 'experiments.train', '--config=configs/tiny_lm.py',
                         '--config.train.no_such_field=1'])
  assert _check_command(['pip', 'install', '-e', "'.[nope]'"])
  assert not _check_command(['XLA_FLAGS=', 'make', 'demo'])


def _shape(line: str) -> str:
  """A printed line with its numbers and spacing abstracted: what must not drift."""
  return ' '.join(re.sub(r'\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?', '9', line).split())


def _transcript_stage(text: str, header: str) -> list[str]:
  """The README transcript's lines of one stage: from `header` to the next blank line."""
  block = next(b for kind, b in _blocks(text) if kind == '' and header in b)
  lines = block.splitlines()
  start = lines.index(header)
  end = lines.index('', start)
  return lines[start:end]


def test_quiet_by_default_verbosity_brings_info_back():
  code = ('import experiments\n'
          'from absl import app, logging\n'
          'def main(argv):\n'
          '  logging.info("an-info-line")\n'
          '  logging.warning("a-warning")\n'
          'app.run(main)\n')
  quiet = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
  loud = subprocess.run([sys.executable, '-c', code, '--verbosity=0'], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
  assert 'a-warning' in quiet.stderr and 'an-info-line' not in quiet.stderr
  assert 'an-info-line' in loud.stderr


def test_demo_first_stage_prints_the_readme_transcript(subprocess_xla_flags, tmp_path):
  expected = _transcript_stage(README.read_text(encoding='utf-8'), '== 1. train')
  assert len(expected) >= 4, expected
  cmd = [sys.executable, '-m', 'experiments.demo', '--config=configs/demo.py',
         f'--config.workdir={tmp_path}/train', f'--config.out_dir={tmp_path}',
         '--stop_after=train',
         # A smaller run than the demo's (same code path, same lines): ~10 s instead of ~45.
         '--config.train.steps=20', '--config.train.warmup=2', '--config.train.log_every=10',
         '--config.train.batch=4', '--config.data.seq_len=32', '--config.model.num_layers=1',
         '--config.train.eval_windows=4', '--config.train.eval_batch=4',
         '--config.checkpoint.every=20']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=_env(subprocess_xla_flags))
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = [line for line in proc.stdout.splitlines() if line.strip()]
  # The same kinds of line in the same order (the run is shorter: fewer step lines).
  dedup = lambda shapes: [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]
  assert dedup([_shape(x) for x in printed]) == dedup([_shape(x) for x in expected]), (
      'the demo no longer prints what README.md shows; update the transcript:\n'
      + proc.stdout)
  # Quiet by default: no absl / Orbax / jax INFO lines on either stream.
  info = [x for x in (proc.stdout + proc.stderr).splitlines()
          if re.match(r'(I\d{4} |INFO[: ])', x)]
  assert not info, 'INFO log lines in the default demo output:\n' + '\n'.join(info[:10])


def test_shape_ignores_numbers_not_words():
  assert _shape('step    50/300  loss 2.4040  9,874 tok/s  ETA 52s') == _shape(
      'step   100/100  loss 1.9  13,707 tok/s  ETA 0s')
  assert _shape('step 50/300 loss 2.4') != _shape('step 50/300 ppl 2.4')


def test_every_notebook_has_a_colab_badge_and_install_cell():
  text = README.read_text(encoding='utf-8')
  links = re.findall(r'\(https://colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)'
                     r'/blob/main/colab/([\w.-]+\.ipynb)\)', text)
  badges = {notebook: repo for repo, notebook in links}
  notebooks = sorted(p.name for p in (ROOT / 'colab').glob('*.ipynb'))
  assert sorted(badges) == notebooks, f'badges for {sorted(badges)}, notebooks {notebooks}'
  for name in notebooks:
    cells = json.loads((ROOT / 'colab' / name).read_text(encoding='utf-8'))['cells']
    first = ''.join(next(c for c in cells if c['cell_type'] == 'code')['source'])
    assert "'google.colab' in sys.modules" in first and 'pip' in first, (
        f'{name}: the first code cell must install qjax on a Colab runtime')
    # The clone URL is the repository the README's badge opens.
    assert f'https://github.com/{badges[name]}' in first, (name, badges[name])
