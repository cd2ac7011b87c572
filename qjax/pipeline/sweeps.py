"""Sweeps declared next to their config: `sweep()` override lists, applied point by point.

A config file declares `sweep()` returning override dicts (e.g. {'quant.bits': 4,
'quant.group_size': 128}); `run_ptq_sweep` quantizes the float model once per point and
appends each row to <out_dir>/results.jsonl (resumable: finished points are skipped), then
writes table.md and ppl_vs_bytes.png.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import ml_collections
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import eval as qeval
from qjax.pipeline import ptq
from qjax.pipeline.training import load_trained, trained_checkpoint


def load_sweep(config_path: str):
  """The `sweep()` function declared in a config file.

  Args:
    config_path: path of a configs/*.py file.

  Returns:
    Its `sweep` function (no arguments -> a list of override dicts).
  """
  spec = importlib.util.spec_from_file_location('_sweep_config', config_path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  if not hasattr(mod, 'sweep'):
    raise ValueError(f'{config_path} declares no sweep(); add a function returning a list of '
                     'override dicts, e.g. [{"quant.bits": 4}].')
  return mod.sweep


def apply_overrides(config, overrides: dict):
  """A copy of `config` with overrides: dotted keys ('quant.bits') or top-level ones ('seed').

  Unknown keys, a key that descends into a value that is not a section ('seed.x'), and a key
  that replaces a whole section with a value ('quant': 4) fail loudly, naming the key.
  """
  c = config.copy_and_resolve_references()
  for key, value in overrides.items():
    if not isinstance(key, str) or not key or '' in key.split('.'):
      raise ValueError(f'sweep override {key!r}: keys are config field names, dotted for '
                       "nested fields ('seed', 'quant.bits').")
    *parents, leaf = key.split('.')
    target, where = c, 'the config'
    for part in parents:
      if part not in target:
        raise ValueError(f'sweep override {key!r}: no config field {part!r} in {where}; '
                         f'fields there are {sorted(target.keys())}.')
      target, where = target[part], f'{where}.{part}' if where != 'the config' else part
      if not isinstance(target, ml_collections.ConfigDict):
        raise ValueError(f'sweep override {key!r}: {where!r} is a value ({target!r}), not a '
                         f'section with fields; override {where!r} itself.')
    if leaf not in target:
      raise ValueError(f'sweep override {key!r}: no config field {leaf!r} in {where}; fields '
                       f'there are {sorted(target.keys())}.')
    if isinstance(target[leaf], ml_collections.ConfigDict):
      raise ValueError(f'sweep override {key!r}: {key!r} is a section (fields '
                       f'{sorted(target[leaf].keys())}); override its fields, e.g. '
                       f'{key + "." + sorted(target[leaf].keys())[0]!r}.')
    target[leaf] = value
  return c


def sweep_point_name(config, overrides: dict) -> str:
  """The point's quant name, plus any override outside `quant.` (e.g. '+gptq.act_order=True')."""
  extra = ''.join(f'+{k.removeprefix("options.")}={v}' for k, v in overrides.items()
                  if not k.startswith('quant.'))
  return ptq.point_name(apply_overrides(config, overrides).quant) + extra


def point_config_sha256(config) -> str:
  """sha256 of a point's resolved config, without where it reads and writes (workdir,
  out_dir) and the switches that do not change a result."""
  d = json.loads(config.to_json())
  for k in ('workdir', 'out_dir', 'allow_unfinished'):
    d.pop(k, None)
  return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def point_keys(config, named, base: str) -> dict[str, dict]:
  """{point name: {'base': base content hash, 'config': point config hash}} (see run_sweep)."""
  return {n: {'base': base, 'config': point_config_sha256(apply_overrides(config, ov))}
          for n, ov in named}


def base_key(base_hash, ref) -> str:
  """The base model's identity in sweep keys: its content hash (reproducible across runs)."""
  if isinstance(base_hash, dict) and base_hash.get('content_sha256'):
    return base_hash['content_sha256']
  return qckpt.content_sha256(nnx.state(ref.model))


def run_ptq_sweep(config, points: list[dict], model=None, data=None, log=print, ref=None,
                  base_hash=None, base_source='experiments/train.py',
                  title='PTQ sweep', extra_metrics=None) -> list[dict]:
  """Quantize + evaluate every point; write results.jsonl, table.md and the plot.

  Args:
    config: a quantize-style config (quant, eval, out_dir; calib and options for calibrated
      methods, see configs/quantize.py).
    points: override dicts, one per point.
    model, data: the float model and its data; loaded from `config.workdir` when None.
    log: progress printer.
    ref, base_hash: a FloatReference of another model (e.g. an imported checkpoint) and its
      hash, used instead of `config.workdir`'s run.
    base_source, title, extra_metrics: for the records, the plot and extra columns (see
      `ptq.quantize_and_evaluate`).

  Returns:
    [the float row] + one row per point (failed points carry status and error).
  """
  if ref is None:
    allow = bool(config.get('allow_unfinished', False))
    if model is None:
      model, _, data = load_trained(config.workdir, allow)
    ref = ptq.FloatReference(model, data, config.eval)
    base_hash = trained_checkpoint(config.workdir, allow)
  named = [(sweep_point_name(config, ov), ov) for ov in points]

  def run_point(name, ov):
    c = apply_overrides(config, ov)
    return ptq.quantize_and_evaluate(
        ref, c.quant, os.path.join(config.out_dir, 'points', name), base_hash,
        calib=c.get('calib'), options=c.get('options'),
        warm_repeat=bool(c.get('warm_repeat', False)), base_source=base_source,
        extra_metrics=extra_metrics)

  results_path = os.path.join(config.out_dir, 'results.jsonl')
  rows = qeval.run_sweep(named, run_point, results_path, log=log,
                         keys=point_keys(config, named, base_key(base_hash, ref)))
  float_row = ref.float_row()
  table = qeval.markdown_table([float_row] + rows)
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  qeval.plot_ppl_vs_bytes(rows, os.path.join(config.out_dir, 'ppl_vs_bytes.png'),
                          title=f'{title} ({len(rows)} points)', baseline=float_row)
  return [float_row] + rows
