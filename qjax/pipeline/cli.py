"""What the command-line entry points (`experiments/*.py`) share: a `--config` flag whose
overrides are checked before absl sees them, and a run from any directory.

    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _CONFIG = cli.define_config(os.path.join(ROOT, 'configs', 'convert.py'), ROOT,
                                prog='experiments.convert')

`define_config` loads the config file (the default or `--config=`) and checks every
`--config.a.b=value` against it: a name it does not have is an error that names the flag and
lists the names it has (ml_collections raised a bare AttributeError while the module was
imported), and a plain string given to a setting that holds a tuple of strings becomes a
one-element tuple (`--config.prompts='Hello world'`, where a Python tuple literal was the
only accepted form). The repository root goes on `sys.path` first, so a config that imports
`configs.*` loads from any working directory (`python /path/to/qjax/experiments/serve.py`).
"""

from __future__ import annotations

import ast
import difflib
import os
import sys
from typing import Optional

from absl import app
from ml_collections import config_flags


def _config_arg(argv: list[str], default: str) -> str:
  """The config file path `argv` gives (`--config=PATH` or `--config PATH`), else `default`."""
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      return arg[len('--config='):]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return default


def _load(spec: str):
  """`get_config()` of a config file spec ('path.py' or 'path.py:arg'), or None if unreadable
  (ml_collections then reports it)."""
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    return None
  import importlib.util  # pylint: disable=g-import-not-at-top
  module_spec = importlib.util.spec_from_file_location('_qjax_cli_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(*([arg] if arg else []))


def _names(config, prefix: str = '') -> list[str]:
  """Every settable dotted name of a ConfigDict (nested dicts included)."""
  out = []
  for key, value in config.items():
    out.append(prefix + key)
    if hasattr(value, 'items'):
      out += _names(value, prefix + key + '.')
  return out


def _lookup(config, dotted: str):
  """(found, value) of a dotted name in a ConfigDict."""
  node = config
  for part in dotted.split('.'):
    if not hasattr(node, 'items') or part not in node:
      return False, None
    node = node[part]
  return True, node


def check_overrides(argv: list[str], config, spec: str, prog: str) -> list[str]:
  """`argv` with its `--config.*` overrides checked against `config` (loaded from `spec`).

  Returns:
    argv, where a plain string given to a tuple-of-strings setting is written as a tuple.

  Raises:
    app.UsageError: an override names no setting of the config (naming the flag, the
      closest names and every top-level one).
  """
  out = []
  for arg in argv:
    if arg.startswith('--config.') and arg != '--config.':
      name, eq, value = arg[len('--config.'):].partition('=')
      found, current = _lookup(config, name)
      if not found:
        names = _names(config)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f' Did you mean {", ".join("--config." + c for c in close)}?' if close else ''
        top = ', '.join(k for k in config.keys())
        raise app.UsageError(
            f'{prog}: --config.{name}: {spec} has no setting {name!r}.{hint} Its settings '
            f'are: {top} (nested ones as --config.section.name).')
      if (eq and isinstance(current, (tuple, list))
          and all(isinstance(x, str) for x in current) and not _is_literal_sequence(value)):
        arg = f'--config.{name}={(value,)!r}'
    out.append(arg)
  return out


def _is_literal_sequence(text: str) -> bool:
  try:
    return isinstance(ast.literal_eval(text), (tuple, list))
  except (ValueError, SyntaxError):
    return False


def define_config(default: str, root: str, *, lock_config: bool = True,
                  prog: Optional[str] = None):
  """`config_flags.DEFINE_config_file('config', default)` after `check_overrides` on sys.argv.

  Args:
    default: the config file used without `--config=` (an absolute path, so any working
      directory finds it).
    root: the repository root, put on sys.path (configs import `configs.*`).
    lock_config: as DEFINE_config_file.
    prog: the command's name for messages (default: sys.argv[0]'s file name).

  Returns:
    The FlagHolder of the config.
  """
  if root not in sys.path:
    sys.path.insert(0, root)
  prog = prog or os.path.basename(sys.argv[0] or 'experiments')
  spec = _config_arg(sys.argv, default)
  config = _load(spec)
  if config is not None:
    try:
      sys.argv[:] = check_overrides(sys.argv, config, spec, prog)
    except app.UsageError as e:
      sys.stderr.write(f'{e}\n')
      sys.exit(2)
  return config_flags.DEFINE_config_file('config', default, lock_config=lock_config)


# Errors a command raises to refuse its input (a bad value, a missing or occupied path): the
# message names the value and the fix, so it is printed alone, not under a traceback.
REFUSALS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def run(main, prog: str) -> None:
  """`app.run(main)`, where a refusal (`REFUSALS`) prints '<prog>: <message>' and exits 2.

  QJAX_TRACEBACK=1 keeps the traceback (a refusal raised from inside jax or a library is
  rarer, and its traceback is what a bug report wants).
  """
  def guarded(argv):
    try:
      return main(argv)
    except REFUSALS as e:
      if os.environ.get('QJAX_TRACEBACK') == '1':
        raise
      sys.stderr.write(f'{prog}: {type(e).__name__}: {e}\n(QJAX_TRACEBACK=1 shows where it '
                       'was raised)\n')
      sys.exit(2)
  app.run(guarded)


def check_context(i: int, prompt_len: int, max_tokens: int, context: int,
                  model_max: int) -> None:
  """Refuse prompt `i` of `prompt_len` tokens when it and `--config.max_tokens` pass the
  engine's `context`, naming the flag that fixes it: `--config.engine.max_len` when the model
  holds that many tokens, else a shorter prompt (raising a flag past the model cannot help)."""
  need = prompt_len + max_tokens
  if need <= context:
    return
  fix = (f'pass --config.engine.max_len={need} or more (the model holds {model_max})'
         if need <= model_max else
         f'the model holds {model_max} tokens at most: shorten the prompt')
  raise ValueError(f'prompt {i} has {prompt_len} tokens + --config.max_tokens={max_tokens} > '
                   f'the context {context}; {fix}, or lower --config.max_tokens.')
