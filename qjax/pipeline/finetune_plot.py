"""The fine-tuning sweep's plot: held-out perplexity per point (quantized base, adapted,
merged + re-quantized) next to what training cost (peak RSS against trainable parameters)."""

from __future__ import annotations

from typing import Sequence

from qjax.eval.report import figure, pyplot, save_figure

# (row key, bar label): the perplexities a row can carry, drawn side by side per point.
PPL_BARS = (('base_ppl', 'quantized base'), ('ppl', 'point (adapted / trained / as is)'),
            ('merged_ppl', 'merged + re-quantized'))


def plotted_values(rows: Sequence[dict]) -> dict:
  """What `plot_finetune` draws, as numbers: {'ppl': {point: {bar label: ppl}},
  'memory': {point: (trainable params, peak RSS MiB)}} over the finished rows (only QLoRA
  and export rows carry a 'base_ppl' beside their own)."""
  ok = [r for r in rows if r.get('status', 'ok') == 'ok' and 'ppl' in r]
  ppl = {r['name']: {label: float(r[k]) for k, label in PPL_BARS if r.get(k) is not None}
         for r in ok}
  memory = {r['name']: (int(r['trainable_params']), float(r['train_peak_rss_mib']))
            for r in ok if r.get('trainable_params') and r.get('train_peak_rss_mib')}
  return {'ppl': ppl, 'memory': memory}


@figure
def plot_finetune(rows: Sequence[dict], path: str, title: str = '') -> dict:
  """Write the sweep's two-panel PNG to `path`.

  Args:
    rows: the sweep's rows ('name', 'kind', 'ppl', and where present 'base_ppl',
      'merged_ppl', 'trainable_params', 'train_peak_rss_mib').
    path: PNG path to write.
    title: the figure's title.

  Returns:
    `plotted_values(rows)`: the numbers drawn.
  """
  plt = pyplot()

  values = plotted_values(rows)
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.45 * max(len(values['ppl']), 4) + 1.5),
                               gridspec_kw={'width_ratios': (3, 2)})
  names = list(values['ppl'])
  width = 0.8 / len(PPL_BARS)
  for i, (_, label) in enumerate(PPL_BARS):
    ys = [j + (i - 1) * width for j, n in enumerate(names) if label in values['ppl'][n]]
    xs = [values['ppl'][n][label] for n in names if label in values['ppl'][n]]
    bars = ax.barh(ys, xs, height=width, label=label)
    ax.bar_label(bars, fmt='%.1f', fontsize=7, padding=2)
  ax.set_yticks(range(len(names)), names, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel('held-out perplexity (lower is better)')
  ax.legend(fontsize=7, loc='best')
  for name, (params, rss) in values['memory'].items():
    bx.scatter(params / 1e6, rss, s=50)
    bx.annotate(name, (params / 1e6, rss), fontsize=7, xytext=(4, 4),
                textcoords='offset points')
  bx.set_xscale('symlog', linthresh=1.0)
  bx.margins(x=0.3, y=0.15)
  bx.set_xlabel('trainable parameters (M)')
  bx.set_ylabel('peak RSS while training (MiB)')
  bx.set_title('training cost', fontsize=9)
  fig.suptitle(title)
  fig.tight_layout()
  save_figure(fig, path)
  return values
