"""README.md and docs/ hold together: relative links resolve (anchors included), every page
is reachable, results are not copied between pages, and the text speaks of the software."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
# Pages written and kept elsewhere in the tree's ownership; their links are still checked.
PROSE_EXEMPT = ('accelerators.md', 'reliability.md', 'cpu_kernel.md')
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', flags=re.M | re.S)


def _pages() -> list[pathlib.Path]:
  return [ROOT / 'README.md', *sorted(DOCS.rglob('*.md'))]


def _prose(path: pathlib.Path) -> str:
  return FENCE.sub('', path.read_text(encoding='utf-8'))


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to '-'."""
  text = re.sub(r'[`*_]|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip().lower())
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def _anchors(path: pathlib.Path) -> set[str]:
  seen = collections.Counter()
  anchors = set()
  for line in _prose(path).splitlines():
    match = re.match(r'#{1,6} (.*)', line)
    if match:
      slug = github_slug(match.group(1))
      anchors.add(slug if not seen[slug] else f'{slug}-{seen[slug]}')
      seen[slug] += 1
  return anchors


def _links(path: pathlib.Path) -> list[str]:
  return [m.group(1) for m in LINK.finditer(_prose(path))]


def test_relative_links_resolve():
  broken = []
  for page in _pages():
    for link in _links(page):
      if re.match(r'[a-z]+:', link):
        continue  # http(s), mailto: not checked offline
      target, _, anchor = link.partition('#')
      resolved = (page.parent / target).resolve() if target else page
      where = f'{page.relative_to(ROOT)}: ({link})'
      if not resolved.exists():
        broken.append(f'{where}: no file {target}')
      elif anchor and resolved.suffix == '.md' and anchor not in _anchors(resolved):
        broken.append(f'{where}: no heading with anchor #{anchor} in {target or page.name}')
  assert not broken, 'broken links:\n' + '\n'.join(broken)


def test_every_docs_page_is_linked():
  linked = set()
  for page in _pages():
    for link in _links(page):
      target = link.partition('#')[0]
      if target and not re.match(r'[a-z]+:', target):
        linked.add((page.parent / target).resolve())
  orphans = [p.relative_to(ROOT) for p in sorted(DOCS.glob('*.md'))
             if p.resolve() not in linked and p.stat().st_size]
  assert not orphans, f'docs pages no page links to: {orphans}'


def _result_rows(path: pathlib.Path) -> set[str]:
  """Table rows that carry numbers (not separators), normalised."""
  rows = set()
  for line in _prose(path).splitlines():
    if line.startswith('|') and re.search(r'\d', line) and not re.fullmatch(r'[|\-: ]+', line):
      rows.add(' '.join(line.split()))
  return rows


def test_one_copy_of_each_result():
  where = collections.defaultdict(list)
  for page in [ROOT / 'README.md', *sorted(DOCS.glob('*.md'))]:
    for row in _result_rows(page):
      where[row].append(page.relative_to(ROOT).as_posix())
  copies = {row: pages for row, pages in where.items() if len(pages) > 1}
  assert not copies, 'results copied between pages (keep one, link to it):\n' + '\n'.join(
      f'{pages}: {row[:120]}' for row, pages in copies.items())


# The project's text describes qjax and its measurements, not how or by whom they were made.
PROCESS = re.compile('|'.join([
    r'\bissue\s*#?\d+', r'(?<![\w/])#\d{1,3}\b', r'\bsessions?\b', r'\bagents?\b',
    r'\bthe lead\b', r'\bhelpers?\b(?! function)', r'\bthis stop\b', r'\bmine\b',
]), flags=re.I)


def test_text_speaks_of_the_software():
  hits = []
  for page in _pages():
    if page.name in PROSE_EXEMPT:
      continue
    for i, line in enumerate(_prose(page).splitlines(), 1):
      if PROCESS.search(line) and not line.startswith(('    ', '\t')):  # indented: code, logs
        hits.append(f'{page.relative_to(ROOT)}:{i}: {line.strip()[:120]}')
  assert not hits, 'process chatter or issue numbers:\n' + '\n'.join(hits)


def test_the_checks_would_catch_one():
  assert github_slug('QAT + distillation, 200 steps (2026-12-03, idle)') == (
      'qat--distillation-200-steps-2026-12-03-idle')
  assert github_slug("The demo's `RTN` sweep") == 'the-demos-rtn-sweep'
  assert PROCESS.search('the targets of issue 13') and PROCESS.search('rerun in this session')
  assert not PROCESS.search('int4 g128 on 2 cores (#rows: 8)')
