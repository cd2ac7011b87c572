"""The README's dimension glossary gives each letter one meaning, and the serving, attention,
matmul-kernel and calibration code names shapes only with letters it lists (einsum strings and
`x_BTD`-style suffixes)."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The quantized matmul kernels: a matmul is x_MD @ w_DF -> y_MF with Q groups of scales.
MATMUL = [ROOT / 'qjax' / 'kernels' / f'{m}.py' for m in (
    '__init__', 'pallas_qmm', 'tpu_qmm', 'gpu_qmm_head')]
# Modules whose shape letters must all come from the glossary.
CHECKED = (sorted((ROOT / 'qjax' / 'infer').glob('*.py'))
           + [ROOT / 'qjax' / 'nn' / f'{m}.py' for m in (
               'attention', 'attention_core', 'attention_forms', 'decode_core', 'kvcache',
               'generate')]
           + [ROOT / 'qjax' / 'kernels' / f'{m}.py' for m in (
               'paged_attention', 'ragged_paged', 'splash', 'tpu_gather')]
           + MATMUL + [ROOT / 'qjax' / 'aot' / '_programs_serving.py',
                       ROOT / 'qjax' / 'algorithms' / 'awq_core.py']
           + sorted((ROOT / 'qjax' / 'eval').glob('validation*.py')))
# Modules whose lowercase einsums are index notation, not shape letters (awq_core's per-group
# quadratic form 'ngf,ngh,nhf->nf' needs two indices within one group).
INDEX_NOTATION = {ROOT / 'qjax' / 'algorithms' / 'awq_core.py'}
SUFFIX = re.compile(r'\b[a-z][a-z0-9_]*?_([A-Z0-9]*[A-Z][A-Z0-9]*)\b')
EINSUM = re.compile(r"'([A-Za-z]+(?:,[A-Za-z]+)+->[A-Za-z]+)'")


def glossary() -> list[tuple[str, str]]:
  """(letter, meaning) pairs of the README's glossary table, in table order."""
  text = (ROOT / 'README.md').read_text(encoding='utf-8')
  start = text.index('**Dimension glossary**')
  section = text[start:text.index('\n## ', start)]
  pairs = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if not line.startswith('|') or set(''.join(cells)) <= set('-: ') or cells[0] == 'letter':
      continue
    pairs += [(k, n) for k, n in zip(cells[0::2], cells[1::2]) if k or n]  # a row's empty half
  return pairs


def test_glossary_lists_each_letter_once_with_a_meaning():
  pairs = glossary()
  assert len(pairs) >= 20, f'glossary table not found or cut short: {pairs}'
  bad = [p for p in pairs if not re.fullmatch(r'[A-Z]', p[0]) or not p[1]]
  assert not bad, f'glossary cells that are not one capital letter with a meaning: {bad}'
  twice = [k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1]
  assert not twice, f'letters the glossary lists more than once: {twice}'


def test_serving_and_attention_code_uses_glossary_letters():
  letters = {k for k, _ in glossary()}
  unknown = []
  for path in CHECKED:
    text = path.read_text(encoding='utf-8')
    used = {m.group(0): m.group(1) for m in SUFFIX.finditer(text)}
    used.update({m.group(1): m.group(1).replace(',', '').replace('->', '')
                 for m in EINSUM.finditer(text)
                 if not (path in INDEX_NOTATION and m.group(1).islower())})
    for name, dims in sorted(used.items()):
      missing = set(re.sub(r'[0-9]', '', dims)) - letters
      if missing:
        unknown.append(f'{path.relative_to(ROOT)}: {name} ({"".join(sorted(missing))})')
  assert not unknown, 'shape letters missing from the README glossary:\n' + '\n'.join(unknown)


def test_matmul_kernels_name_no_gemm_letters():
  # K, N and G are attention's letters (KV heads, query heads, query heads per KV head): a
  # matmul's contracted dim is D, its output F and its group count Q, in suffixes and prose.
  found = []
  for path in MATMUL:
    for i, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
      suffixes = ''.join(m.group(1) for m in SUFFIX.finditer(line))
      if re.search(r'\b[GKN]\b', line) or set(suffixes) - set('MDFQ'):
        found.append(f'{path.relative_to(ROOT)}:{i}: {line.strip()}')
  assert not found, 'GEMM letters in the matmul kernels (use M, D, F, Q):\n' + '\n'.join(found)
