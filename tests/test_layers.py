"""The import layers README.md states are the code's: what each package of qjax imports from
qjax (function-level imports included: they are imports too), and what a package's docstring
says it imports; no import cycle between modules, in qjax or in the harness around it;
`qjax.target` on jax alone; nothing in qjax importing the harness, and nothing but the tests
importing `experiments`."""

import ast
import collections
import functools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
QJAX = ROOT / 'qjax'
HARNESS = ('experiments', 'configs', 'benchmarks', 'scripts', 'tests')


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _modules(tops=('qjax',)) -> dict[str, pathlib.Path]:
  return {_module_name(p): p for top in tops for p in sorted((ROOT / top).rglob('*.py'))}


@functools.cache
def _parsed(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(encoding='utf-8'))


def _imports(path: pathlib.Path, name: str, modules) -> list[str]:
  """Every module `path` imports (absolute names; `from m import x` names m.x where x is a
  module of qjax, else m), at any depth of the file."""
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  found = []
  for node in ast.walk(_parsed(path)):
    if isinstance(node, ast.Import):
      found += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        parent = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parent + ([node.module] if node.module else []))
      found += [f'{base}.{a.name}' if f'{base}.{a.name}' in modules else base
                for a in node.names]
  return found


def _layer(module: str) -> str:
  """The README's name for the part of qjax a module belongs to: 'qjax' (the top-level API),
  'target', or a subpackage ('core', 'nn', ...)."""
  parts = module.split('.')
  return 'qjax' if len(parts) == 1 else parts[1]


def actual_layers() -> dict[str, set[str]]:
  """What each part of qjax imports from the other parts."""
  modules = _modules()
  graph = collections.defaultdict(set)
  for name, path in modules.items():
    graph[_layer(name)]
    for imported in _imports(path, name, modules):
      if imported == 'qjax' or imported.startswith('qjax.'):
        other = _layer(imported)
        if other != _layer(name):
          graph[_layer(name)].add(other)
  return dict(graph)


def stated_layers(text: str) -> dict[str, set[str]]:
  """The README's table `| package | imports from qjax |`: one row per package (or several
  packages of one row), the packages it imports in backticks, 'nothing' for none."""
  table = re.search(r'^\| package \| imports from qjax \|\n\|[-| ]+\|\n((?:\|.*\|\n)+)', text,
                    flags=re.M)
  assert table, 'README.md has no "| package | imports from qjax |" table'
  stated = {}
  for row in table.group(1).splitlines():
    packages, imports = [cell.strip() for cell in row.strip('|').split('|')[:2]]
    for package in re.findall(r'`([\w.]+)`', packages):
      stated[package.removeprefix('qjax.') if package != 'qjax' else package] = set(
          re.findall(r'`([\w.]+)`', imports.split(':')[0]))
  return stated


def test_readme_states_every_layer_and_what_it_imports():
  stated = stated_layers((ROOT / 'README.md').read_text(encoding='utf-8'))
  actual = actual_layers()
  assert sorted(stated) == sorted(actual), (
      f'README.md layers {sorted(stated)}; qjax has {sorted(actual)}')
  wrong = {k: f'README says {sorted(stated[k])}, the code imports {sorted(actual[k])}'
           for k in actual if stated[k] != actual[k]}
  assert not wrong, 'README.md import layers differ from the code:\n' + '\n'.join(
      f'{k}: {v}' for k, v in sorted(wrong.items()))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one node (Tarjan)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def docstring_layers() -> dict[str, set[str]]:
  """What each package's docstring says it imports from qjax, where it says so: a sentence
  with 'imports' and the packages in backticks (`qjax.core`, ...), or 'nothing (else) from
  qjax'."""
  stated = {}
  for init in sorted(QJAX.glob('*/__init__.py')):
    doc = ' '.join((ast.get_docstring(ast.parse(init.read_text(encoding='utf-8'))) or '').split())
    for sentence in re.split(r'(?<=[.;])\s+', doc):
      named = re.findall(r'`qjax\.(\w+)`', sentence.partition(' imports ')[2])
      if re.search(r'\bnothing (?:else )?from qjax\b', sentence):
        stated[init.parent.name] = set()
      elif named:
        stated[init.parent.name] = set(named)
  return stated


def test_package_docstrings_state_what_the_code_imports():
  stated, actual = docstring_layers(), actual_layers()
  assert {'infer', 'kernels', 'costmodel'} <= set(stated), f'parsed only {sorted(stated)}'
  wrong = {k: f'the docstring says {sorted(v)}, the code imports {sorted(actual[k])}'
           for k, v in stated.items() if v != actual[k]}
  assert not wrong, 'package docstrings that misstate their imports:\n' + '\n'.join(
      f'qjax/{k}/__init__.py: {v}' for k, v in sorted(wrong.items()))


def test_no_import_cycle_between_modules():
  # A package's __init__ re-exports its modules, and its modules import its API from it:
  # those edges are re-exports, not layers, so the graph here is between plain modules (the
  # harness's too: a benchmark that imports another inside a function hides a cycle as well).
  modules = _modules(('qjax',) + HARNESS)
  plain = {n for n, p in modules.items() if p.name != '__init__.py'}
  edges = {n: {m for m in _imports(modules[n], n, modules) if m in plain and m != n}
           for n in plain}
  assert sys.getrecursionlimit() > len(plain)
  found = cycles(edges)
  assert not found, ('import cycles (a function-level import hides one too; move the shared '
                     'piece down a level):\n' + '\n'.join(' <-> '.join(c) for c in found))


def test_no_import_cycle_between_packages():
  found = cycles(actual_layers())
  assert not found, 'packages that import each other (directly or through others):\n' + (
      '\n'.join(' <-> '.join(c) for c in found))


def test_target_imports_jax_alone():
  path = QJAX / 'target.py'
  outside = {m.split('.')[0] for m in _imports(path, 'qjax.target', _modules())}
  outside -= set(sys.stdlib_module_names) | {'__future__', 'jax'}
  assert not outside, f'qjax/target.py imports {sorted(outside)} (jax and the stdlib only)'


def test_qjax_never_imports_the_harness():
  modules = _modules()
  hits = [f'{name}: {m}' for name, path in modules.items()
          for m in _imports(path, name, modules) if m.split('.')[0] in HARNESS]
  assert not hits, 'qjax imports the harness:\n' + '\n'.join(hits)


def test_only_the_tests_import_experiments():
  # experiments/ holds thin entry points over qjax.pipeline: nothing else builds on them.
  modules = _modules(('qjax',) + HARNESS)
  hits = [f'{name}: {m}' for name, path in modules.items() if not name.startswith('tests.')
          for m in _imports(path, name, modules)
          if m.split('.')[0] == 'experiments' and not name.startswith('experiments')]
  assert not hits, 'experiments imported outside the tests:\n' + '\n'.join(hits)


def test_the_checks_would_catch_one():
  assert cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
  assert not cycles({'a': {'b'}, 'b': set()})
  table = ('| package | imports from qjax |\n|---|---|\n| `qjax.target` | nothing: jax only |\n'
           '| `core` | `target`, `kernels` |\n| `costmodel`, `data` | nothing |\n')
  assert stated_layers(table) == {'target': set(), 'core': {'target', 'kernels'},
                                  'costmodel': set(), 'data': set()}
  assert _layer('qjax.core.qarray') == 'core' and _layer('qjax.target') == 'target'
  assert _layer('qjax') == 'qjax'
