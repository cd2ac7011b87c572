r"""Plan transformer inference with the analytic cost model (Pope et al. 2022).

  python -m experiments.plan --config=configs/plan_palm540b.py
  python -m experiments.plan --config=configs/plan_gemma3_h200.py --config.n_chips=8
  python -m experiments.plan --config=configs/plan_palm540b.py --config.slice=v4:4x4x4

For each phase (prefill, decode) and each layout at its best mesh, prints the per-step
compute / weight-load / KV-load / communication times, the step and total latency, MFU,
memory per chip, whether it fits and the regime; optionally Table 2 of the paper next to
the roofline. With --config.slice (a TPU slice: 'v4:4x4x4', 'v5e:2x4', 'v5e-8') each
layout is also compiled for that slice by the TPU compiler (compile-only, nothing runs),
and a second table puts its compiled memory per chip, whether that fits the chip's HBM,
its compiled collective bytes and the compiler's roofline beside the prediction. Writes
table.txt and latency_vs_batch.png to --config.out_dir (default results/plan/<name>/).
"""

import dataclasses
import os

# The compile-only TPU toolchain must not meet a TPU backend of this process (qjax.aot).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app
from ml_collections import config_flags

from qjax import costmodel
from qjax.eval.report import figure, pyplot

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'A configs/plan_*.py file.', lock_config=True)

_COLUMNS = ('layout', 'mesh', 'compute', 'weights', 'KV', 'comm', 'step', 'total', 'MFU',
            'mem/chip', 'fits', 'regime')


# ---------------------------------------------------------------------------- inputs
def _workload(phase_cfg) -> costmodel.Workload:
  return costmodel.Workload(**phase_cfg.to_dict())


def _spec(value):
  """A preset name, or a config section describing a custom model / chip."""
  return value if isinstance(value, str) else value.to_dict()


def _model(cfg) -> costmodel.ModelShape:
  return costmodel.model_from_spec(_spec(cfg.model))


def _chip(cfg) -> costmodel.Chip:
  return costmodel.chip_from_spec(_spec(cfg.chip))


def _layouts(cfg) -> list:
  pad_kv = bool(cfg.get('pad_kv_heads', False))
  if cfg.layouts == 'all':
    return costmodel.all_layouts(cfg.pad_heads, pad_kv)
  return [costmodel.Layout(*name.strip().split('+'), pad_heads=cfg.pad_heads,
                           pad_kv_heads=pad_kv) for name in cfg.layouts.split(',')]


def _plan(cfg, phase: str, workload: costmodel.Workload, layouts, require_fit: bool):
  return costmodel.plan(
      _model(cfg), _chip(cfg), workload, cfg.n_chips, phase, layouts=layouts,
      meshes=[cfg.mesh] if cfg.mesh else None, interconnect=cfg.interconnect,
      combine=cfg.combine, efficiency=costmodel.Efficiency(**cfg.efficiency.to_dict()),
      pad_heads=cfg.pad_heads, require_fit=require_fit)


# ---------------------------------------------------------------------------- table
def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:.4g} ms' if seconds < 10 else f'{seconds:.4g} s'


def _row(est) -> tuple:
  return (str(est.mesh), _ms(est.compute_s), _ms(est.weight_load_s), _ms(est.kv_load_s),
          _ms(est.comm_s), _ms(est.step_latency_s), _ms(est.latency_s), f'{est.mfu:.3f}',
          f'{est.memory.total_bytes / 1e9:.3g} GB', 'yes' if est.memory.fits else 'NO',
          est.regime)


def _format(rows: list) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _reason(rejected, layout) -> str:
  """Why `layout` was rejected, on its most cube-like mesh (the least degenerate one)."""
  mine = [r for r in rejected if r.startswith(f'{layout} on ')]
  if not mine:
    return 'rejected'
  spread = lambda r: max(int(s) for s in r.split(' on ')[1].split(':')[0].split('x'))  # noqa
  return min(mine, key=spread).split(': ', 1)[1]


def phase_table(cfg, phase: str, workload: costmodel.Workload) -> str:
  """One row per layout (its best mesh); layouts with identical numbers share a row."""
  layouts = _layouts(cfg)
  head = (f'== {phase}: {_model(cfg).name} on {cfg.n_chips} x {_chip(cfg).name}, '
          f'batch {workload.batch}, '
          f'prompt {workload.prompt_len}, generate {workload.gen_len}, bits w/a/kv '
          f'{workload.weight_bits:g}/{workload.act_bits:g}/{workload.kv_bits:g} '
          f'(times per step; total = steps x step) ==')
  try:
    result = _plan(cfg, phase, workload, layouts, require_fit=False)
  except ValueError as e:
    return f'{head}\n  no layout runs: {e}'
  best = result.best_per_layout()
  groups: dict = {}
  for name, est in best.items():
    groups.setdefault(_row(est), []).append(name)
  rows = [_COLUMNS]
  for values, names in groups.items():
    label = names[0] if len(names) == 1 else f'{names[0]} (+{len(names) - 1} same)'
    rows.append((label,) + values)
  missing = [f'  {lay}: {_reason(result.rejected, lay)}' for lay in layouts
             if str(lay) not in best]
  win = result.best
  lay = win.layer
  tail = (f'best: {win.layout} on {win.mesh}: {_ms(win.latency_s)} '
          f'({_ms(win.step_latency_s)} per step), MFU {win.mfu:.3f}, {win.regime} bound\n'
          f'  per layer ({win.n_layers}): compute {_ms(lay.compute_s)}, weights '
          f'{_ms(lay.weight_load_s)}, KV {_ms(lay.kv_load_s)}, comm {_ms(lay.comm_s)} in '
          f'{lay.n_collectives} collectives; output head: compute {_ms(win.head.compute_s)}, '
          f'weights {_ms(win.head.weight_load_s)}'
          if win.memory.fits else 'best: nothing fits in HBM')
  lines = [head, _format(rows), tail]
  if missing:
    lines += ['not runnable:'] + missing
  return '\n'.join(lines)


def compiled_table(cfg, phase: str, workload: costmodel.Workload, say=print) -> str:
  """Each layout compiled for --config.slice beside the cost model (the compiler's figures
  are its predictions for one chip; no step runs)."""
  from qjax import aot  # pylint: disable=g-import-not-at-top  (jax: only with a slice)
  depths = tuple(cfg.compile_depths) if cfg.compile_depths else None
  say(f'compiling each layout\'s {phase} step for {cfg.slice} ...')
  depth = (f'{"+".join(map(str, depths))} layers compiled, extrapolated to the full depth'
           if depths else 'the full depth compiled')
  head = (f'== {phase} on {cfg.slice}: the cost model beside the TPU compiler (compile-only '
          f'predictions per chip; {depth}; memory = weights + KV + the step\'s activations) ==')
  try:
    rows = aot.compare_layouts(_model(cfg), cfg.slice, workload, phase,
                                    layouts=_layouts(cfg), depths=depths)
  except ValueError as e:  # the cost model finds no layout that runs this workload
    return f'{head}\n  no layout runs: {e}'
  done = aot.compiled_rows(rows)
  if not done:
    return '\n'.join([head, aot.format_rows(rows), 'no layout compiled'])
  model_best = min(done, key=lambda r: r.estimate.step_latency_s)
  compiled_best = min(done, key=lambda r: r.compiled_s)
  agree = 'yes' if aot.best_agrees(done) else 'NO'
  seconds = sum(r.compiled.compile_s for r in done)
  return '\n'.join([
      head, aot.format_rows(rows),
      f'fastest by the cost model: {model_best.layout} on {model_best.compiled.mesh}; by the '
      f'compiler\'s roofline: {compiled_best.layout} on {compiled_best.compiled.mesh}; the '
      f'cost model\'s pick within 10% of the compiler\'s best: {agree} ({seconds:.0f} s of '
      'compiling)'])


def paper_table() -> str:
  """Pope et al. Table 2 rows next to the roofline, and the int8 decode saving."""
  rows = [('row', 'measured', 'roofline', 'measured/roofline', 'MFU paper', 'MFU roofline')]
  for r in costmodel.TABLE2:
    est = costmodel.estimate(r.model, r.chip, r.mesh, r.layout, r.workload, r.phase)
    rows.append((r.label, _ms(r.latency_s), _ms(est.latency_s),
                 f'{r.latency_s / est.latency_s:.2f}', f'{r.mfu:.2f}', f'{est.mfu:.2f}'))
  steps = {}
  for bits in (8, 16):
    w = costmodel.Workload(batch=64, prompt_len=2048, gen_len=64, weight_bits=bits)
    steps[bits] = costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4', '2d_ws+mq_batch', w,
                                     'decode').step_latency_s
  saving = (steps[16] - steps[8]) * 1e3
  return '\n'.join([
      '== Pope et al. 2022, Table 2 (PaLM 540B, 64 x TPU v4) vs the roofline ==',
      _format(rows),
      f'decode B=64 int8 vs bf16: roofline saves {saving:.2f} ms/token '
      f'({steps[16] * 1e3:.2f} -> {steps[8] * 1e3:.2f}); measured 36.9 -> 28.5 = 8.4 ms.'])


# ---------------------------------------------------------------------------- plot
@figure
def plot(cfg, path: str) -> None:
  """Best step latency vs batch for each layout, one panel per phase."""
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, phase in zip(axes, costmodel.PHASES):
    base = _workload(getattr(cfg, phase))
    curves: dict = {}
    for lay in _layouts(cfg):
      ys = []
      for b in cfg.plot_batches:
        w = dataclasses.replace(base, batch=b)
        try:
          ys.append(_plan(cfg, phase, w, [lay], require_fit=True).best.step_latency_s)
        except ValueError:
          ys.append(float('nan'))
      curves.setdefault(tuple(ys), []).append(str(lay))
    for ys, names in curves.items():
      label = names[0] if len(names) == 1 else f'{names[0]} (+{len(names) - 1} same)'
      ffn, attn = names[0].split('+')
      # Colour names the feed-forward layout, line style the attention layout.
      ax.plot(cfg.plot_batches, ys, marker='o', ms=3, label=label,
              color=f'C{costmodel.FFN_LAYOUTS.index(ffn)}',
              linestyle=('-', '--', ':')[costmodel.ATTN_LAYOUTS.index(attn)])
    ax.set(xscale='log', yscale='log', xlabel='batch (sequences)',
           ylabel='step latency (s)' + (', per token' if phase == 'decode' else ''),
           title=f'{phase}: {_model(cfg).name}, {cfg.n_chips} x {_chip(cfg).name}')
    ax.grid(True, which='both', alpha=0.3)
  axes[1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _check_slice(cfg) -> None:
  """The slice's chip and chip count must be the config's (raises ValueError naming both)."""
  from qjax.aot import _slices  # pylint: disable=g-import-not-at-top
  s = _slices.parse_slice(cfg.slice)
  if _chip(cfg).name != s.chip:
    raise ValueError(f'--config.slice={cfg.slice!r} is made of {s.chip} chips but '
                     f'--config.chip={_chip(cfg).name!r}; set --config.chip={s.chip}.')
  if cfg.n_chips != s.n_chips:
    raise ValueError(f'--config.slice={cfg.slice!r} has {s.n_chips} chips but '
                     f'--config.n_chips={cfg.n_chips}; set --config.n_chips={s.n_chips}.')
  for phase in costmodel.PHASES:
    w = _workload(getattr(cfg, phase))
    if w.weight_bits not in (8, 16) or w.kv_bits not in (8, 16):
      raise ValueError(f'--config.{phase}: a slice compiles int8 (8) or bf16 (16) weights and '
                       f'KV, got weight_bits={w.weight_bits:g}, kv_bits={w.kv_bits:g}.')


# ---------------------------------------------------------------------------- main
def main(argv):
  del argv
  cfg = _CONFIG.value
  try:  # fail on a bad name or number before any work, without a traceback
    _model(cfg), _chip(cfg), _layouts(cfg)
    if cfg.combine not in costmodel.COMBINE_RULES:
      raise ValueError(f'--config.combine={cfg.combine!r} is unknown; use one of '
                       f'{list(costmodel.COMBINE_RULES)}.')
    _workload(cfg.prefill), _workload(cfg.decode)
    costmodel.Efficiency(**cfg.efficiency.to_dict())
    if isinstance(cfg.n_chips, bool) or not isinstance(cfg.n_chips, int) or cfg.n_chips < 1:
      raise ValueError(f'--config.n_chips={cfg.n_chips!r} must be a positive integer.')
    if cfg.mesh and costmodel.as_mesh(cfg.mesh).n != cfg.n_chips:
      raise ValueError(f'--config.mesh={cfg.mesh!r} has {costmodel.as_mesh(cfg.mesh).n} chips '
                       f'but --config.n_chips={cfg.n_chips}; make their product n_chips or '
                       'drop the mesh.')
    if cfg.get('slice'):
      _check_slice(cfg)
    if cfg.interconnect not in costmodel.INTERCONNECTS:
      raise ValueError(f'--config.interconnect={cfg.interconnect!r} is unknown; use one of '
                       f'{list(costmodel.INTERCONNECTS)}.')
  except ValueError as e:
    raise app.UsageError(f'Bad config: {e}') from None
  out_dir = cfg.out_dir or os.path.join('results', 'plan', cfg.name)
  model, chip = _model(cfg), _chip(cfg)
  os.makedirs(out_dir, exist_ok=True)

  sections = []
  for phase in costmodel.PHASES:
    sections.append(phase_table(cfg, phase, _workload(getattr(cfg, phase))))
    if cfg.get('slice'):
      sections.append(compiled_table(cfg, phase, _workload(getattr(cfg, phase))))
  if cfg.compare_paper:
    sections.append(paper_table())
  rule = costmodel.COMBINE_TEXT[cfg.combine]
  sections.append(f'model: {model.name} ({model.n_params:,} parameters, '
                  f'{model.kv_bytes_per_token(16):,.0f} KV bytes per token at 16 bits); chip: '
                  f'{chip.name} ({chip.hbm_bytes:.4g} B HBM at {chip.hbm_bw:.4g} B/s, '
                  f'{chip.bf16_flops:.4g} FLOP/s bf16, {chip.ici_bw:.4g} B/s interconnect)\n'
                  f'interconnect model: {cfg.interconnect}; combining rule: {cfg.combine} '
                  f'({rule}); kv heads padded to the shard count: '
                  f'{bool(cfg.get("pad_kv_heads", False))}; efficiency: '
                  f'{cfg.efficiency.to_dict()}')
  text = '\n\n'.join(sections)
  print(text)
  with open(os.path.join(out_dir, 'table.txt'), 'w') as f:
    f.write(text + '\n')
  png = os.path.join(out_dir, 'latency_vs_batch.png')
  plot(cfg, png)
  print(f'\nwrote {out_dir}/table.txt and {png}')


if __name__ == '__main__':
  app.run(main)
