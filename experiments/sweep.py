r"""Run a config's PTQ sweep on a trained model; resumable, keeps going past failures.

  python -m experiments.sweep --config=configs/demo.py

The config file declares `sweep()` returning a list of override dicts (e.g.
{'quant.bits': 4, 'quant.group_size': 128}); each point quantizes the trained model in
`config.workdir` and appends its result to `<out_dir>/results.jsonl`. Rerunning skips the
points already finished. Writes table.md and ppl_vs_bytes.png next to the results.
"""

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qjax import eval as qeval  # noqa: E402

from experiments import quantize as qexp  # noqa: E402
from experiments import train as train_lib  # noqa: E402


def load_sweep(config_path: str):
  """The `sweep()` function declared in a config file."""
  spec = importlib.util.spec_from_file_location('_sweep_config', config_path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  if not hasattr(mod, 'sweep'):
    raise ValueError(f'{config_path} declares no sweep(); add a function returning a list of '
                     'override dicts, e.g. [{"quant.bits": 4}].')
  return mod.sweep


def apply_overrides(config, overrides: dict):
  """A copy of `config` with dotted-key overrides; unknown keys fail loudly."""
  c = config.copy_and_resolve_references()
  for key, value in overrides.items():
    node, *path = key.split('.')
    target = c
    for part in [node] + path[:-1]:
      if part not in target:
        raise ValueError(f'sweep override {key!r}: no config field {part!r}; fields here are '
                         f'{sorted(target.keys())}.')
      target = target[part]
    leaf = path[-1] if path else node
    if leaf not in target:
      raise ValueError(f'sweep override {key!r}: no config field {leaf!r}; fields here are '
                       f'{sorted(target.keys())}.')
    target[leaf] = value
  return c


def sweep_point_name(config, overrides: dict) -> str:
  """The point's quant name, plus any override outside `quant.` (e.g. '+gptq.act_order=True')."""
  extra = ''.join(f'+{k.removeprefix("options.")}={v}' for k, v in overrides.items()
                  if not k.startswith('quant.'))
  return qexp.point_name(apply_overrides(config, overrides).quant) + extra


def run_ptq_sweep(config, points: list[dict], model=None, data=None, log=print, ref=None,
                  base_hash=None, base_source='experiments/train.py',
                  title='PTQ sweep', extra_metrics=None) -> list[dict]:
  """Quantize + evaluate every point; write results.jsonl, table.md and the plot.

  The base is `config.workdir`'s trained run unless `ref` (a FloatReference of another
  model, e.g. an imported checkpoint) and its `base_hash` are given. Points may set
  `quant.method` to a calibrated method; the config's `calib` and `options` sections then
  apply (configs/quantize.py).
  """
  if ref is None:
    if model is None:
      model, _, data = train_lib.load_trained(config.workdir)
    ref = qexp.FloatReference(model, data, config.eval)
    base_hash = qexp.base_checkpoint_hash(config.workdir)
  named = [(sweep_point_name(config, ov), ov) for ov in points]

  def run_point(name, ov):
    c = apply_overrides(config, ov)
    return qexp.quantize_and_evaluate(
        ref, c.quant, os.path.join(config.out_dir, 'points', name), base_hash,
        calib=c.get('calib'), options=c.get('options'),
        warm_repeat=bool(c.get('warm_repeat', False)), base_source=base_source,
        extra_metrics=extra_metrics)

  results_path = os.path.join(config.out_dir, 'results.jsonl')
  rows = qeval.run_sweep(named, run_point, results_path, log=log)
  float_row = {'name': 'float', 'method': 'float', 'weight_format': 'f32',
               'ppl': ref.ppl['ppl'], 'weight_bytes': ref.bytes, 'bytes_ratio': 1.0,
               'greedy_agreement': 1.0, 'status': 'ok'}
  table = qeval.markdown_table([float_row] + rows)
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  qeval.plot_ppl_vs_bytes(rows, os.path.join(config.out_dir, 'ppl_vs_bytes.png'),
                          title=f'{title} ({len(rows)} points)', baseline=float_row)
  return [float_row] + rows


def main(argv):
  del argv
  config = _CONFIG.value
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  rows = run_ptq_sweep(config, load_sweep(path)())
  print(qeval.markdown_table(rows))


if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/demo.py', lock_config=True)
  app.run(main)
