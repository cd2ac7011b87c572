"""The device check's page: a result (or several runs merged) as markdown tables and a plot.

One table per model (the format rows), the serving engine's rows, every timed program beside
the compiler's prediction for it (`pairs`), and the attention section; `render` writes
device_check.md and device_check.png.
"""

from __future__ import annotations

import os

import numpy as np

from benchmarks import attention_timing, predicted
from qjax.eval import report


def pairs(row: dict) -> list[dict]:
  """Each program `row` timed, its measured ms beside the compiler's prediction for it."""
  pred = row.get('predicted', {})
  if 'engine' in row:
    n = row['rows']
    timed = [(f"engine b{n}, decode block of {row['decode_block']}", 'engine_block',
              row['engine']['ms_per_step']),
             (f'bare decode_steps loop b{n}', f'loop_b{n}', row['bare_loop']['ms_per_step'])]
  else:
    timed = [(f"prefill {row.get('prefill_tokens')}", 'prefill', row.get('prefill_ms'))]
    batches = sorted(int(k[1:]) for k in row if k[0] == 'b' and k[1:].isdigit())
    timed += [(f'host loop b{b} (greedy_step)', f'step_b{b}', row[f'b{b}'].get('host_loop_ms'))
              for b in batches]
    timed += [(f'device loop b{b} (decode_steps)', f'loop_b{b}',
               row[f'b{b}'].get('device_loop_ms')) for b in batches]
  out = []
  for label, key, ms in timed:
    if ms is None or key not in pred:
      continue
    p = pred[key]
    out.append({'program': label, 'measured_ms': ms, 'predicted_ms': p['roofline_ms'],
                'measured_over_predicted': predicted.ratio(ms, p), 'chip': p['chip'],
                'bytes_accessed': p['bytes_accessed'], 'flops': p['flops'],
                'temp_bytes': p['temp_bytes']})
  return out


def _mb(x) -> str:
  if x is None:
    return ''
  return f'{x / 2**20:,.0f}' if x >= 10 * 2**20 else f'{x / 2**20:.2f}'


def _g(x, scale: float = 1.0) -> str:
  """'-' for None, else three significant digits (whole numbers from 100 on)."""
  if x is None:
    return '-'
  return f'{x / scale:,.0f}' if abs(x / scale) >= 100 else f'{x / scale:.3g}'


def _ratio(x) -> str:
  return '-' if x is None else f'{x:.2f}'


def _predicted_table(rows: list) -> list[str]:
  """Measured ms beside the compiler's prediction, one line per timed program."""
  lines = ['| row | program | measured ms | predicted ms (roofline, compiler) | measured / '
           'predicted | MiB accessed (compiler) | GFLOP (compiler) | temp MiB (compiler) |',
           '|---|---|---|---|---|---|---|---|']
  for r in rows:
    name = f"{r['model']} " + (f"engine {r['format']} (KV {r['kv']})" if 'engine' in r else
                                r['format'] + (f" g{r['group']}" if r.get('group') else ''))
    for x in r.get('measured_vs_predicted') or pairs(r):
      lines.append(f"| {name} | {x['program']} | {x['measured_ms']:.3f} | "
                   f"{_g(x['predicted_ms'])} | {_ratio(x['measured_over_predicted'])} | "
                   f"{_g(x['bytes_accessed'], 2**20)} | {_g(x['flops'], 1e9)} | "
                   f"{_g(x['temp_bytes'], 2**20)} |")
  return lines


def _engine_table(rows: list) -> list[str]:
  lines = ['| model | format | KV | engine tok/s | engine ms/step | engine host ms/step | '
           'bare decode_steps tok/s | HF eager tok/s | engine / bare | compiles while timed |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    if 'error' in r or 'engine' not in r:
      lines.append(f"| {r['model']} | {r['format']} | {r.get('error', '')} |" + ' |' * 7)
      continue
    e, bare, hf = r['engine'], r['bare_loop'], r.get('hf') or {}
    hf_cell = (f"{hf['host_loop_tok_s']:,.0f}" if 'host_loop_tok_s' in hf
               else hf.get('skipped', '-'))
    lines.append(f"| {r['model']} | {r['format']} | {r['kv']} | {e['tok_s']:,.0f} | "
                 f"{e['ms_per_step']:.3f} | "
                 f"{e['host_ms_per_step'] + e['dispatch_ms_per_step']:.3f} | "
                 f"{bare['tok_s']:,.0f} | {hf_cell} | {e['tok_s'] / bare['tok_s']:.2f} | "
                 f"{r['compiles_while_timed']} |")
  return lines


def markdown(result: dict) -> str:
  """The results as a markdown page: environment, one table per model, the engine rows, the
  timed programs beside the compiler's predictions, the attention section."""
  env, p = result['environment'], result['protocol']
  cache = env.get('compilation_cache')
  lines = ['# Device check', '',
           f"{env['date_utc']} UTC, {env['device_kind']} ({env['backend']}), "
           f"jax {env['versions']['jax']}, python {env['python']}"
           + (f", {env['nvidia_smi']}" if env.get('nvidia_smi') else '') + '.', '',
           f"Prefill {p['prefill']} tokens at batch 1 (last logits); decode {p['steps']} steps "
           f"after a {p['prompt']}-token context; 'host' = one `greedy_step` call per token "
           "from Python, 'device' = the steps in one jitted `while_loop`; ms per step; HBM % = "
           "(weight bytes + KV bytes read) / chip bandwidth over the step time. Synthetic "
           'weights.', '']
  if cache is not None:
    lines += [f"Persistent compilation cache: {cache['dir'] or 'off (' + cache['off'] + ')'}; "
              f"{cache.get('xla_compiles', '?')} executables compiled by XLA, "
              f"{cache.get('cache_hits', '?')} loaded from the cache in this run.", '']
  batches = p['batches']
  main_rows = result['rows']
  for model_name in dict.fromkeys(r['model'] for r in main_rows):
    rows = [r for r in main_rows if r['model'] == model_name]
    head = ['format', 'weights MiB', 'prefill tok/s']
    for b in batches:
      head += [f'b{b} host ms', f'b{b} device ms', f'b{b} HBM % (device)']
    head += ['compile s', 'decode temp MiB', 'device MiB after load']
    lines += [f'## {model_name}', '', '| ' + ' | '.join(head) + ' |',
              '|' + '---|' * len(head)]
    for r in rows:
      if 'error' in r or 'skipped' in r:
        lines.append(f"| {r['format']} | {r.get('error') or r.get('skipped')} |"
                     + ' |' * (len(head) - 2))
        continue
      cells = [r['format'] + (f" g{r['group']}" if r.get('group') else ''),
               _mb(r['weight_bytes']), f"{r['prefill_tok_s']:,.0f}"]
      for b in batches:
        c = r.get(f'b{b}', {})
        frac = c.get('hbm_fraction_device_loop', c.get('hbm_fraction_host_loop'))
        cells += [f"{c['host_loop_ms']:.3f}" if 'host_loop_ms' in c else '',
                  f"{c['device_loop_ms']:.3f}" if 'device_loop_ms' in c else '',
                  f'{100 * frac:.0f}%' if frac is not None else '']
      cells += [f"{r['compile_s']:.1f}" if 'compile_s' in r else '',
                _mb(r.get('decode_step_temp_bytes', r.get('decode_loop_temp_bytes'))),
                _mb(r.get('device_bytes_in_use_after_load'))]
      lines.append('| ' + ' | '.join(cells) + ' |')
    lines.append('')
  engine = result.get('engine') or []
  if engine:
    n = engine[0].get('rows', 8)
    lines += [f'## Serving engine at {n} rows', '',
              f'`qjax.infer.Engine` (max_batch {n}, decode blocks) serving {n} greedy requests '
              f"of a {p['prompt']}-token prompt and {p['steps']} decode steps (prefill not "
              f"timed), beside `generate.decode_steps` at batch {n} over a contiguous cache "
              f'of the same KV format and HF transformers eager `generate` (bf16) at batch '
              f'{n}; decode tokens/s; host ms = the engine\'s planning and dispatch per step.',
              ''] + _engine_table(engine) + ['']
  timed = [r for r in main_rows + engine
           if 'error' not in r and (r.get('measured_vs_predicted') or r.get('predicted'))]
  if timed:
    chip = next((x['chip'] for r in timed for x in r.get('measured_vs_predicted') or pairs(r)),
                None)
    lines += ["## Measured beside the compiler's prediction", '',
              'Each timed program beside XLA\'s figures for the same executable: bytes '
              'accessed, flops and temp bytes from its cost and memory analysis, and the '
              + (f'roofline on `qjax.costmodel`\'s {chip} (max(bytes / HBM bandwidth, flops / '
                 'peak)).' if chip else 'roofline where the device is in `qjax.costmodel`\'s '
                 "table (not here: '-').")
              + ' Predictions, not measurements; a loop program\'s figures are one step\'s '
              '(XLA counts a loop body of unknown trip count once).', '']
    lines += _predicted_table(timed) + ['']
  if result.get('not_run'):
    lines += ['Not run (time budget): ' + ', '.join(result['not_run']) + '.', '']
  if result.get('attention'):
    lines += ['## Attention (benchmarks/attention_timing.py)', '',
              attention_timing.markdown(result['attention'])]
  lines.append(f"Wall time of the whole check: {result['wall_s']:.0f} s.")
  return '\n'.join(lines) + '\n'


@report.figure
def plot(result: dict, path: str) -> None:
  """Decode tokens/s per format at each batch (device loop; HF: its generate), per model."""
  models = list(dict.fromkeys(r['model'] for r in result['rows']))
  if not models:
    print(f'device_check: no row ran, so no {path}', flush=True)
    return
  plt = report.pyplot()
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
  batches = result['protocol']['batches']
  for ax, model_name in zip(axes[0], models):
    rows = [r for r in result['rows'] if r['model'] == model_name and f'b{batches[0]}' in r]
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
      vals = [r[f'b{b}'].get('device_loop_tok_s') or r[f'b{b}'].get('host_loop_tok_s', 0)
              for b in batches]
      ax.bar(np.arange(len(batches)) + i * width, vals, width, label=r['format'])
    ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2, [f'batch {b}' for b in batches])
    ax.set_yscale('log')
    ax.set_ylabel('decode tokens/s')
    ax.set_title(f"{model_name} on {result['environment']['device_kind']}")
    ax.legend(fontsize=7)
  report.save_figure(fig, path)


def render(results: list, out: str) -> dict:
  """Write device_check.md and .png for one result, or several runs on one machine merged
  (rows in order; the first run's environment and protocol; wall times added)."""
  merged = dict(results[0], rows=[r for res in results for r in res['rows']],
                engine=[r for res in results for r in res.get('engine', [])],
                not_run=[n for res in results for n in res.get('not_run', [])],
                wall_s=sum(res.get('wall_s', 0) for res in results))
  os.makedirs(out, exist_ok=True)
  text = markdown(merged)
  with open(os.path.join(out, 'device_check.md'), 'w') as fh:
    fh.write(text)
  plot(merged, os.path.join(out, 'device_check.png'))  # a warning without matplotlib
  print(text)
  return merged
