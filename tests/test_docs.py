"""README.md and docs/ hold together: relative links resolve (anchors included), every page
is reachable, results are not copied between pages, each figure the README quotes is in the
section its link names, a docs page's measured tables name their date and command, and every
text file of the repository (no page or folder exempt) speaks of the software, not of how it
was developed."""

import collections
import json
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', flags=re.M | re.S)


def _pages() -> list[pathlib.Path]:
  return [ROOT / 'README.md', *sorted(DOCS.rglob('*.md'))]


def _prose(path: pathlib.Path) -> str:
  return FENCE.sub('', path.read_text(encoding='utf-8'))


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped."""
  text = re.sub(r'[`*]|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip().lower())
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
# Words that only a page's prose could mean that way (code uses 'session' for pytest fixtures
# and 'helper' for helper functions), checked in the prose of README.md and docs/:
PROSE_PROCESS = re.compile('|'.join([
    r'(?<![\w/])#\d{1,3}\b', r'\bsessions?\b', r'\bagents?\b', r'\bhelpers?\b(?! function)',
    r'\bthis stop\b', r'\bmine\b',
]), flags=re.I)
# Phrases that mean the development process wherever they stand: checked in every text file
# of the tree (prose, code, comments, docstrings, scripts).
PROCESS = re.compile('|'.join([
    r'\bissue\s*#?\d+', r'\b(?:the|this) issue\b', r'\bthe lead\b', r'\bleases?\b', r'\blent\b',
    r'\bno network here\b', r'\bnot filed\b', r'\bunder a \d+ s call\b',
    r'(?<![\'"])(?<!test )\bsessions?\b(?![\'"])', r'\bagents?\b',
]), flags=re.I)
# Not the project's own text: third-party corpora and licences, test data, and this file,
# which holds the patterns themselves.
NOT_CHECKED = ('qjax/data/corpora/', 'tests/testdata/', 'tests/test_docs.py', 'LICENSE', 'NOTICE')
NOT_TEXT = {'.png', '.npz', '.safetensors', '.gguf', '.pdf', '.jpg'}
SKIPPED_DIRS = {'.git', '.venv', '.venv312', 'results', '__pycache__', '.pytest_cache',
                '.ruff_cache', '.hypothesis', 'build', 'dist'}


def _tree_files() -> list[pathlib.Path]:
  """Every text file of the repository, no folder or page exempt: what git tracks and the new
  files it does not ignore (outside a checkout, every file below the root but build output)."""
  try:
    listed = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rels = sorted(set(listed.splitlines()))
  except (OSError, subprocess.CalledProcessError):
    rels = sorted(f.relative_to(ROOT).as_posix() for f in ROOT.rglob('*')
                  if f.is_file() and not SKIPPED_DIRS & set(f.relative_to(ROOT).parts))
  files = [ROOT / rel for rel in rels
           if not rel.startswith(NOT_CHECKED) and pathlib.PurePosixPath(rel).suffix not in NOT_TEXT
           and '.egg-info/' not in rel]
  return [f for f in files if f.is_file() and b'\0' not in f.read_bytes()[:8192]]


def _notebook_prose(path: pathlib.Path) -> str:
  """The markdown cells of a notebook: its prose."""
  cells = json.loads(path.read_text(encoding='utf-8'))['cells']
  return '\n\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')


def process_hits(path: pathlib.Path) -> list[str]:
  """Lines of `path` that speak of how the project was developed."""
  hits = []
  text = path.read_text(encoding='utf-8', errors='replace')
  for i, line in enumerate(text.splitlines(), 1):
    if PROCESS.search(line):
      hits.append(f'{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}')
  if path.suffix in ('.md', '.ipynb'):
    prose = _prose(path) if path.suffix == '.md' else _notebook_prose(path)
    for i, line in enumerate(prose.splitlines(), 1):
      if PROSE_PROCESS.search(line) and not line.startswith(('    ', '\t')):  # indented: logs
        hits.append(f'{path.relative_to(ROOT)} (prose line {i}): {line.strip()[:120]}')
  return hits


def test_text_speaks_of_the_software():
  files = _tree_files()
  assert len(files) > 400 and ROOT / 'Makefile' in files, f'{len(files)} files: is the walk broken?'
  hits = [h for f in files for h in process_hits(f)]
  assert not hits, 'text about how the project was developed, not about qjax:\n' + '\n'.join(
      hits)


# A figure: a number with a decimal point, or a percentage (dates are taken out first).
FIGURE = re.compile(r'(?<![\w.])\d+(?:\.\d+)?%|(?<![\w.])\d+\.\d+(?![\w.]*\d)')
# A whole number with a unit the README quotes from a page: '142 MB', '16 rows', '200 steps'.
COUNT = re.compile(r'(?<![\w.,-])(\d{1,3}(?:,\d{3})+|\d+)(?=\s?(?:x\b|MB\b|MiB\b|GB\b|GiB\b|'
                   r'ms\b|s\b|min\b|tokens?\b|tok/s|rows\b|steps\b|requests\b|layers\b|passed\b))')
DATE = re.compile(r'\b20\d\d-\d\d-\d\d\b')


def figures(text: str) -> set[str]:
  """The figures of a text: decimal numbers and percentages, dates and link targets left out."""
  text = re.sub(r'\]\([^)]*\)', ']', DATE.sub(' ', text))
  return set(FIGURE.findall(text))


def counts(text: str) -> set[str]:
  """The whole numbers of a text that carry a unit (thousands separators dropped)."""
  text = re.sub(r'\]\([^)]*\)', ']', DATE.sub(' ', text))
  return {c.replace(',', '') for c in COUNT.findall(text)}


def numbers(text: str) -> set[str]:
  """Every number of a text, as written but for thousands separators."""
  return {n.replace(',', '') for n in re.findall(r'\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?', text)}


def section(path: pathlib.Path, anchor: str) -> str:
  """The text under the heading of `path` whose anchor is `anchor`, down to the next heading
  of its level or above (the whole page for no anchor)."""
  if not anchor:
    return path.read_text(encoding='utf-8')
  seen, level, lines, fenced = collections.Counter(), 0, [], False
  for line in path.read_text(encoding='utf-8').splitlines():
    fenced ^= line.startswith('```')
    match = None if fenced else re.match(r'(#{1,6}) (.*)', line)
    if match:
      if level and len(match.group(1)) <= level:
        break
      slug = github_slug(match.group(2))
      if not level and (slug if not seen[slug] else f'{slug}-{seen[slug]}') == anchor:
        level = len(match.group(1))
      seen[slug] += 1
    if level:
      lines.append(line)
  return '\n'.join(lines)


def _paragraphs(path: pathlib.Path) -> list[str]:
  """The prose of `path` in units that quote one page: paragraphs, list items, table rows."""
  units = re.split(r'\n\s*\n|\n(?=[-*] |\|)', _prose(path))
  return [u for u in units if u.strip()]


def test_readme_figures_are_their_pages_figures():
  # Each README paragraph, list item or table row that links docs pages quotes its figures
  # from them, each from the section its link names (the whole page for a link without an
  # anchor): a decimal or a percentage that section does not hold, or a count with a unit
  # ('142 MB', '16 rows') whose number it does not hold, is a copy that has drifted.
  readme = ROOT / 'README.md'
  checked, wrong = 0, []
  for paragraph in _paragraphs(readme):
    sources = {}
    for link in LINK.findall(paragraph):
      target, _, anchor = link.partition('#')
      path = (readme.parent / target).resolve()
      if target.endswith('.md') and 'docs/' in target and path.exists():
        sources[f'{path.name}#{anchor}' if anchor else path.name] = section(path, anchor)
    if not sources:
      continue
    text = '\n'.join(sources.values())
    missing = ([f for f in sorted(figures(paragraph)) if f not in figures(text)]
               + [c for c in sorted(counts(paragraph)) if c not in numbers(text)])
    checked += len(figures(paragraph)) + len(counts(paragraph))
    wrong += [f'{f} (in: {paragraph.strip()[:70]}...) is not in {sorted(sources)}'
              for f in missing]
  assert checked >= 20, f'only {checked} README figures checked: is the parser broken?'
  assert not wrong, 'README figures the sections they link do not hold:\n' + '\n'.join(wrong)


COMMAND = re.compile(r'python3? -m\s|\bmake [a-z]|\bpytest\b|tests/\S+\.py')


def undated_tables(text: str) -> list[str]:
  """The first rows of the tables of measured numbers in `text` (a figure per row or more)
  whose section (from the heading above) names no date (YYYY-MM-DD) or no command that made
  them."""
  problems, section, table, fenced = [], '', [], False
  for line in text.splitlines() + ['']:
    fenced ^= line.startswith('```')
    if line.lstrip().startswith('|') and not fenced:
      table.append(line)
      continue
    if table:
      body = [r for r in table[2:] if not re.fullmatch(r'[|\-: ]+', r.strip())]
      measured = sum(len(figures(r)) for r in body) >= max(len(body), 1)
      if measured and not (DATE.search(section) and COMMAND.search(section)):
        problems.append(table[0].strip()[:90])
      section += '\n'.join(table) + '\n'
      table = []
    if re.match(r'#{1,6} ', line) and not fenced:  # a heading, not a shell comment
      section = ''
    section += line + '\n'
  return problems


def test_measured_tables_name_their_date_and_command():
  problems = [f'{page.name}: {row}' for page in sorted(DOCS.glob('*.md'))
              for row in undated_tables(page.read_text(encoding='utf-8'))]
  assert not problems, ('measured tables without a date and the command that made them '
                        '(in their section):\n' + '\n'.join(problems))


MAX_PAGE_LINES = 300  # a reference page; history lives in git


def test_docs_pages_are_reference_sized():
  long = {p.name: n for p in sorted(DOCS.glob('*.md'))
          if (n := len(p.read_text(encoding='utf-8').splitlines())) > MAX_PAGE_LINES}
  assert not long, f'docs pages over {MAX_PAGE_LINES} lines (move history to git): {long}'


def test_the_checks_would_catch_one(tmp_path):
  assert github_slug('QAT + distillation, 200 steps (2026-12-03, idle)') == (
      'qat--distillation-200-steps-2026-12-03-idle')
  assert github_slug("The demo's `RTN` sweep") == 'the-demos-rtn-sweep'
  assert PROCESS.search('the targets of issue 13') and PROSE_PROCESS.search('in this session')
  assert PROCESS.search('stopped by the lease') and PROCESS.search("The issue's protocol")
  assert PROCESS.search('on a lent accelerator') and PROCESS.search('not filed: no network here')
  assert not PROCESS.search("@pytest.fixture(scope='session')")
  assert not PROCESS.search('what the test session compiles') and not PROCESS.search('released')
  assert not PROSE_PROCESS.search('int4 g128 on 2 cores (#rows: 8)')
  assert figures('2.28x at 16 rows (2026-12-03; 1.69x), 4.8-5.4x, 83.5% [a](b-1.5.md)') == {
      '2.28', '1.69', '4.8', '5.4', '83.5%'}
  assert counts('142 MB, at 16 rows, 1,072 tokens, a 2-core CPU, 4.0x, g128') == {
      '142', '16', '1072'}
  doc = tmp_path / 'a.md'
  doc.write_text('# A\n1.5\n## B b\n2.5\n```\n# a comment\n```\n### C\n3.5\n## D\n4.5\n')
  assert figures(section(doc, 'b-b')) == {'2.5', '3.5'} and figures(section(doc, '')) == {
      '1.5', '2.5', '3.5', '4.5'}
  page = ('# A\n\nno date here\n\n| undated | b |\n|---|---|\n| x | 1.5 |\n\n'
          '# B\n\n2026-12-01, `python -m benchmarks.x`:\n\n| dated | b |\n|---|---|\n'
          '| x | 1.5 |\n\n| same section | b |\n|---|---|\n| x | 2.5 |\n\n'
          '# C\n\n| no figures | kind |\n|---|---|\n| x | y |\n| CC BY-SA 3.0 | z |\n\n'
          '# D\n\n2026-12-01\n\n```\npython -m x\n# a comment\n```\n\n| d | e |\n|---|---|\n'
          '| x | 1.5 |\n')
  assert undated_tables(page) == ['| undated | b |']
