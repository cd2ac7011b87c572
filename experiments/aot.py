r"""Compile qjax's programs for a TPU or GPU this machine does not have, and print what the
compiler predicts for each (an ahead-of-time compile check: nothing runs).

  python -m experiments.aot --config=configs/aot.py
  python -m experiments.aot --config=configs/aot.py --config.model=llama3_8b \
      --config.targets=v5e-1 --config.formats=bf16,int4
  python -m experiments.aot --config=configs/aot.py:small        (a tiny model, two formats)
  python /path/to/experiments/aot.py --config=/path/to/configs/aot.py   (from any directory)

For each target, format and program (prefill, the decode step at each batch, optionally the
`decode_steps` loop): compiled or the compiler's error, whether it fits one device's HBM, the
memory per device (peak = arguments + outputs - aliased + temp; temp apart), its HBM traffic
(and XLA's bytes accessed) beside the weight + KV bytes it holds, the roofline ms/token (the
traffic and the compiler's flops on the chip's datasheet), the cost model's estimate for the
same step, and each format's predicted speedup over bf16. Every figure is the compiler's
prediction for a compile-only device. Writes aot.json, aot.md and aot.png to
<out_dir>/<model>-<target>/ (out_dir defaults to results/aot in the checkout).
The toolchain: `python -m qjax.aot.install` (docs/aot.md).
"""

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

# The compile-only toolchain must not meet a TPU or GPU backend of this process (qjax.aot).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app
import jax
from ml_collections import config_flags

from qjax import aot
from qjax import costmodel
from qjax.aot import programs
from qjax.nn import TransformerConfig
from qjax.nn import attention_forms

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script from any directory: its sibling module
  sys.path.insert(0, _REPO)
from experiments.aot_report import (PREDICTION, markdown, plot, summary,  # noqa: E402
                                    text_table)

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/aot.py', lock_config=True)

# Shapes only (random weights are never built): what each preset name compiles.
PRESETS = {
    'tiny': ('tiny model (2 layers, D=64)', TransformerConfig.tiny),
    'gemma3_270m': ('Gemma 3 270M', TransformerConfig.gemma3_270m),
    'llama32_1b': ('Llama-3.2-1B shapes (tied)',
                   lambda: TransformerConfig.llama_like(tie_embeddings=True)),
    'llama3_8b': ('Llama-3-8B shapes', lambda: TransformerConfig.llama_like(
        d_model=4096, num_layers=32, head_dim=128, d_ff=14336)),
}


# ---------------------------------------------------------------------------- inputs
def _names(text: str, what: str, choices) -> list:
  names = [s.strip() for s in str(text).split(',') if s.strip()]
  bad = [n for n in names if n not in choices]
  if bad or not names:
    raise ValueError(f'--config.{what}={text!r}: {bad or "nothing"} is not one of '
                     f'{sorted(choices)}; give a comma-separated list of them.')
  return names


def _ints(text: str, what: str, low: int) -> list:
  try:
    values = [int(s) for s in str(text).split(',') if s.strip()]
  except ValueError:
    values = []
  if not values or min(values) < low:
    raise ValueError(f'--config.{what}={text!r} must be comma-separated integers >= {low}.')
  return values


def load_model(spec: str) -> tuple:
  """(short name, label, TransformerConfig) of a preset name, a HF config.json or a GGUF file
  (metadata only; no weight is read)."""
  if spec in PRESETS:
    label, make = PRESETS[spec]
    return spec, label, make()
  path = os.path.abspath(os.path.expanduser(spec))
  if spec.endswith('.gguf') and os.path.exists(path):
    from qjax.checkpoints import gguf  # pylint: disable=g-import-not-at-top
    name = os.path.splitext(os.path.basename(path))[0]
    return name, f'{name} (GGUF metadata)', gguf.gguf_config(gguf.open_gguf(path))
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, 'config.json')):
    path = os.path.join(path, 'config.json')
  if path.endswith('.json') and os.path.isfile(path):
    from qjax.checkpoints import hf_families  # pylint: disable=g-import-not-at-top
    with open(path) as f:
      cfg = hf_families.hf_config(json.load(f))
    name = os.path.basename(os.path.dirname(path)) or 'hf'
    return name, f'{name} (HF config.json)', cfg
  raise ValueError(f'--config.model={spec!r} is neither a preset ({sorted(PRESETS)}) nor an '
                   'existing HF config.json (or its folder) nor a .gguf file.')


@dataclasses.dataclass
class Plan:
  """What one run compiles."""

  name: str
  label: str
  model: TransformerConfig
  formats: list
  targets: list
  batches: list
  context: int
  prefill_len: int
  loop_steps: int
  layers: int  # 0: full depth; k: compile k and 2k layers and extrapolate

  @property
  def depths(self) -> tuple:
    return (self.layers, 2 * self.layers) if self.layers else (self.model.num_layers,)


def make_plan(c) -> Plan:
  """The run a config asks for; ValueError naming the value and the fix."""
  name, label, model = load_model(c.model)
  formats = _names(c.formats, 'formats', programs.FORMATS)
  targets = _names(c.targets, 'targets', aot.TARGETS)
  batches = _ints(c.batches, 'batches', 1)
  context, prefill_len, loop_steps = (_ints(c[k], k, 0)[0] for k in
                                      ('context', 'prefill_len', 'loop_steps'))
  layers = int(c.layers)
  big = model.num_layers
  if layers and not 0 < 2 * layers <= big:
    raise ValueError(f'--config.layers={layers}: compiles {layers} and {2 * layers} layers to '
                     f'extrapolate to {big}; use 0 (full depth) or 1..{big // 2}.')
  if layers and model.global_every and layers % model.global_every:
    raise ValueError(f'--config.layers={layers}: this model repeats its layer pattern every '
                     f'{model.global_every} layers; use a multiple of {model.global_every}.')
  slots = max(prefill_len + 1, context + loop_steps + 1)
  model = model.replace(dtype='bfloat16', param_dtype='bfloat16', max_len=slots)
  return Plan(name, label, model, formats, targets, batches, context, prefill_len,
              loop_steps, layers)


def model_shape(cfg: TransformerConfig, name: str) -> costmodel.ModelShape:
  """The cost model's shape of a TransformerConfig (gated MLP: three E x F matrices)."""
  return costmodel.ModelShape(name, n_layers=cfg.num_layers, d_model=cfg.d_model,
                              d_ff=cfg.d_ff, n_heads=cfg.num_heads, head_dim=cfg.head_dim,
                              n_kv_heads=cfg.num_kv_heads, vocab=cfg.vocab_size, glu=True,
                              tied_embeddings=cfg.tie_embeddings)


_WEIGHT_BITS = {'bf16': 16, 'int8': 8, 'int4': 4, 'int4_g128': 4, 'fp8': 8, 'w8a8': 8}


def estimate_s(plan: Plan, chip: str, fmt: str, kind: str, batch: int, tokens: int) -> float:
  """The cost model's time per step for the same program on one chip (one token per row for
  decode; the whole prompt for prefill; `tokens` steps for the loop)."""
  w = costmodel.Workload(batch=batch, prompt_len=tokens if kind == 'prefill' else plan.context,
                         gen_len=0 if kind == 'prefill' else tokens,
                         weight_bits=_WEIGHT_BITS[fmt], act_bits=8 if fmt == 'w8a8' else 16)
  est = costmodel.estimate(model_shape(plan.model, plan.name), chip, '1x1x1',
                           '1d_ws+multihead', w, 'prefill' if kind == 'prefill' else 'decode')
  return est.latency_s


# ---------------------------------------------------------------------------- compile
def _programs(plan: Plan, m) -> list:
  """(kind, batch, Program) for the model `m`."""
  out = [('prefill', 1, programs.prefill(m, plan.prefill_len))] if plan.prefill_len else []
  out += [('decode', b, programs.decode(m, b, plan.context)) for b in plan.batches]
  if plan.loop_steps:
    out.append(('loop', plan.batches[0],
                programs.decode_loop(m, plan.batches[0], plan.context, plan.loop_steps)))
  return out


_LINEAR = ('argument_bytes', 'output_bytes', 'alias_bytes', 'generated_code_bytes', 'flops',
           'bytes_accessed', 'hlo_bytes', 'hbm_traffic', 'vmem_prefetch_bytes')


def extrapolate(a: aot.Report, b: aot.Report, k: int, depth: int, bits: int) -> aot.Report:
  """The Report at `depth` layers from those at k and 2k: figures that grow with the layers
  (arguments, outputs, flops, bytes) linearly; temp is the 2k-layer compile's."""
  if not (a.compiled and b.compiled):
    return a if not a.compiled else b
  r = dataclasses.replace(b, compile_s=a.compile_s + b.compile_s)
  for field in _LINEAR:
    va, vb = getattr(a, field), getattr(b, field)
    if va is not None and vb is not None:
      setattr(r, field, type(va)(va + (vb - va) * (depth - k) / k))
  r.peak_bytes = r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes
  r.fits = r.peak_bytes <= r.hbm_bytes
  r.roofline_s = aot.roofline(aot.spec_of(r.target), r.flops, aot.roofline_bytes(r), bits)
  return r


def _row(plan: Plan, spec, fmt: str, kind: str, batch: int, tokens: int, r: aot.Report,
         weight_bytes: int, kv_bytes: int, cpu_s: float) -> dict:
  est = estimate_s(plan, spec.chip, fmt, kind, batch, tokens) if kind != 'build' else None
  r.estimate_s = est
  return dict(program=r.program, format=fmt, kind=kind, batch=batch, tokens=tokens,
              weight_bytes=weight_bytes, kv_bytes=kv_bytes, compile_cpu_s=cpu_s,
              report=r.to_dict(),
              roofline_ms_per_token=r.roofline_s / tokens * 1e3 if r.roofline_s else None,
              estimate_ms_per_token=est / tokens * 1e3 if est else None)


def _compile_depth(plan: Plan, target: str, fmt: str, layers: int, say) -> list:
  """[(kind, batch, tokens, report, weight bytes, KV bytes)] of `fmt` at `layers` layers."""
  m = programs.abstract_model(plan.model.replace(num_layers=layers), fmt, target)
  out = []
  for kind, batch, prog in _programs(plan, m):
    cpu = time.process_time()
    r = prog.compile(target)
    cpu = time.process_time() - cpu
    say(f'  {target} {fmt:9s} {prog.name:22s} {layers:3d} layers: '
        f'{"compiled" if r.compiled else "REFUSED"} in {r.compile_s:.1f} s ({cpu:.1f} s CPU)')
    cache = prog.args[1] if kind == 'loop' else prog.args[-1]
    out.append((kind, batch, prog.tokens, r, m.weight_bytes, programs.cache_bytes(cache), cpu))
  return out


def run_target(plan: Plan, target: str, say=None) -> list:
  """One row per format and program: the Report and the figures derived from it."""
  say = say or _say
  spec = aot.spec_of(target)
  depth = plan.model.num_layers
  rows = []
  for fmt in plan.formats:
    bits = programs.compute_bits(fmt)
    try:
      per_depth = [_compile_depth(plan, target, fmt, n, say) for n in plan.depths]
    except Exception as e:  # pylint: disable=broad-except  (a model that does not build is a row)
      r = aot.Report(program='(building the model)', target=target,
                     error=f'{type(e).__name__}: {e}')
      rows.append(_row(plan, spec, fmt, 'build', 1, 1, r, 0, 0, 0.0))
      continue
    for i, (kind, batch, tokens, r, wb, kvb, cpu) in enumerate(per_depth[0]):
      if plan.layers:  # figures at k and 2k layers -> the model's depth
        _, _, _, r2, wb2, kvb2, cpu2 = per_depth[1][i]
        cpu += cpu2
        grow = (depth - plan.layers) / plan.layers
        r = extrapolate(r, r2, plan.layers, depth, bits)
        wb, kvb = round(wb + (wb2 - wb) * grow), round(kvb + (kvb2 - kvb) * grow)
      rows.append(_row(plan, spec, fmt, kind, batch, tokens, r, wb, kvb, cpu))
  base = {row['program']: row['roofline_ms_per_token'] for row in rows
          if row['format'] == 'bf16'}
  for row in rows:
    b, f = base.get(row['program']), row['roofline_ms_per_token']
    row['speedup_vs_bf16'] = b / f if b and f else None
  return rows


def attention_note(plan: Plan, target: str) -> str:
  """The prefill attention form the target's program takes, and why."""
  if not plan.prefill_len:
    return 'no prefill compiled'
  with aot.tracing_for(target):
    form = attention_forms.choose_form(plan.model.attention_impl, t=plan.prefill_len,
                                       dtype=plan.model.compute_dtype,
                                       head_dim=plan.model.head_dim,
                                       logit_softcap=plan.model.attn_logit_softcap)
  return f'{form.name} ({form.reason})'


# ---------------------------------------------------------------------------- main
def host_facts() -> str:
  """This machine as a results line: CPU model, cores, the load when the run began (compile
  seconds stretch on a busy machine; the CPU seconds beside them do not)."""
  model = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      model = next((line.split(':', 1)[1].strip() for line in f
                    if line.startswith('model name')), model)
  except OSError:
    pass
  load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan')
  return f'{model}, {os.cpu_count()} CPU cores, load average {load:.1f} at the start'


def revision() -> str:
  """The checkout's commit, and whether qjax/ differs from it (results name the code)."""
  git = lambda *a: subprocess.run(['git', '-C', _REPO, *a], capture_output=True, text=True,  # noqa
                                  check=False).stdout.strip()
  try:
    rev, dirty = git('rev-parse', '--short', 'HEAD'), git('status', '--porcelain', 'qjax')
  except OSError:
    return 'unknown (no git)'
  return (rev or 'unknown (not a git checkout)') + (' + uncommitted changes in qjax/'
                                                    if dirty else '')


def _say(text: str) -> None:
  print(text, flush=True)  # a long run's progress reaches a log file as it happens


def run(c, say=_say) -> list:
  """Compile what config `c` names for each of its targets; write and return the results."""
  plan = make_plan(c)
  host = host_facts()
  command = ' '.join(['python -m experiments.aot'] + sys.argv[1:])
  out_root = c.out_dir or os.path.join(_REPO, 'results', 'aot')
  results = []
  for target in plan.targets:
    spec = aot.spec_of(target)
    say(f'== {plan.label} on a compile-only {target}: compiling (figures are predictions) ==')
    rows = run_target(plan, target, say)
    chip = costmodel.get_chip(spec.chip)
    sources = sorted({r['report']['bytes_source'] for r in rows if r['report']['bytes_source']})
    result = dict(
        what=PREDICTION, label=plan.label, model=plan.name,
        config=dataclasses.asdict(plan.model),
        plan=dict(formats=plan.formats, batches=plan.batches, context=plan.context,
                  prefill_len=plan.prefill_len, loop_steps=plan.loop_steps,
                  layers=plan.layers, layers_total=plan.model.num_layers),
        target=dict(name=target, chip=spec.chip, devices=spec.n_devices,
                    device_kind=aot.target(target).device_kind,
                    hbm_per_device=spec.hbm_per_device,
                    hbm_bw=chip.hbm_bw / spec.devices_per_chip,
                    bytes_source=' / '.join(sources) or '-'),
        attention=attention_note(plan, target), rows=rows,
        date=datetime.date.today().isoformat(),
        time=datetime.datetime.now().isoformat(timespec='seconds'), host=host,
        jax=jax.__version__, toolchain=aot.toolchain.read_manifest(),
        qjax=revision(), command=command)
    out = os.path.join(out_root, f'{plan.name}-{target}')
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'aot.json'), 'w') as f:
      json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, 'aot.md'), 'w') as f:
      f.write(markdown(result))
    plot(result, os.path.join(out, 'aot.png'))
    say(text_table(result))
    say(f'wrote {out}/aot.json, aot.md and aot.png\n')
    results.append(result)
  path = os.path.join(out_root, f'{plan.name}-summary.md')
  with open(path, 'w') as f:
    f.write(summary(results))
  say(summary(results) + f'wrote {path}')
  return results


def main(argv):
  del argv
  try:  # a bad name fails before any compile, without a traceback
    make_plan(_CONFIG.value)
  except ValueError as e:
    raise app.UsageError(f'Bad config: {e}') from None
  run(_CONFIG.value)


if __name__ == '__main__':
  app.run(main)
