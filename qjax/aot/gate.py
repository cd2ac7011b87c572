"""The compile-for-target gate: qjax's programs compiled for a TPU and a GPU that this machine
does not have, checked, and each format's bytes recorded.

    JAX_PLATFORMS=cpu python -m qjax.aot.gate [--out results/aot_gate] [--scope ci|full]
        [--targets v5e-1,h200] [--threads 2] [--strict]

writes OUT/gate.json (per program: what it is, what the gate expects of it, and the
compiler's `Report`) and OUT/bytes.md (each format's bytes accessed against bf16 at the same
shapes). `check(record)` lists what is wrong with one record (not compiled, an expected
kernel missing, the CPU kernel's custom call present, temp over a budget); tests/aot asserts
on the JSON. Every figure is the compiler's prediction for a device that is not here. Run it
in a process of its own (the compile-only toolchains are loaded there only: `toolchain`).

Models (`models()`): Llama-, Qwen3- and Gemma-3-shaped, shrunk so that a program compiles in
seconds; Gemma 3 keeps its head dim 256, one kv head and a local (sliding-window) and a global
layer. Formats: `qjax.aot.programs.FORMATS`. Programs (`KINDS`): prefill, the decode step at
B = 1 and 8, the decode loop, the serving engine's step (at its decode bucket, and at a mixed
bucket of decodes beside a prompt chunk: `MIXED`) and decode block over an int8 paged KV, a
QAT step, and every Pallas kernel qjax ships (`_programs_kernels`), with one kernel Mosaic
rejects as a negative control. A mixed step on the TPU must call the ragged paged kernel
exactly once per layer and the decode one never; on the GPU, Triton once per layer (its
decode rows) beside the scan (its chunk).

Scopes. 'full' compiles every model x format x program on every target, and the mixed step
of every model on both (285 programs, ~20 minutes of a 2-core CPU). 'ci' (what `make test`
runs, 79 programs, ~3 minutes of one core) covers every axis without the whole product
(`CI_TPU`, `CI_GPU`, `MIXED`): on both targets every program on the Llama shape, its decode
step in every format (the bytes record), every kernel and every model; on the TPU Gemma 3's
decode step in every format and its every program but the QAT step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import pathlib
import resource
import sys
import threading
import time
from typing import Callable, Optional

import jax

from qjax.aot import _programs as programs
from qjax.aot import _programs_kernels as kernel_programs
from qjax.aot import _programs_serving as serving
from qjax.aot import _programs_train as train
from qjax.aot import _targets
from qjax.aot import toolchain
from qjax.kernels import paged_attention as pa
from qjax.nn import TransformerConfig
from qjax.nn.config import num_params

TARGETS = ('v5e-1', 'h200')
KINDS = ('prefill', 'decode_b1', 'decode_b8', 'decode_loop', 'engine_step', 'engine_block',
         'qat_step')
QUANTIZED = tuple(f for f in programs.FORMATS if f != 'bf16')
PREFILL_LEN, CONTEXT, LOOP_STEPS = 128, 64, 4
CPU_KERNEL = 'qjax_cpu_kernel'  # `_hlo.KERNEL_FAMILIES`: the CPU kernel's custom call
RAGGED = 'qjax_ragged_paged_attention_mosaic'  # `kernels.ragged_paged`'s kernel name

ALL = programs.FORMATS
# Decode at 8 rows and prefill where each format's large-M path differs: bf16 (the bytes
# record's reference), int4 in groups, and W8A8's int8 dots (and on the TPU int8's kernel).
# tests/aot/test_qmm_targets.py compiles every format's decode at 1 and 8 rows at real widths.
WIDE = ('bf16', 'int4_g128', 'w8a8')
# The 'ci' scope: the formats of each (model, program), per target platform. Llama-shaped:
# every program on both targets, the decode step in every format (the bytes record), decode
# at 8 rows and prefill in WIDE, the others in one format each. Gemma 3: every program but the
# QAT step on the TPU (its head dim 256, one kv head, local and global layers and ring of
# pages reach splash and the paged kernel), its decode step in every format. Qwen3 (Llama's
# shape with q/k norms and a tied head): prefill, and the decode step in the head's formats
# whose paths differ. Quantized formats rotate over the programs compiled once, so each meets
# several.
CI_TPU = {
    'llama': {'prefill': WIDE + ('int8',), 'decode_b1': ALL, 'decode_b8': WIDE,
              'decode_loop': ('int4',), 'engine_step': ('int8',), 'engine_block': ('w8a8',),
              'qat_step': ('int4_g128',)},
    'qwen3': {'prefill': ('int8',), 'decode_b1': ('bf16', 'int4', 'fp8')},
    'gemma3': {'prefill': ('int4_g128',), 'decode_b1': ALL, 'decode_b8': ('w8a8',),
               'decode_loop': ('int8',), 'engine_step': ('fp8',), 'engine_block': ('int4',)},
}
# A GPU compile costs this CPU about three TPU ones (XLA's GPU compiler runs Triton and ptxas
# for each fusion and each Pallas kernel: an int4 program, whose every projection takes the
# Triton kernel, costs ~5x a bf16 one), so on the GPU Llama's prefill and decode at 8 rows are
# compiled in WIDE only, the other models' decode step once, and Gemma 3's paged geometry
# reaches the Triton kernel as a kernel program.
CI_GPU = {
    'llama': {'prefill': WIDE, 'decode_b1': ALL, 'decode_b8': WIDE,
              'decode_loop': ('fp8',), 'engine_step': ('int8',), 'engine_block': ('w8a8',),
              'qat_step': ('int4',)},
    'qwen3': {'decode_b1': ('int4_g128',)},
    'gemma3': {'decode_b1': ('int8',)},
}


# The engine's step at the mixed bucket (decodes beside one chunk), int8 pages, per target
# platform in the 'ci' scope: {model: weight formats} (formats whose models other programs
# build too). On the TPU one layer (Llama) and a ring layer beside a global one (Gemma 3); on
# the GPU the decode kernel beside the scan.
MIXED = {'tpu': {'llama': ('int8',), 'gemma3': ('fp8',)}, 'gpu': {'llama': ('int8',)}}


def models() -> dict[str, TransformerConfig]:
  """The gate's three model shapes (bf16, vocab 512, a context of 512)."""
  small = dict(vocab_size=512, max_len=512, dtype='bfloat16', param_dtype='bfloat16')
  llama = TransformerConfig.llama_like(d_model=256, num_layers=1, num_heads=4, num_kv_heads=2,
                                       head_dim=128, d_ff=512, **small)
  return {
      'llama': llama,  # untied head, GQA
      'qwen3': llama.replace(qk_norm=True, tie_embeddings=True, rope_base=1_000_000.0,
                             rms_eps=1e-6),
      # A local layer (window 64 < the prefill's 128 tokens, so its mask and the engine's
      # ring of pages are exercised) and a global one.
      'gemma3': TransformerConfig.gemma3_270m(d_model=256, num_layers=2, d_ff=512,
                                              global_every=2, sliding_window=64, **small),
  }


@dataclasses.dataclass(frozen=True)
class Job:
  """One program for one target and what the gate expects of it.

  Attributes:
    kind: a `KINDS` entry, or 'kernel'.
    target: a `qjax.aot.TARGETS` name.
    model, fmt: the model shape and weight format (None for kernels).
    variant: which kernel program ('splash', 'paged int8', 'qmm int4 g128', ...), or 'mixed'
      for the engine step at its mixed bucket.
    kernels: substrings of kernel names (`Report.kernel_names`) that must be called.
    kernel_count: (substring, n) pairs: the calls of kernels so named must number exactly n
      (once per layer, or 0: a kernel that must not run).
    error: where the compiler is expected to refuse: a substring of its message.
    why: why those expectations (or why a kernel is not expected).
  """

  kind: str
  target: str
  model: Optional[str] = None
  fmt: Optional[str] = None
  variant: str = ''
  kernels: tuple = ()
  kernel_count: tuple = ()
  error: Optional[str] = None
  why: str = ''


def _platform(target: str) -> str:
  return _targets.spec_of(target).platform


def _triton() -> bool:
  return pa.backend_available('triton')


def _mixed_job(target: str, model: str, fmt: str) -> Job:
  """The engine step at its mixed bucket: the ragged kernel once per layer on one TPU (and no
  decode kernel); on one GPU the Triton decode kernel once per layer, no ragged kernel."""
  layers = models()[model].num_layers
  if _platform(target) == 'tpu':
    return Job('engine_step', target, model, fmt, 'mixed', (RAGGED,),
               ((RAGGED, layers), ('qjax_paged_attention_mosaic', 0)),
               why='one TPU: every row of a mixed step in one ragged kernel call per layer')
  if not _triton():
    return Job('engine_step', target, model, fmt, 'mixed', kernel_count=((RAGGED, 0),),
               why=f'jax {jax.__version__} has no Pallas Triton backend: the XLA scan')
  triton = 'qjax_paged_attention_triton'
  return Job('engine_step', target, model, fmt, 'mixed', (triton,),
             ((triton, layers), (RAGGED, 0)),
             why='one NVIDIA GPU: decode rows through Triton, the chunk through the scan')


def _model_job(kind: str, target: str, model: str, fmt: str) -> Job:
  """A model program's job with its expected kernels."""
  tpu = _platform(target) == 'tpu'
  kernels, why = (), ''
  if kind == 'prefill' and tpu:
    kernels, why = ('splash',), 'TPU prefill attends with the splash kernel'
  elif kind in ('engine_step', 'engine_block'):
    if tpu:
      kernels, why = ('qjax_paged_attention_mosaic',), 'one TPU: the Mosaic paged kernel'
    elif _triton():
      kernels, why = ('qjax_paged_attention_triton',), 'one NVIDIA GPU: the Triton paged kernel'
    else:
      why = f'jax {jax.__version__} has no Pallas Triton backend: the XLA scan'
  return Job(kind, target, model, fmt, kernels=kernels, why=why)


def _kernel_jobs(target: str) -> list[Job]:
  tpu = _platform(target) == 'tpu'
  backend = kernel_programs.paged_backend(target)
  jobs = []
  if tpu:
    jobs += [Job('kernel', target, variant='ragged int8', kernels=(RAGGED,),
                 kernel_count=((RAGGED, 1),), why='a mixed step in one call'),
             Job('kernel', target, variant='splash', kernels=('splash',)),
             Job('kernel', target, variant='splash window', kernels=('splash',)),
             Job('kernel', target, variant='mosaic_rejected', error='infer-vector-layout',
                 why='negative control: an (8, 130) -> (130, 8) shape cast Mosaic rejects')]
  if tpu or _triton():
    paged = (f'qjax_paged_attention_{backend}',)
    for kv in kernel_programs.KV_STORAGE:
      jobs.append(Job('kernel', target, variant=f'paged {kv}', kernels=paged))
    jobs.append(Job('kernel', target, variant='paged int8 H256 ring', kernels=paged,
                    why="Gemma 3's geometry: head dim 256, one kv head, a ring of pages"))
    for bits in (8, 4):
      for group in (None, 128, 64):
        label = f'qmm int{bits} ' + ('per channel' if group is None else f'g{group}')
        if tpu and group == 64:
          jobs.append(Job('kernel', target, variant=label, error='divisible by 8 and 128',
                          why='a (16, 64) block breaks the TPU (8, 128) tiling rule; the '
                          'quantized-matmul work is to fix it'))
        else:
          jobs.append(Job('kernel', target, variant=label, kernels=('qmm',)))
  return jobs


def jobs(scope: str = 'ci', targets=TARGETS) -> list[Job]:
  """The gate's jobs (module docstring's scopes)."""
  if scope not in ('ci', 'full'):
    raise ValueError(f"qjax.aot.gate: scope {scope!r} is unknown; use 'ci' or 'full'.")
  out = []
  for target in targets:
    for model in models():
      for kind in KINDS:
        plan = CI_TPU if _platform(target) == 'tpu' else CI_GPU
        fmts = ALL if scope == 'full' else plan[model].get(kind, ())
        out += [_model_job(kind, target, model, f) for f in fmts]
    mixed = MIXED.get(_platform(target), {})
    for model in models():
      fmts = mixed.get(model, ())
      fmts = tuple(dict.fromkeys(('int8',) + fmts)) if scope == 'full' else fmts
      out += [_mixed_job(target, model, f) for f in fmts]
    out += _kernel_jobs(target)
  return out


class _Models:
  """Abstract models built once per (model, format, target), shared by the threads."""

  def __init__(self):
    self._lock = threading.Lock()
    self._built: dict = {}

  def get(self, model: str, fmt: str, target: str) -> programs.AbstractModel:
    key = (model, fmt, target)
    with self._lock:
      event = self._built.get(key)
      if event is None:
        self._built[key] = event = [threading.Event(), None]
        owner = True
      else:
        owner = False
    if owner:
      try:
        event[1] = programs.abstract_model(models()[model], fmt, target)
      except Exception as e:  # pylint: disable=broad-except  (re-raised by every reader)
        event[1] = e
      event[0].set()
    event[0].wait()
    if isinstance(event[1], Exception):
      raise event[1]
    return event[1]


def _program(job: Job, built: _Models) -> tuple[programs.Program, dict]:
  """The job's Program and what it holds: its weights as stored and as bf16 (the model's size
  before quantization), its KV cache or page pools (bytes; {} for kernels and the QAT step)."""
  if job.kind == 'kernel':
    kp = kernel_programs
    v = job.variant
    if v.startswith('splash'):
      return kp.splash_attention(window=64 if 'window' in v else None), {}
    if v == 'mosaic_rejected':
      return kp.mosaic_rejected(), {}
    if v.startswith('ragged'):
      return kp.ragged_paged_attention(v.split()[1]), {}
    if v == 'paged int8 H256 ring':
      return kp.paged_attention(job.target, 'int8', heads=(4, 1), head_dim=256,
                                pages_per_row=6, window=64, ring=True), {}
    if v.startswith('paged'):
      return kp.paged_attention(job.target, v.split()[1]), {}
    bits, group = v.split()[1:3] if v.startswith('qmm') else (None, None)
    return kp.qmm(int(bits[3:]), None if group == 'per' else int(group[1:])), {}
  if job.kind == 'qat_step':
    return train.qat_train_step(models()[job.model], job.fmt, job.target), {}
  m = built.get(job.model, job.fmt, job.target)
  held = {'weight_bytes': m.weight_bytes, 'bf16_weight_bytes': 2 * num_params(m.config)}
  if job.kind in ('engine_step', 'engine_block'):
    config = serving.default_config(m)
    held['kv_bytes'] = serving.engine_cache_bytes(m, config)
    if job.variant == 'mixed':
      return serving.engine_step(m, config, mixed=True), held
    build: Callable = (serving.engine_step if job.kind == 'engine_step'
                       else serving.engine_decode_block)
    return build(m, config), held
  if job.kind == 'prefill':
    prog = programs.prefill(m, PREFILL_LEN)
  elif job.kind == 'decode_loop':
    prog = programs.decode_loop(m, 1, CONTEXT, LOOP_STEPS)
  else:
    prog = programs.decode(m, 1 if job.kind == 'decode_b1' else 8, CONTEXT)
  held['kv_bytes'] = programs.cache_bytes(prog.args[-1] if job.kind != 'decode_loop'
                                          else prog.args[1])
  return prog, held


def run_job(job: Job, built: Optional[_Models] = None) -> dict:
  """Compile one job; its record (the job, the bytes held, the compiler's Report)."""
  built = built or _Models()
  record = {'job': dataclasses.asdict(job)}
  t0 = time.perf_counter()
  try:
    prog, held = _program(job, built)
  except Exception as e:  # pylint: disable=broad-except  (a program that cannot be built fails)
    record.update(program=job.variant or job.kind, held={},
                  report={'compiled': False, 'error': f'building the program: '
                          f'{type(e).__name__}: {e}', 'compile_s': time.perf_counter() - t0})
    return record
  report = prog.compile(job.target).to_dict()
  report.pop('toolchain', None)  # once per file, not per record
  record.update(program=prog.name, held=held, report=report)
  return record


PROBLEMS = ('compile', 'kernel', 'cpu_kernel', 'temp')  # what `check` reports, by category


def check(record: dict, temp_budget: Optional[float] = None) -> list[tuple[str, str]]:
  """What is wrong with one record, as (category, message) pairs ([] when nothing):
  'compile': not compiled (or compiled where a refusal was expected, or refused with another
  message); 'kernel': an expected kernel not called, or called another number of times than
  `Job.kernel_count` says; 'cpu_kernel': the CPU kernel's custom
  call in a TPU/GPU program; 'temp': temp bytes over `temp_budget`."""
  job, rep = record['job'], record['report']
  where = f"{job['target']} {record['program']}" + (
      f" ({job['model']}, {job['fmt']})" if job['model'] else '')
  if job['error']:
    if rep['compiled']:
      return [('compile', f'{where}: compiled, but the compiler was expected to refuse it '
               f"({job['error']!r}: {job['why']})")]
    if job['error'] not in (rep['error'] or ''):
      return [('compile', f"{where}: refused with another message than {job['error']!r}: "
               f"{rep['error']}")]
    return []
  if not rep['compiled']:
    return [('compile', f"{where}: did not compile: {rep['error']}")]
  problems = []
  names = rep.get('kernel_names') or {}
  for want in job['kernels']:
    if not any(want in n for n in names):
      problems.append(('kernel', f'{where}: no {want!r} kernel called ({job["why"]}); '
                       f'kernels called: {sorted(names) or "none"}'))
  for want, count in job.get('kernel_count', ()):
    got = sum(c for n, c in names.items() if want in n)
    if got != count:
      problems.append(('kernel', f'{where}: {got} calls of {want!r} kernels, expected {count} '
                       f'({job["why"]}); kernels called: {names or "none"}'))
  if CPU_KERNEL in rep['kernels']:
    problems.append(('cpu_kernel', f"{where}: calls the CPU kernel ({rep['custom_calls']}); a "
                     'path decision read the host, not the target (qjax.target)'))
  if temp_budget is not None and rep['temp_bytes'] > temp_budget:
    problems.append(('temp', f"{where}: temp {rep['temp_bytes']:,} bytes over its budget "
                     f'{temp_budget:,.0f}'))
  return problems


def _bytes(rep: dict) -> tuple:
  """(bytes, what counted them) of a report: its HBM traffic (the roofline's bytes), else
  XLA's bytes accessed."""
  if rep.get('hbm_traffic') is not None:
    return float(rep['hbm_traffic']), 'hbm traffic from the compiled HLO'
  return rep['bytes_accessed'], rep['bytes_source']


def bytes_vs_bf16(records: list[dict]) -> list[dict]:
  """Each quantized format's bytes (`_bytes`) against bf16's at the same model, program and
  target (the compiler's figures; where both compiled)."""
  base = {}
  for r in records:
    j = r['job']
    if j['fmt'] == 'bf16' and r['report']['compiled']:
      base[(j['model'], j['kind'], j['variant'], j['target'])] = _bytes(r['report'])[0]
  rows = []
  for r in records:
    j, rep = r['job'], r['report']
    ref = base.get((j['model'], j['kind'], j['variant'], j['target']))
    if j['fmt'] in (None, 'bf16') or ref is None or not rep['compiled']:
      continue
    got, source = _bytes(rep)
    rows.append({'model': j['model'], 'program': j['kind'], 'target': j['target'],
                 'format': j['fmt'], 'bytes': got, 'bf16_bytes': ref, 'ratio': got / ref,
                 'source': source})
  return rows


def bytes_markdown(rows: list[dict]) -> str:
  """`bytes_vs_bf16` as a table: format x (model, program, target)."""
  cols = sorted({(r['model'], r['program'], r['target']) for r in rows},
                key=lambda c: (c[0], KINDS.index(c[1]), c[2]))
  if not cols:
    return 'No format compiled beside bf16 at the same shapes.\n'
  cell = {(r['format'], r['model'], r['program'], r['target']): r['ratio'] for r in rows}
  sources = sorted({f"{r['target']}: {r['source']}" for r in rows})
  lines = ['Bytes against bf16 at the same shapes: compiler predictions '
           f"({'; '.join(sources)}).", '',
           '| format | ' + ' | '.join(f'{m} {p} {t}' for m, p, t in cols) + ' |',
           '|---|' + '---|' * len(cols)]
  for fmt in QUANTIZED:
    vals = [cell.get((fmt,) + c) for c in cols]
    if any(v is not None for v in vals):
      lines.append(f'| {fmt} | ' + ' | '.join('-' if v is None else f'{v:.2f}' for v in vals)
                   + ' |')
  return '\n'.join(lines) + '\n'


def _cpu_s() -> float:
  own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
      resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run(job_list: list[Job], threads: int = 2, say=print) -> dict:
  """Compile every job (`threads` at a time: XLA compiles outside the GIL) and return the
  gate's record: the records in job order, the bytes table, the time taken."""
  t0, c0 = time.perf_counter(), _cpu_s()
  for target in sorted({j.target for j in job_list}):
    _targets.devices(target)  # the toolchains come up here, before any thread
  built = _Models()
  # The slowest first, so no thread is left with one long compile at the end.
  cost = {'engine_step': 0, 'engine_block': 0, 'qat_step': 1, 'prefill': 2}
  order = sorted(range(len(job_list)), key=lambda i: (
      _platform(job_list[i].target) == 'tpu', cost.get(job_list[i].kind, 3)))
  records: list = [None] * len(job_list)
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    futures = {pool.submit(run_job, job_list[i], built): i for i in order}
    for done in concurrent.futures.as_completed(futures):
      i = futures[done]
      records[i] = done.result()
      rep = records[i]['report']
      say(f"qjax.aot.gate: {job_list[i].target:6s} {records[i]['program']:45s} "
          f"{job_list[i].model or '':7s} {job_list[i].fmt or '':10s} "
          f"{'compiled' if rep['compiled'] else 'REFUSED'} {rep['compile_s']:.1f}s")
  return {'jax': jax.__version__, 'python': sys.version.split()[0],
          'toolchain': toolchain.read_manifest(), 'threads': threads,
          'wall_s': time.perf_counter() - t0, 'cpu_s': _cpu_s() - c0, 'records': records,
          'bytes_vs_bf16': bytes_vs_bf16(records)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m qjax.aot.gate', description=__doc__.split(
      '\n')[0])
  parser.add_argument('--out', default='results/aot_gate', help='folder for gate.json, bytes.md')
  parser.add_argument('--scope', default='ci', choices=('ci', 'full'))
  parser.add_argument('--targets', default=','.join(TARGETS))
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument('--strict', action='store_true',
                      help='exit 1 where a record fails `check` (no temp budgets)')
  args = parser.parse_args(argv)
  result = run(jobs(args.scope, tuple(args.targets.split(','))), args.threads)
  result['scope'] = args.scope
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'gate.json').write_text(json.dumps(result, indent=1, default=str))
  (out / 'bytes.md').write_text(bytes_markdown(result['bytes_vs_bf16']))
  problems = [msg for r in result['records'] for _, msg in check(r)]
  print(f"qjax.aot.gate: {len(result['records'])} programs in {result['wall_s']:.0f} s "
        f"({result['cpu_s']:.0f} s of CPU); {len(problems)} problems; wrote {out}/gate.json, "
        'bytes.md')
  for p in problems:
    print('  ' + p)
  return 1 if problems and args.strict else 0


if __name__ == '__main__':
  sys.exit(main())
