"""docs/aot.md shows the compile check's table for Gemma 3 270M, Llama-3.2-1B and Llama-3-8B on
v5e-1, v6e-1 and H200, each with the command that made it (a command that still parses: its
model a preset of experiments/aot.py) and its date, and says which figures are compiler
predictions and which were timed."""

import pathlib
import re

from experiments import aot as aot_command
from qjax.aot import TARGETS, programs

DOC = pathlib.Path(__file__).resolve().parents[2] / 'docs' / 'aot.md'
MODELS = {'Gemma 3 270M': 'gemma3_270m', 'Llama-3.2-1B': 'llama32_1b', 'Llama-3-8B': 'llama3_8b'}
COLUMNS = ('v5e-1', 'v6e-1', 'h200')
PROGRAMS = ('prefill T=512 B=1', 'decode B=1', 'decode B=8')


def _tables() -> dict:
  """{model label: (its bold heading line, its table's lines)} of the predictions section."""
  lines = DOC.read_text().splitlines()
  out = {}
  for i, line in enumerate(lines):
    label = next((m for m in MODELS if line.startswith(f'**{m}')), None)
    if label is None:
      continue
    start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('|'))
    end = next((j for j in range(start, len(lines)) if not lines[j].startswith('|')),
               len(lines))
    out[label] = (line, lines[start:end])
  return out


def test_each_model_has_its_table_on_the_three_targets_with_command_and_date():
  tables = _tables()
  assert set(tables) == set(MODELS), sorted(tables)
  for label, (heading, table) in tables.items():
    assert re.search(r'\d{4}-\d{2}-\d{2}', heading), heading
    [command] = re.findall(r'`(JAX_PLATFORMS=cpu python -m experiments\.aot [^`]*)`', heading)
    assert '--config=configs/aot.py' in command
    model = re.search(r'--config\.model=(\S+)', command)
    assert (model.group(1) if model else 'gemma3_270m') == MODELS[label], command
    assert model is None or model.group(1) in aot_command.PRESETS
    assert set(COLUMNS) <= set(TARGETS)
    assert table[0] == '| program | format | ' + ' | '.join(COLUMNS) + ' |', table[0]
    cells = {tuple(c.strip() for c in row.strip('|').split('|')[:2]): row
             for row in table[2:]}
    assert set(cells) == {(p, f) for p in PROGRAMS for f in programs.FORMATS}, label
    for row in cells.values():
      figures = [c.strip() for c in row.strip('|').split('|')[2:]]
      assert len(figures) == 3 and all(re.match(r'[\d.e-]+ \(\d+\.\d\dx\), ', c)
                                       for c in figures), row


def test_the_page_says_which_figures_are_predictions_and_which_were_timed():
  text = ' '.join(DOC.read_text().split())
  assert "Every figure on this page is a compiler's prediction for a compile-only device." in text
  assert 'none is a timing' in text
  assert 'The only timed figures quoted here are the H200' in text
  assert '## Predicted beside measured' in text
