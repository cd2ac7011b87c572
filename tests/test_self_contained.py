"""The repository stands alone: no path of a particular machine, no file outside the clone.

A fresh clone has no sibling data folder and no notes kept beside it; code, configs, tests
and docs that name one break there (or send a reader to a file they cannot open).
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ('qjax', 'experiments', 'configs', 'tests', 'benchmarks', 'scripts', 'colab', 'docs')
FILES = ('README.md', 'Makefile', 'setup.py')
SUFFIXES = {'.py', '.md', '.ipynb', '.txt', '.cfg', '.toml', '.ini', '.json', '.yaml', '.yml',
            '.sh', ''}
# Data files (the vendored corpora, test goldens) are not prose or code.
SKIP = ('qjax/data/corpora/', 'tests/testdata/')
# Spelt in pieces so that this file does not match itself.
FORBIDDEN = re.compile('|'.join([
    r'\.\./' + 'shared',                    # the sibling folder a clone does not have
    r'(?<![\w.-])/' + r'(?:work|root|home|Users|mnt)/',  # absolute paths of a machine
    r'\b' + 'NOTES' + r'\.md\b',            # notes that live outside the repository
    r'\bshared/' + 'data\b',
]))


def _files():
  for name in FILES:
    if (ROOT / name).is_file():
      yield ROOT / name
  for folder in FOLDERS:
    for path in sorted((ROOT / folder).rglob('*')):
      rel = path.relative_to(ROOT).as_posix()
      if (path.is_file() and path.suffix in SUFFIXES and '__pycache__' not in rel
          and not rel.startswith(SKIP)):
        yield path


def test_no_machine_paths_or_outside_files():
  hits = []
  for path in _files():
    try:
      text = path.read_text(encoding='utf-8')
    except UnicodeDecodeError:
      continue
    for i, line in enumerate(text.splitlines(), 1):
      if FORBIDDEN.search(line):
        hits.append(f'{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}')
  assert not hits, ('files name a path of this machine or a file outside the repository; '
                    'use qjax.data for the corpora and put the cited fact where it is '
                    'needed:\n' + '\n'.join(hits))


def test_the_check_would_catch_one():
  assert FORBIDDEN.search('root = ' + "'../" + "shared/data'")
  assert FORBIDDEN.search('x = "/' + 'work/main/qjax"')
  assert FORBIDDEN.search('see ' + 'NOTES' + '.md')
  assert not FORBIDDEN.search("workdir = '/tmp/qat_base'  # results/lm/, shared_axes")
