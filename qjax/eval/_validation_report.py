"""Validation reports as Markdown (one conversion, or several side by side) and plots."""

from __future__ import annotations

from typing import Sequence

from qjax.eval.report import figure, pyplot, save_figure


def _f(v, p=4):
  if isinstance(v, float):
    return f'{v:.{p}g}'
  return '' if v is None else str(v)


def _mb(b):
  return f'{b / 1e6:.4g} MB'


def _ci(lo_hi):
  return f'[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]'


def markdown(report: dict) -> str:
  """One conversion's report as Markdown."""
  r = report
  lines = [f"# Validation: {r['name']}", '']
  if 'base_verified' in r:
    lines += [f"Base checkpoint: {r['base_verified']}.", '']
  lg = r['logits']
  lines += ['## Fixed-prompt logits', '',
            '| max abs Δ | mean abs Δ | KL (nats) | top-1 agreement | tokens |',
            '|---|---|---|---|---|',
            f"| {_f(lg['max_abs_logit_diff'])} | {_f(lg['mean_abs_logit_diff'])} | "
            f"{_f(lg['kl'])} | {_f(lg['top1_agreement'])} | {lg['tokens']} |", '']
  g = r['greedy']
  per = ' '.join(f'{x:.2f}' for x in g['per_position'])
  lines += ['## Greedy agreement', '',
            f"{g['prompts']} prompts x {g['tokens']} tokens: agreement {g['agreement']:.3f}, "
            f"matched prefix {g['prefix_mean']:.1f} tokens (per prompt {g['prefix']}).", '',
            f'Per position: {per}', '']
  if r.get('perplexity'):
    lines += ['## Perplexity', '', '| corpus | float | quantized | Δ | tokens |',
              '|---|---|---|---|---|']
    for k, v in r['perplexity'].items():
      lines.append(f"| {k} | {_f(v['float'])} | {_f(v['quant'])} | {v['delta']:+.4g} | "
                   f"{v['tokens']} |")
    lines.append('')
  if r.get('tasks'):
    lines += ['## Tasks (accuracy, 95% intervals)', '',
              '| task | float | quantized | Δ (paired) | Δ 95% CI | items | chance |',
              '|---|---|---|---|---|---|---|']
    for k, v in r['tasks'].items():
      lines.append(f"| {k} | {v['float']:.3f} | {v['quant']:.3f} | {v['delta']:+.3f} | "
                   f"{_ci(v['delta_ci'])} | {v['n']} | {v['chance']:.2f} |")
    lines += [''] + [f"- {k}: {v['description']}" for k, v in r['tasks'].items()] + ['']
  if 'memory' in r:
    m = r['memory']
    w = m['workload']
    me = m['measured']
    lines += ['## Memory', '',
              f"Workload: batch {w['batch']}, context {w['context']}, prefill {w['prompt']} "
              'tokens. Predicted from the config and policy (`qjax.eval.memory`); measured '
              "from the device buffers and XLA's compiled memory analysis.", '',
              '| quantity | predicted | measured | predicted / measured |', '|---|---|---|---|']
    p = m.get('predicted')
    def row(label, pv, mv):
      ratio = '' if pv is None or not mv else f'{pv / mv:.4f}'
      lines.append(f"| {label} | {'' if pv is None else _mb(pv)} | {_mb(mv)} | {ratio} |")
    pw = p['weights'] if p else {}
    row('weights: codes + scales + zero points', None if not p else
        pw['codes'] + pw['scales'] + pw['zero_points'], me['weights']['quantized'])
    if p:
      lines.append(f"| (codes / scales / zero points) | {_mb(pw['codes'])} / {_mb(pw['scales'])}"
                   f" / {_mb(pw['zero_points'])} | | |")
    row('weights: float leftovers', pw.get('float'), me['weights']['float'])
    row('weights: total', pw.get('total'), me['weights']['total'])
    row('KV cache', p['kv'] if p else None, me['kv'])
    row('prefill step temp (activations)', p['prefill_activations'] if p else None,
        me['prefill']['temp'])
    row('decode step temp (activations)', p['decode_activations'] if p else None,
        me['decode']['temp'])
    lines += ['', f"Float model weights: {_mb(m['float_weights']['total'])}; quantized / float "
                  f"= {me['weights']['total'] / m['float_weights']['total']:.3f}. "
                  + (f"Peak device memory of the process so far: {_mb(me['device']['peak'])} "
                     f"(host RSS {_mb(me['peak_rss'])})." if me.get('device') else
                     f"Peak RSS of the process so far: {_mb(me['peak_rss'])}."), '']
  if 'latency' in r:
    lt = r['latency']
    lines += ['## Latency', '', f"{lt['note']}.", '',
              '| batch | prefill tok/s float | quantized | ratio | decode ms/token float | '
              'quantized | ratio |', '|---|---|---|---|---|---|---|']
    for b, fv in lt['float'].items():
      qv = lt['quant'][b]
      lines.append(f"| {b[1:]} | {fv['prefill_tok_s']:.4g} | {qv['prefill_tok_s']:.4g} | "
                   f"{qv['prefill_tok_s'] / fv['prefill_tok_s']:.2f} | "
                   f"{fv['decode_ms_per_token']:.4g} | {qv['decode_ms_per_token']:.4g} | "
                   f"{qv['decode_ms_per_token'] / fv['decode_ms_per_token']:.2f} |")
    lines.append('')
  if 'context_limit' in r:
    lines += ['## Context limit', '', 'The longest decode context whose step fits the budget: '
              'predicted by the planner (the estimate; and, where given, XLA\'s memory analysis '
              'of the step compiled from shapes alone), then this model\'s step compiled at the '
              'prediction and run once.', '',
              '| model | budget | batch | estimate | predicted (planner) | predicted bytes | '
              'compiled bytes there | error | run: peak RSS above start | fits (measured) |',
              '|---|---|---|---|---|---|---|---|---|---|']
    for k in ('float', 'quant'):
      c = r['context_limit'][k]
      cells = [k, _mb(c['budget_bytes']), c['batch'], c.get('estimate_max_context', ''),
               f"{c['predicted_max_context']} ({c.get('planner', 'estimate')}; cap "
               f"{c['capped_at']})",
               _mb(c['predicted_bytes']) if 'predicted_bytes' in c else '',
               _mb(c['compiled_bytes']) if 'compiled_bytes' in c else '',
               f"{c['prediction_error']:+.2%}" if 'prediction_error' in c else '',
               _mb(c['run_peak_rss_above_start']) if 'run_peak_rss_above_start' in c else
               (f"device peak {_mb(c['run_device_peak'])}" if 'run_device_peak' in c else ''),
               c.get('confirmed')]
      lines.append('| ' + ' | '.join(str(x) for x in cells) + ' |')
    lines.append('')
  if 'ppl_by_position' in r:
    pp = r['ppl_by_position']
    lines += ['## Perplexity by position', '', f"One window of {pp['tokens']} tokens.", '',
              '| positions | float | quantized |', '|---|---|---|']
    for f, q in zip(pp['float'], pp['quant']):
      lines.append(f"| {f['lo']}-{f['hi']} | {f['ppl']:.4g} | {q['ppl']:.4g} |")
    lines.append('')
  if 'fallback' in r and 'trigger_rate' in r['fallback']:
    tr = r['fallback']['trigger_rate']
    lines += ['## Fallback trigger rate', '',
              '| layers fell back | share of layers | of parameters | of bytes |',
              '|---|---|---|---|',
              f"| {len(tr.get('fell_back', []))} | {tr['layers']:.1%} | {tr['params']:.1%} | "
              f"{tr['bytes']:.1%} |", '']
  if 'llm_int8_trigger' in r:
    lines += _llm_int8_lines(r['llm_int8_trigger'])
  for key in ('fallback', 'mixed_precision', 'llm_int8'):
    if key in r:
      lines += [f'## {key}', '', '```', _short(r[key]), '```', '']
  formats = {}
  for path, v in r['what_ran'].items():
    formats.setdefault((v['weight'], v['act']), []).append(path)
  lines += ['## What ran', '', f"KV cache: {r['kv_cache']}.", '',
            '| weight format | activations | layers |',
            '|---|---|---|']
  for (wf, af), paths in sorted(formats.items()):
    shown = ', '.join(paths[:4]) + (f' (+{len(paths) - 4})' if len(paths) > 4 else '')
    lines.append(f'| {wf} | {af} | {shown} |')
  runs = {}
  for path, v in r['what_ran'].items():
    if 'runs' in v:
      key = (v['runs']['decode']['path'], v['runs']['prefill']['path'],
             v['runs']['decode']['reason'])
      runs.setdefault(key, []).append(path)
  if runs:
    lines += ['', '| decode path | prefill path | layers | why (decode) |', '|---|---|---|---|']
    for (dp, pp, why), paths in sorted(runs.items()):
      shown = ', '.join(paths[:4]) + (f' (+{len(paths) - 4})' if len(paths) > 4 else '')
      lines.append(f'| {dp} | {pp} | {shown} | {why} |')
  return '\n'.join(lines)


def _llm_int8_lines(t: dict) -> list[str]:
  """LLM.int8()'s dynamic fallback: per layer, features (columns) and tokens in float."""
  lines = ['## LLM.int8() dynamic trigger rate', '',
           f"Measured on {t['measured_on']}: {t['features']:.3%} of the decomposed layers' "
           f"multiply-adds ran in float (outlier feature columns); on average "
           f"{t['tokens']:.2%} of a layer's tokens held an entry above the threshold.", '',
           '| layer | threshold | features in float | tokens that triggered | entries above |',
           '|---|---|---|---|---|']
  for p, v in t['layers'].items():
    lines.append(f"| {p} | {v['threshold']:g} | {v['features']:.3%} of {v['features_count']} | "
                 f"{v['tokens']:.2%} | {v['entries']:.4%} |")
  return lines + ['']


def _short(d) -> str:
  import json  # pylint: disable=g-import-not-at-top
  d = {k: v for k, v in d.items() if k not in ('assignment', 'policy', 'trajectory')} \
      if isinstance(d, dict) else d
  return json.dumps(d, indent=1, default=str)[:3000]


def compare_markdown(reports: Sequence[dict]) -> str:
  """Several conversions' headline numbers side by side."""
  rows = [('conversion', lambda r: r['name']),
          ('KL', lambda r: _f(r['logits']['kl'])),
          ('top-1 agree', lambda r: _f(r['logits']['top1_agreement'])),
          ('greedy agree', lambda r: _f(r['greedy']['agreement'])),
          ('greedy prefix', lambda r: _f(r['greedy']['prefix_mean']))]
  first = reports[0]
  for k in first.get('perplexity', {}):
    rows.append((f'ppl {k}', lambda r, k=k: f"{r['perplexity'][k]['quant']:.4g}"))
  for k in first.get('tasks', {}):
    rows.append((f'{k} acc (Δ)', lambda r, k=k: f"{r['tasks'][k]['quant']:.3f} "
                                                f"({r['tasks'][k]['delta']:+.3f})"))
  if 'memory' in first:
    rows.append(('weights MB',
                 lambda r: f"{r['memory']['measured']['weights']['total'] / 1e6:.4g}"))
  if 'latency' in first:
    rows.append(('decode ms/tok b1 (float)', lambda r: (
        f"{r['latency']['quant']['b1']['decode_ms_per_token']:.3g} "
        f"({r['latency']['float']['b1']['decode_ms_per_token']:.3g})")))
  lines = ['| ' + ' | '.join(name for name, _ in rows) + ' |', '|' + '---|' * len(rows)]
  for r in reports:
    lines.append('| ' + ' | '.join(fn(r) for _, fn in rows) + ' |')
  if first.get('perplexity'):
    k = next(iter(first['perplexity']))
    lines.append(f"\nfloat ppl {k}: {first['perplexity'][k]['float']:.4g}")
  return '\n'.join(lines)


@figure
def plot(reports: Sequence[dict], path: str) -> str:
  """Greedy agreement per position, perplexity by position bucket and task accuracy."""
  plt = pyplot()

  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for r in reports:
    axes[0].plot(range(1, len(r['greedy']['per_position']) + 1), r['greedy']['per_position'],
                 marker='o', ms=3, label=r['name'])
    if 'ppl_by_position' in r:
      pp = r['ppl_by_position']
      axes[1].plot([b['hi'] for b in pp['quant']], [b['ppl'] for b in pp['quant']], marker='o',
                   label=r['name'])
  if 'ppl_by_position' in reports[0]:
    pp = reports[0]['ppl_by_position']
    axes[1].plot([b['hi'] for b in pp['float']], [b['ppl'] for b in pp['float']], 'k--',
                 label='float')
    axes[1].set_xscale('log')
  axes[0].set(xlabel='generated position', ylabel='greedy agreement with float', ylim=(0, 1.05),
              title='greedy agreement')
  axes[1].set(xlabel='position bucket end (tokens)', ylabel='perplexity',
              title='perplexity by position')
  names = list(reports[0].get('tasks', {}))
  width = 0.8 / (len(reports) + 1)
  for j, r in enumerate([None] + list(reports)):
    xs, ys, err = [], [], []
    for i, t in enumerate(names):
      v = reports[0]['tasks'][t] if r is None else r['tasks'][t]
      acc, ci = (v['float'], v['float_ci']) if r is None else (v['quant'], v['quant_ci'])
      xs.append(i + j * width)
      ys.append(acc)
      err.append(max(acc - ci[0], 0))
    if names:
      axes[2].bar(xs, ys, width, yerr=err, label='float' if r is None else r['name'])
  axes[2].set_xticks([i + 0.4 for i in range(len(names))], names)
  axes[2].set(ylabel='accuracy (95% CI)', title='tasks')
  for ax in axes:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a panel with nothing measured has no legend
      ax.legend(fontsize=7)
  fig.tight_layout()
  save_figure(fig, path, dpi=100)
  return path
