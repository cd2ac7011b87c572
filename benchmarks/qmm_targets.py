"""Quantized formats against bf16 on compile-only targets: bytes, temp and flops ratios.

    JAX_PLATFORMS=cpu python -m benchmarks.qmm_targets [--targets=v5e-1,v6e-1,h200]
        [--formats=bf16,int8,int4,int4_g128,fp8,w8a8] [--batches=1,8] [--layers=2]
        [--prefill=512 [--prefill_targets=v5e-1]] [--mlp] [--json=PATH]

For each target (`qjax.aot`: a TPU or GPU this machine does not have), each format
(`qjax.aot.programs.FORMATS`: every projection and the tied head in the format) builds
Llama-3.2-1B's widths, heads and vocabulary (`--layers` of its 16 layers) abstractly,
compiles the decode step at each batch (context 128) and, with `--prefill`, one prompt of that
length, and prints each format's compiled bytes accessed, temp and flops as ratios to bf16's,
the bytes over the format's own weight + KV bytes, and the path each kind of layer took.
`--mlp` adds the MLP up-projection (2048 x 8192) alone at M = 1 and 8 for int4 g32 / g64
(bf16 scales for g32: f32 scales alone are 1/8 of its int4 codes' bytes, 0.31x bf16).

Every number is the compiler's prediction, not a measurement: XLA's 'bytes accessed' (its cost
analysis on TPU, an HLO op count on GPU: `bytes_source`) and the HBM traffic counted from the
compiled HLO (`qjax.aot.hbm_traffic`, the ratios the targets are stated in). Takes ~1 minute
per format and target on 2 cores.
Compile-only runs load libtpu: run with JAX_PLATFORMS=cpu, never inside a pytest worker.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax import aot
from qjax.aot import programs
from qjax.core import QArray, int_format, layouts, paths, qeinsum, quantize
from qjax.core.tiled_path import parse_spec
from qjax.nn import TransformerConfig
from qjax.nn.report import einsum_layers

TARGETS = ('v5e-1', 'v6e-1', 'h200')
CONTEXT = 128

def config(layers: int) -> TransformerConfig:
  """Llama-3.2-1B's shapes (tied head), `layers` layers, bf16."""
  return TransformerConfig.llama_like(tie_embeddings=True, max_len=2048,
                                      num_layers=layers).replace(dtype='bfloat16',
                                                                 param_dtype='bfloat16')


def layer_paths(m: programs.AbstractModel, batch: int, tokens: int) -> dict:
  """{layer kind: 'path (reason)'} the model's quantized layers take at (batch, tokens)."""
  model = nnx.merge(m.graphdef, m.state)
  out = {}
  with aot.tracing_for(m.target):
    for name, layer in einsum_layers(model):
      w = layer.w.get_value()
      if not isinstance(w, QArray):
        continue
      xs, ws, _ = parse_spec(layer.spec)
      shape = [batch if c == 'B' else tokens if c == 'T' else w.shape[ws.index(c)] for c in xs]
      kind = re.sub(r'layers/\d+/', '', name)
      if kind not in out:
        c = paths.describe(layer.spec, shape, w, act_fmt=layer.quant.act_fmt,
                           path=layer.quant.path)
        out[kind] = c.path
  return out


def _row(report, m: programs.AbstractModel, program: str, kv: int, paths_: Optional[dict],
         hbm: dict) -> dict:
  return {'target': m.target, 'format': m.fmt, 'program': program,
          'compiled': report.compiled, 'error': report.error,
          'bytes': report.bytes_accessed, 'bytes_source': report.bytes_source,
          'temp': report.temp_bytes, 'flops': report.flops, 'weight_bytes': m.weight_bytes,
          'kv_bytes': kv, 'hbm_bytes': hbm.get('hbm'),
          'vmem_prefetch_bytes': hbm.get('vmem_prefetch'), 'kernels': report.kernels,
          'paths': paths_}


def compile_with_hlo(fn, args, target: str, name: str, donate=()):
  """(Report, `hbm_bytes` of its compiled HLO) of one program, compiled once."""
  spec = aot.spec_of(target)
  with aot.tracing_for(target) as (mesh, _):
    try:
      compiled = jax.jit(fn, donate_argnums=donate).lower(
          *aot.abstract_args(args, mesh)).compile()
    except Exception as e:  # pylint: disable=broad-except  (the compiler's refusal is the row)
      return aot.Report(program=name, target=target, error=f'{type(e).__name__}: {e}'), {}
  report = aot.analyze(compiled, program=name, chip=spec.chip,
                       devices_per_chip=spec.devices_per_chip)
  report.target = target
  return report, aot.hbm_traffic(compiled.as_text())


def model_rows(target: str, fmt: str, cfg: TransformerConfig, batches, prefill: int,
               say=print) -> list[dict]:
  """The decode step at each batch (and a prefill) of `fmt` on `target`."""
  t0 = time.perf_counter()
  m = programs.abstract_model(cfg, fmt, target)
  rows = []
  progs = [(programs.decode(m, b, CONTEXT), b, 1) for b in batches]
  if prefill:
    progs.append((programs.prefill(m, prefill), 1, prefill))
  for prog, b, t in progs:
    report, hbm = compile_with_hlo(prog.fn, prog.args, target, prog.name, prog.donate_argnums)
    kv = programs.cache_bytes(prog.args[3])
    rows.append(_row(report, m, prog.name, kv, None if fmt == 'bf16' else layer_paths(m, b, t),
                     hbm))
    say(f'  {target} {fmt} {prog.name}: bytes {_mb(report.bytes_accessed)} temp '
        f'{_mb(report.temp_bytes)} ({time.perf_counter() - t0:.0f} s)')
  return rows


def _mb(b) -> str:
  return '-' if b is None else f'{b / 1e6:.1f} MB'


def mlp_rows(target: str, say=print) -> list[dict]:
  """The MLP up-projection alone, bf16 against int4 g32 (bf16 scales) and g64 (f32)."""
  k, n = 2048, 8192
  rows = []
  fmts = {'int4_g32': int_format(4, group_size=32, channel_axes=(1,), scale_dtype='bfloat16'),
          'int4_g64': int_format(4, group_size=64, channel_axes=(1,))}
  for m_rows in (1, 8):
    x = jax.ShapeDtypeStruct((1, m_rows, k), jnp.bfloat16)
    base, hbm = compile_with_hlo(lambda x, w: jnp.einsum('BTD,DF->BTF', x, w),
                                 (x, jax.ShapeDtypeStruct((k, n), jnp.bfloat16)), target,
                                 f'mlp bf16 M={m_rows}')
    rows.append({'target': target, 'format': 'bf16', 'program': f'mlp M={m_rows}',
                 'bytes': base.bytes_accessed, 'hbm_bytes': hbm.get('hbm'),
                 'temp': base.temp_bytes, 'flops': base.flops,
                 'weight_bytes': k * n * 2, 'compiled': base.compiled, 'error': base.error})
    for name, fmt in fmts.items():
      with aot.tracing_for(target):
        w = jax.eval_shape(lambda fmt=fmt: layouts.to_layout(
            quantize(jnp.ones((k, n), jnp.float32), fmt), layouts.default_layout()))
        choice = paths.describe('BTD,DF->BTF', (1, m_rows, k), w).path
      r, hbm = compile_with_hlo(lambda x, w: qeinsum('BTD,DF->BTF', x, w), (x, w), target,
                                f'mlp {name} M={m_rows}')
      rows.append({'target': target, 'format': name, 'program': f'mlp M={m_rows}',
                   'bytes': r.bytes_accessed, 'hbm_bytes': hbm.get('hbm'),
                   'temp': r.temp_bytes, 'flops': r.flops,
                   'weight_bytes': k * n // 2 + (k // fmt.group_size) * n *
                   jnp.dtype(fmt.scale_dtype).itemsize, 'compiled': r.compiled,
                   'error': r.error, 'paths': {'up_proj': choice}})
      say(f'  {target} mlp {name} M={m_rows}: {_mb(r.bytes_accessed)} vs bf16 '
          f'{_mb(base.bytes_accessed)}')
  return rows


def ratios(rows: list[dict]) -> list[dict]:
  """Each row with its ratios to the bf16 row of the same target and program."""
  base = {(r['target'], r['program']): r for r in rows if r['format'] == 'bf16'}
  out = []
  for r in rows:
    b = base.get((r['target'], r['program']))
    r = dict(r)
    ok = r.get('compiled') and b and b.get('compiled')
    r['bytes_ratio'] = r['bytes'] / b['bytes'] if ok and b['bytes'] else None
    r['hbm_ratio'] = (r['hbm_bytes'] / b['hbm_bytes'] if ok and r.get('hbm_bytes') and
                      b.get('hbm_bytes') else None)
    r['flops_ratio'] = (r['flops'] / b['flops'] if ok and r.get('flops') and b.get('flops')
                        else None)
    r['temp_of_weights'] = (r['temp'] / r['weight_bytes'] if r.get('temp') is not None
                            else None)
    own = r['weight_bytes'] + r.get('kv_bytes', 0)
    r['bytes_of_own'] = r['bytes'] / own if r.get('bytes') else None
    r['hbm_of_own'] = r['hbm_bytes'] / own if r.get('hbm_bytes') else None
    out.append(r)
  return out


def markdown(rows: list[dict]) -> str:
  """The ratio table (one row per target, format and program)."""
  lines = ['| target | program | format | bytes accessed (MB) | x bf16 | HBM model (MB) | '
           'x bf16 | x own weights+KV | temp / weights | flops x bf16 | paths |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    def f(v, p=2):
      return '-' if v is None else f'{v:.{p}f}'
    kinds = r.get('paths') or {}
    shown = ', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))
    lines.append(f"| {r['target']} | {r['program']} | {r['format']} | "
                 f"{f(r['bytes'] / 1e6 if r.get('bytes') else None, 1)} | "
                 f"{f(r['bytes_ratio'])} | "
                 f"{f(r['hbm_bytes'] / 1e6 if r.get('hbm_bytes') else None, 1)} | "
                 f"{f(r['hbm_ratio'])} | {f(r['hbm_of_own'])} | "
                 f"{f(r['temp_of_weights'], 3)} | {f(r['flops_ratio'])} | {shown or '-'} |")
  return '\n'.join(lines)


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--targets', default=','.join(TARGETS))
  ap.add_argument('--formats', default=','.join(programs.FORMATS))
  ap.add_argument('--batches', default='1,8')
  ap.add_argument('--layers', type=int, default=2)
  ap.add_argument('--prefill', type=int, default=0)
  ap.add_argument('--prefill_targets', default=None,
                  help='targets that compile the prefill too (default: all of --targets)')
  ap.add_argument('--mlp', action='store_true')
  ap.add_argument('--json', default=None)
  a = ap.parse_args(argv)
  cfg = config(a.layers)
  batches = [int(b) for b in a.batches.split(',') if b]
  rows = []
  prefill_on = (a.prefill_targets or a.targets).split(',')
  for target in a.targets.split(','):
    for fmt in a.formats.split(','):
      rows += model_rows(target, fmt, cfg, batches, a.prefill if target in prefill_on else 0)
    if a.mlp:
      rows += mlp_rows(target)
  rows = ratios(rows)
  print(markdown(rows))
  if a.json:
    with open(a.json, 'w') as f:
      json.dump({'jax': jax.__version__, 'layers': a.layers, 'context': CONTEXT,
                 'toolchain': aot.toolchain.read_manifest(), 'rows': rows}, f, indent=1,
                default=str)
  return rows


if __name__ == '__main__':
  main()
