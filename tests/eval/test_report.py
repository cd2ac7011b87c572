"""qjax.eval.report: the results table, the perplexity-vs-bytes plot and the figure helpers
every plot in qjax writes through (a folder that does not exist yet is made; the figure is
closed, so a long sweep does not accumulate open figures)."""

import pathlib

import pytest

from qjax.eval import report
from qjax.pipeline import serving

PNG = b'\x89PNG\r\n\x1a\n'


def test_markdown_table_keeps_present_columns_formats_floats_and_escapes_pipes():
  rows = [{'name': 'rtn-int4', 'weight_format': 'int4 g128', 'ppl': 31.234567, 'status': 'ok'},
          {'name': 'gptq-int4', 'ppl': None, 'status': 'failed'}]
  assert report.markdown_table(rows) == '\n'.join([
      '| point | format | val ppl | status |',
      '|---|---|---|---|',
      '| rtn-int4 | int4 g128 | 31.23 | ok |',
      '| gptq-int4 |  |  | failed |'])
  header = report.markdown_table([{'max_abs_logit_diff': 0.5}]).splitlines()[0]
  assert header == r'| max \|Δlogit\| |'


@pytest.mark.plots
def test_plot_ppl_vs_bytes_writes_a_png_into_a_new_folder_and_closes_it(tmp_path):
  plt = report.pyplot()
  before = set(plt.get_fignums())
  rows = [{'method': m, 'weight_format': f, 'ppl': p, 'weight_bytes': b, 'status': 'ok'}
          for m, f, p, b in (('rtn', 'int4', 40.0, 2e6), ('gptq', 'int4', 35.0, 2e6),
                             ('rtn', 'int8', 31.0, 4e6))]
  rows.append({'method': 'awq', 'weight_format': 'int3', 'status': 'failed'})  # not drawn
  path = tmp_path / 'new' / 'deeper' / 'ppl.png'
  out = report.plot_ppl_vs_bytes(rows, str(path), 'title', baseline={'ppl': 30.0,
                                                                     'weight_bytes': 8e6})
  assert out == str(path) and path.read_bytes()[:8] == PNG
  assert set(plt.get_fignums()) == before


@pytest.mark.plots
def test_save_figure_writes_at_the_asked_resolution(tmp_path):
  plt = report.pyplot()
  fig, _ = plt.subplots(figsize=(2, 1))
  small = report.save_figure(fig, str(tmp_path / 'a' / 'small.png'), dpi=50)
  fig, _ = plt.subplots(figsize=(2, 1))
  big = report.save_figure(fig, str(tmp_path / 'b' / 'big.png'), dpi=100)
  width = lambda p: int.from_bytes(pathlib.Path(p).read_bytes()[16:20], 'big')  # IHDR width
  assert (width(small), width(big)) == (100, 200)


@pytest.mark.plots
def test_serving_plot_makes_its_folder(tmp_path):
  """serving.plot once wrote straight to `path` and failed when its folder was missing."""
  rows = [{'variant': v, 'tokens_per_s': t, 'ttft_p50': 0.1, 'itl_p50': 0.02,
           'cache_mib': 12.0, 'fits': 4} for v, t in (('float', 10.0), ('int8', 14.0))]
  path = tmp_path / 'serve' / 'plot.png'
  assert serving.plot(rows, str(path), 'title') == str(path)
  assert path.read_bytes()[:8] == PNG
