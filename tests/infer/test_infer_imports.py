"""`qjax.infer` is the runtime: its modules import only `qjax.target`, `qjax.core`,
`qjax.kernels`, `qjax.nn`, `qjax.sharding` and `qjax.infer` (harnesses live in
`qjax.pipeline`)."""

import ast
import pathlib

import qjax.infer

ALLOWED = ('qjax.target', 'qjax.core', 'qjax.kernels', 'qjax.nn', 'qjax.sharding', 'qjax.infer')


def _qjax_imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      if node.module == 'qjax':  # `from qjax import sharding`
        names.update(f'qjax.{a.name}' for a in node.names)
      else:
        names.add(node.module)
  return {n for n in names if n == 'qjax' or n.startswith('qjax.')}


def test_infer_imports_only_the_runtime_layers():
  root = pathlib.Path(qjax.infer.__file__).parent
  found = {p.name: _qjax_imports(p) for p in sorted(root.glob('*.py'))}
  assert 'engine.py' in found and 'speculative.py' in found
  bad = {name: sorted(n for n in mods if not n.startswith(ALLOWED))
         for name, mods in found.items()}
  assert not any(bad.values()), {k: v for k, v in bad.items() if v}
