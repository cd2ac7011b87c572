"""The tables and the plot of `experiments.aot`'s results (the dicts it writes as aot.json):
a text table per target, its markdown page with the run's provenance, one model's summary
across targets, and a figure of the roofline and memory per program and format.
"""

from qjax.aot import programs
from qjax.eval.report import figure, pyplot

PREDICTION = ("the compiler's prediction for a compile-only device: nothing ran, no figure "
              'here is a timing')


# ---------------------------------------------------------------------------- table
COLUMNS = ('program', 'format', 'compiled', 'fits', 'peak/device', 'temp', 'HBM traffic',
           'XLA bytes accessed', 'weights+KV', 'traffic/(W+KV)', 'roofline ms/token',
           'cost model ms/token', 'speedup vs bf16', 'kernels', 'compile s (CPU s)')


def _bytes(n) -> str:
  if n is None:
    return '-'
  for unit, size in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if abs(n) >= size:
      return f'{n / size:.3g} {unit}'
  return f'{n:.0f} B'


def _num(x, fmt='{:.3g}') -> str:
  return '-' if x is None else fmt.format(x)


def _kernels(report: dict) -> str:
  """The kernels called, by name and count where the report has names, else by family."""
  names = report.get('kernel_names') or {}
  return (', '.join(f'{k} x{n}' if n > 1 else k for k, n in names.items()) or
          ', '.join(report['kernels']) or '-')


def cells(row: dict) -> tuple:
  r = row['report']
  held = row['weight_bytes'] + row['kv_bytes']
  fits = '-' if r['fits'] is None else ('yes' if r['fits'] else 'NO')
  return (row['program'], row['format'], 'yes' if r['compiled'] else 'NO (below)', fits,
          _bytes(r['peak_bytes']), _bytes(r['temp_bytes']), _bytes(r.get('hbm_traffic')),
          _bytes(r['bytes_accessed']), _bytes(held or None),
          _num(r['hbm_traffic'] / held if r.get('hbm_traffic') and held else None, '{:.2f}x'),
          _num(row['roofline_ms_per_token']), _num(row['estimate_ms_per_token']),
          _num(row['speedup_vs_bf16'], '{:.2f}x'), _kernels(r),
          f"{_num(r['compile_s'], '{:.1f}')} ({row['compile_cpu_s']:.1f})")


def header(result: dict) -> list:
  """The lines that say what the table is: target, what the figures are, how they were got."""
  plan, t = result['plan'], result['target']
  xla_tpu = 'xla' in t['bytes_source'] and t['chip'].startswith('tpu')
  depth = (f"full depth ({plan['layers_total']} layers)" if not plan['layers'] else
           f"compiled at {plan['layers']} and {2 * plan['layers']} layers; arguments, outputs, "
           f"flops and bytes extrapolated linearly to {plan['layers_total']} layers (per-layer "
           f"figures x the layer count); temp is the {2 * plan['layers']}-layer compile's")
  return [
      f"{result['label']} on {t['name']} ({t['device_kind']}, {t['devices']} device(s), "
      f"{_bytes(t['hbm_per_device'])} HBM per device)",
      f'Every figure is {PREDICTION}.',
      f"Roofline: max(HBM traffic / {t['hbm_bw'] / 1e12:.3g} TB/s, flops / peak) on the "
      f"{t['chip']} datasheet. HBM traffic: each op's HBM reads and writes counted once from "
      "the compiled HLO (qjax.aot.hbm_traffic); XLA bytes accessed: "
      f"{t['bytes_source']}"
      f"{' (it counts a weight prefetched into VMEM several times)' if xla_tpu else ''}. "
      'Cost model: qjax.costmodel.estimate of the same step on one chip.',
      f"Model: {depth}; activations bf16 (int8 in w8a8); decode against {plan['context']} "
      'cached tokens; '
      f"prefill attention here: {result['attention']}.",
  ]


def text_table(result: dict) -> str:
  rows = [COLUMNS] + [cells(r) for r in result['rows']]
  widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
  lines = header(result) + [''] + ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                                   for r in rows]
  return '\n'.join(lines + errors(result))


def errors(result: dict) -> list:
  bad = [r for r in result['rows'] if not r['report']['compiled']]
  return ([''] + ['Refused by the compiler (its message):'] +
          [f"- {r['program']} {r['format']}: {r['report']['error'][:600]}" for r in bad]
          if bad else [])


def markdown(result: dict) -> str:
  plan, t = result['plan'], result['target']
  head = header(result)
  lines = [f"# Ahead-of-time compile: {result['label']} on {t['name']} "
           "(the compiler's prediction)", '', *[f'{x}  ' for x in head], '',
           f"- date: {result['date']}",
           f"- host: {result['host']}",
           f"- jax {result['jax']}; compile-only toolchain: {result['toolchain']}",
           f"- qjax: {result.get('qjax', 'unknown')}",
           f"- command: `{result['command']}`",
           f"- formats: {', '.join(f'{f} ({programs.DESCRIPTIONS[f]})' for f in plan['formats'])}",
           '', '| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
  lines += ['| ' + ' | '.join(c.replace('|', '/') for c in cells(r)) + ' |'
            for r in result['rows']]
  return '\n'.join(lines + errors(result)) + '\n'


def _cell(row: dict) -> str:
  r = row['report']
  if not r['compiled']:
    return 'refused'
  fit = '' if r['fits'] else ', DOES NOT FIT'
  return (f"{_num(row['roofline_ms_per_token'])} ({_num(row['speedup_vs_bf16'], '{:.2f}x')}), "
          f"{_bytes(r['peak_bytes'])}{fit}")


def summary(results: list) -> str:
  """One model's programs and formats across the targets (markdown): roofline ms/token, the
  speedup over bf16 and the peak memory per device."""
  first = results[0]
  names = [r['target']['name'] for r in results]
  by = {(r['target']['name'], row['program'], row['format']): row
        for r in results for row in r['rows']}
  rows = [row for r in results for row in r['rows']]
  progs = list(dict.fromkeys(row['program'] for row in rows))
  fmts = list(dict.fromkeys(row['format'] for row in rows))
  keys = [(p, f) for p in progs for f in fmts]
  lines = [f"{first['label']}: roofline ms/token (speedup over bf16), peak memory per device. "
           f'Every figure is {PREDICTION}.', '',
           '| program | format | ' + ' | '.join(names) + ' |', '|---|---|' + '---|' * len(names)]
  for prog, fmt in keys:
    lines.append(f'| {prog} | {fmt} | ' + ' | '.join(
        _cell(by[(t, prog, fmt)]) if (t, prog, fmt) in by else '-' for t in names) + ' |')
  return '\n'.join(lines) + '\n'


# ---------------------------------------------------------------------------- plot
@figure
def plot(result: dict, path: str) -> None:
  """Roofline ms/token per program and format (the cost model's as markers), and the peak
  memory per device against the HBM."""
  plt = pyplot()
  rows = [r for r in result['rows'] if r['kind'] != 'build']
  progs = list(dict.fromkeys(r['program'] for r in rows))
  fmts = list(dict.fromkeys(r['format'] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
  width = 0.8 / max(len(fmts), 1)
  for j, fmt in enumerate(fmts):
    mine = {r['program']: r for r in rows if r['format'] == fmt}
    xs = [i + (j - (len(fmts) - 1) / 2) * width for i in range(len(progs))]
    get = lambda p, key: (mine[p][key] if p in mine and mine[p][key] else float('nan'))  # noqa
    axes[0].bar(xs, [get(p, 'roofline_ms_per_token') for p in progs], width, label=fmt,
                color=f'C{j}')
    axes[0].scatter(xs, [get(p, 'estimate_ms_per_token') for p in progs], marker='_',
                    color='k', s=120, zorder=3, label='cost model' if j == 0 else None)
    peak = [mine[p]['report']['peak_bytes'] / 1e9 if p in mine and mine[p]['report']['peak_bytes']
            else float('nan') for p in progs]
    axes[1].bar(xs, peak, width, label=fmt, color=f'C{j}')
  axes[1].axhline(result['target']['hbm_per_device'] / 1e9, color='r', ls='--',
                  label='HBM per device')
  for ax, ylabel in ((axes[0], 'roofline ms per token'), (axes[1], 'peak GB per device')):
    ax.set_xticks(range(len(progs)), progs, rotation=15, fontsize=8)
    ax.set(ylabel=ylabel + ' (log)', yscale='log')
    ax.grid(True, axis='y', alpha=0.3)
  axes[0].legend(handles=[axes[0].collections[0]], fontsize=7, loc='lower right')
  axes[1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1.0))
  t = result['target']
  fig.suptitle(f"{result['label']} on a compile-only {t['name']} ({t['device_kind']}): the "
               "compiler's prediction, nothing ran", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
