"""The two text corpora vendored with qjax, by name.

The files live in `qjax/data/corpora/` (installed with the package as package data); their
source, size, sha256 and licence are in `qjax/data/corpora/README.md`, and `SHA256` below
repeats the hashes so that a test can check the files byte for byte.

    from qjax import data
    text = data.corpus('tinyshakespeare')          # str
    path = data.corpus_path('wikitext2_valid')     # pathlib.Path, e.g. for a config's source
"""

from __future__ import annotations

import pathlib

CORPORA_DIR = pathlib.Path(__file__).resolve().parent / 'corpora'

# name -> path under CORPORA_DIR. The names are the ones results and configs use.
FILES = {
    'tinyshakespeare': 'tinyshakespeare/input.txt',
    'wikitext2_valid': 'wikitext-2/valid.txt',
}

# name -> sha256 of the file, as in corpora/README.md (the upstream blobs, byte for byte).
SHA256 = {
    'tinyshakespeare': '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed',
    'wikitext2_valid': 'f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8',
}


def names() -> tuple[str, ...]:
  """The known corpus names, sorted."""
  return tuple(sorted(FILES))


def corpus_path(name: str) -> pathlib.Path:
  """The path of a vendored corpus file.

  Args:
    name: one of `names()` ('tinyshakespeare', 'wikitext2_valid').

  Returns:
    The absolute path of the file inside the installed package.

  Raises:
    ValueError: `name` is not a known corpus (the message lists the known ones).
    FileNotFoundError: the package was installed without its data files.
  """
  if name not in FILES:
    raise ValueError(f'unknown corpus {name!r}; the known corpora are {list(names())}.')
  path = CORPORA_DIR / FILES[name]
  if not path.is_file():
    raise FileNotFoundError(f'corpus {name!r} should be at {path} but is not: qjax was '
                            'installed without its package data; reinstall it with '
                            '`pip install .` from a complete checkout.')
  return path


def corpus(name: str) -> str:
  """The text of a vendored corpus (UTF-8).

  Args:
    name: one of `names()` ('tinyshakespeare', 'wikitext2_valid').

  Returns:
    The whole file as a str.
  """
  return corpus_path(name).read_text(encoding='utf-8')
