"""Results as a Markdown table and a perplexity-vs-bytes plot."""

from __future__ import annotations

import functools
import os
from typing import Sequence
import warnings

COLUMNS = (('name', 'point'), ('method', 'method'), ('weight_format', 'format'),
           ('ppl', 'val ppl'), ('ppl_delta', 'Δ ppl'), ('max_abs_logit_diff', 'max |Δlogit|'),
           ('mean_abs_logit_diff', 'mean |Δlogit|'), ('kl', 'KL'),
           ('greedy_agreement', 'greedy agree'), ('int8_fraction', 'int8 frac'),
           ('weight_bytes', 'weight bytes'), ('bytes_ratio', 'bytes/float'),
           ('quantized_bytes_ratio', 'quantized layers bytes/float'),
           ('quantize_seconds', 'quant s'), ('warm_seconds', 'quant s (warm)'),
           ('seconds', 'time s'), ('status', 'status'))


class PlotsUnavailable(ImportError):
  """matplotlib, qjax's optional 'plots' extra, is not installed."""


def pyplot():
  """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use.

  matplotlib is the optional 'plots' extra: without it this raises `PlotsUnavailable`, which
  says how to install it (tables and JSON never need it)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise PlotsUnavailable("plotting needs matplotlib, qjax's optional 'plots' extra: "
                           "pip install 'qjax[plots]' (or pip install matplotlib)") from e
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def figure(plot_fn):
  """Decorates a function that writes a figure: without matplotlib it warns, naming the
  extra, and returns None instead of raising, so that a run's tables, JSON and records never
  depend on its figures."""
  @functools.wraps(plot_fn)
  def wrapped(*args, **kwargs):
    try:
      return plot_fn(*args, **kwargs)
    except PlotsUnavailable as e:
      warnings.warn(f'{plot_fn.__name__}: figure not written: {e}', stacklevel=2)
      return None
  return wrapped


def save_figure(fig, path: str, dpi: int = 110) -> str:
  """Write `fig` to `path` (making its folder) and close it; returns `path`."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
  return path


def _fmt(v):
  if isinstance(v, float):
    return f'{v:.4g}'
  return '' if v is None else str(v)


def markdown_table(rows: Sequence[dict], columns=COLUMNS) -> str:
  """A Markdown table of result rows; columns missing from every row are left out."""
  cols = [(k, h) for k, h in columns if any(k in r for r in rows)]
  # A pipe inside a cell would split the column: escape it.
  lines = ['| ' + ' | '.join(h.replace('|', r'\|') for _, h in cols) + ' |',
           '|' + '|'.join('---' for _ in cols) + '|']
  for r in rows:
    lines.append('| ' + ' | '.join(_fmt(r.get(k)) for k, _ in cols) + ' |')
  return '\n'.join(lines)


@figure
def plot_ppl_vs_bytes(rows: Sequence[dict], path: str, title: str = '',
                      baseline: dict | None = None, x_key: str = 'weight_bytes',
                      x_label: str = 'weight bytes (MB, as stored on the device)',
                      log_y: bool = False) -> str:
  """Perplexity vs weight bytes, one marker per weight format, one colour per method.

  Args:
    rows: results with 'ppl', `x_key`, 'weight_format' and optionally 'method'.
    path: PNG path to write.
    title: plot title.
    baseline: optional {'ppl': .., x_key: ..} of the float model (drawn as a star).
    x_key: the row field on the x axis, in bytes (plotted in MB).
    x_label: its axis label.
    log_y: a logarithmic perplexity axis (for sweeps whose worst points explode).

  Returns:
    The path written.
  """
  plt = pyplot()

  ok = [r for r in rows if r.get('status', 'ok') == 'ok' and 'ppl' in r]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  markers = 'osD^v<>phX*P'
  fmts = sorted({r['weight_format'] for r in ok})
  methods = sorted({r.get('method', '') for r in ok})
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for mi, m in enumerate(methods):
    pts = sorted((r for r in ok if r.get('method', '') == m), key=lambda r: r[x_key])
    ax.plot([r[x_key] / 1e6 for r in pts], [r['ppl'] for r in pts], '-',
            color=colors[mi % len(colors)], alpha=0.35)
    for r in pts:
      ax.scatter(r[x_key] / 1e6, r['ppl'], color=colors[mi % len(colors)],
                 marker=markers[fmts.index(r['weight_format']) % len(markers)], s=50,
                 label=f"{m} {r['weight_format']}".strip())
  if baseline:
    ax.scatter(baseline[x_key] / 1e6, baseline['ppl'], marker='*', s=180,
               color='black', label='float')
  if log_y:
    ax.set_yscale('log')
  ax.set_xlabel(x_label)
  ax.set_ylabel('validation perplexity')
  ax.set_title(title)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  save_figure(fig, path)
  return path
