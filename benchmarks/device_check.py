"""The device check: what qjax costs on the machine it runs on, written as JSON, markdown, PNG.

    python -m benchmarks.device_check [--smoke] [--out=results/device_check]
        [--models=llama32_1b,gemma3_270m]
        [--formats=bf16,int4,int4_pallas,int4_packed,w8a8,int8,fp8,fp8xfp8]
        [--batches=1,8,64] [--budget_s=340]

For each model shape (synthetic weights: the cost, not the quality) and weight format it
measures, on the default backend:
  * prefill: one (1, P) prompt through `generate.greedy_step` (P = 512), median of 3;
  * decode, host loop: `generate.greedy_step` called once per token from Python, as a user's
    loop does (a 128-token context, 64 steps), at the `--host_batches` (default 1: each is
    one more executable to compile per row);
  * decode, device loop: `generate.decode_steps`, the same step run `steps` times inside one
    jitted `lax.while_loop` (what `greedy_generate` runs), so the time is the device's,
    without per-step dispatch (what the step itself costs);
  * weight bytes (the state's device buffers: packed codes count what they hold), the fraction
    of the HBM-bandwidth bound each decode step reaches ((weight bytes + the KV bytes a step
    must read) / the chip's bandwidth from `qjax.costmodel`, over the step's time), device
    memory from `jax.Device.memory_stats()` (on CPU: none, said so), the compiled decode
    step's temp bytes (`qjax.eval.memory.compiled_memory`), and the compile seconds of the
    row's executables.
  * HF transformers bf16 on the same device in the same run, when `torch` and `transformers`
    import and torch sees the device (`generate` timed as a difference of two lengths).
`--budget_s` (default 340 s: under 6 minutes) bounds the whole check. Rows run in the order
given (every model's rows, then the comparison forms int4_pallas, int4_packed and fp8xfp8 of
every model: `row_order`) while the longest row so far still fits before the attention section's
share (`--attention_budget_s`, 90 s) of it; the rest are listed as not run. Results are written
after every row (`device_check.json`), so a run stopped from outside keeps what it measured.
Then the attention section (`--attention=yes`, default), within what is left of the budget:
`benchmarks/attention_timing.py`'s prefill and paged decode attention, before and after the
fused forms, at 2k/8k/32k context. `--smoke`: tiny shapes of both models, batches 1 and 2, a
few steps: proves every row runs, on CPU, in about a minute (tests/benchmarks runs it).

Model shapes: 'llama32_1b' is Llama 3.2 1B (1.24 B parameters, tied head, GQA 32/8, head_dim
64); 'gemma3_270m' is Gemma 3 270M. int4 groups are 128 (o_proj's groups run along its
flattened N*H contraction, two heads of 64 per group on llama32_1b).

The int4 rows compare the ways a 4-bit weight reaches the matmul (docs/quantized_matmul.md):
'int4' in the backend's default layout (native jnp.int4 codes on GPU/TPU, path 'native'),
'int4_pallas' (packed codes, the Pallas kernel at decode shapes) and 'int4_packed' (packed
codes unpacked by XLA ops, path 'dequant': the form before native codes). Grouped native
weights fuse into the GEMM on GPU only with
XLA_FLAGS=--xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true: run the check
once with and once without it to see what the flag buys.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import attention_timing
from benchmarks.budget import Budget
from qjax import costmodel, fp8_format, int_format
from qjax.core import choose_path, layouts
from qjax.eval import memory as qmemory
from qjax.eval import report
from qjax.eval.process import device_memory
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, generate, kvcache
from qjax.nn import quantize_model
from qjax.nn.attention import kv_format

FORMATS = ('bf16', 'int4', 'int4_pallas', 'int4_packed', 'w8a8', 'int8', 'fp8', 'fp8xfp8')
# Forms measured to compare with the rows above them (two other ways an int4 weight reaches the
# matmul, fp8 activations): they run after every model's other rows, so a budget that ends the
# check early cuts these first.
COMPARISON_FORMATS = ('int4_pallas', 'int4_packed', 'fp8xfp8')
DESCRIPTIONS = {
    'bf16': 'bfloat16 weights',
    'int8': 'int8 per-channel, weight-only',
    'int4': 'int4 grouped (see group), weight-only, the backend default layout and path',
    'int4_pallas': 'int4 grouped, weight-only, packed codes on the Pallas kernel at decode',
    'int4_packed': "int4 grouped, weight-only, packed codes dequantized by XLA ops ('dequant')",
    'w8a8': 'int8 per-channel weights x dynamic int8 activations',
    'fp8': 'fp8 e4m3 per-channel, weight-only',
    'fp8xfp8': 'fp8 e4m3 per-channel weights x dynamic fp8 activations',
}
MODELS = ('llama32_1b', 'gemma3_270m')
# Device kinds (`jax.Device.device_kind`, lower case) -> `qjax.costmodel` chip presets.
CHIP_OF_KIND = (('h200', 'h200'), ('h100', 'h100'), ('v5p', 'tpu_v5p'), ('v5 lite', 'tpu_v5e'),
                ('v5e', 'tpu_v5e'), ('v4', 'tpu_v4'))


def model_config(name: str, smoke: bool) -> TransformerConfig:
  """The model shape `name` in bf16 (tiny layers and vocab in smoke mode)."""
  if name == 'llama32_1b':
    cfg = TransformerConfig.llama_like(tie_embeddings=True, max_len=2048)
  elif name == 'gemma3_270m':
    cfg = TransformerConfig.gemma3_270m(max_len=2048)
  else:
    raise ValueError(f'device_check: model {name!r} is unknown; use one of {MODELS}.')
  cfg = cfg.replace(dtype='bfloat16', param_dtype='bfloat16')
  if smoke:
    cfg = cfg.replace(vocab_size=512, d_model=128, num_layers=2, d_ff=256, max_len=256,
                      head_dim=64 if name == 'llama32_1b' else 32,
                      num_heads=4, num_kv_heads=2 if name == 'llama32_1b' else 1)
  return cfg


def row_order(models, formats, hf: bool) -> list[tuple[str, str]]:
  """(model, format) in the order the rows run: for every model, HF transformers (when `hf`)
  and the formats not in COMPARISON_FORMATS, in the order given; then the comparison forms."""
  main = [(m, f) for m in models
          for f in (['hf-bf16'] if hf else []) + [f for f in formats
                                                  if f not in COMPARISON_FORMATS]]
  return main + [(m, f) for m in models for f in formats if f in COMPARISON_FORMATS]


def int4_group(cfg: TransformerConfig) -> int:
  """128 where every projection's (flattened) contraction allows it, else the largest power of
  two that divides them all (o_proj contracts N*H: groups of 128 span two heads of 64)."""
  return math.gcd(128, cfg.num_heads * cfg.head_dim, cfg.d_model, cfg.d_ff)


# The int4 variants: (QuantPolicy.path, quantize_model layout); None = the backend's default.
INT4_VARIANTS = {'int4': ('auto', None), 'int4_pallas': ('pallas', 'packed'),
                 'int4_packed': ('dequant', 'packed')}


def policy(fmt: str, cfg: TransformerConfig) -> Optional[QuantPolicy]:
  """Every weight (the tied embedding / head included) in `fmt`; None for bf16."""
  if fmt == 'bf16':
    return None
  int4 = int_format(4, group_size=int4_group(cfg))
  weights = {'int8': int_format(8), 'w8a8': int_format(8), 'fp8': fp8_format('e4m3'),
             'fp8xfp8': fp8_format('e4m3'), **{v: int4 for v in INT4_VARIANTS}}
  if fmt not in weights:
    raise ValueError(f'device_check: format {fmt!r} is unknown; use one of {FORMATS}.')
  act = {'w8a8': int_format(8), 'fp8xfp8': fp8_format('e4m3')}.get(fmt)
  path = INT4_VARIANTS.get(fmt, ('auto', None))[0]
  return QuantPolicy((QuantRule('.*', weights[fmt], act=act),), path=path)


def chip_for(device) -> Optional[costmodel.Chip]:
  """The costmodel preset for `device` (None on CPU or an unknown kind)."""
  kind = device.device_kind.lower()
  for key, chip in CHIP_OF_KIND:
    if key in kind and device.platform != 'cpu':
      return costmodel.get_chip(chip)
  return None


def _version(pkg: str) -> Optional[str]:
  try:
    return importlib.metadata.version(pkg)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment() -> dict:
  """Device, driver and versions."""
  d = jax.devices()[0]
  env = {'date_utc': time.strftime('%Y-%m-%d %H:%M', time.gmtime()),
         'backend': jax.default_backend(), 'device_kind': d.device_kind,
         'device_count': jax.device_count(), 'python': sys.version.split()[0],
         'platform': platform.platform(), 'cpu_count': os.cpu_count(),
         'versions': {p: _version(p) for p in ('jax', 'jaxlib', 'flax', 'numpy', 'torch',
                                               'transformers', 'jax-cuda12-plugin',
                                               'jax-cuda13-plugin', 'libtpu')},
         'xla_flags': os.environ.get('XLA_FLAGS', '')}
  stats = device_memory(d)
  if stats:
    env['device_memory_limit'] = stats['limit']
  if d.platform == 'gpu':
    try:
      env['nvidia_smi'] = subprocess.run(
          ['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm',
           '--format=csv,noheader'], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
      env['nvidia_smi'] = f'unavailable: {e}'
  chip = chip_for(d)
  env['chip'] = None if chip is None else {'name': chip.name, 'hbm_bw': chip.hbm_bw}
  return env


def _sync(x):
  return jax.block_until_ready(x)


def _state_bytes(model) -> int:
  """Bytes the device holds (`Array.nbytes` counts one byte per jnp.int4 element even where
  XLA packs two in a byte)."""
  return sum(x.on_device_size_in_bytes() if hasattr(x, 'on_device_size_in_bytes') else x.nbytes
             for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, 'nbytes'))


def kv_bytes_per_token(cfg: TransformerConfig, model) -> int:
  """Bytes of K and V one token adds over every layer (the cache's own format)."""
  cache = kvcache.init_cache(cfg, 1, 1, fmt=kv_format(model), ring=False)
  return kvcache.nbytes(cache)


@dataclasses.dataclass
class Protocol:
  prefill: int
  prompt: int
  steps: int
  batches: tuple
  reps: int
  host_batches: tuple = (1,)


def _decode_cache(cfg, model, batch: int, p: Protocol):
  """A cache holding a `p.prompt`-token context (values do not change the cost)."""
  cache = kvcache.init_cache(cfg, batch, p.prompt + 2 * p.steps + 2, fmt=kv_format(model))
  return kvcache.advance(cache, p.prompt)


def run_qjax(model_name: str, fmt: str, p: Protocol, smoke: bool, threads: int) -> dict:
  """One qjax row: build, quantize, compile (in `threads` threads), time."""
  dev = jax.devices()[0]
  cfg = model_config(model_name, smoke)
  mem0 = device_memory(dev)
  t0 = time.perf_counter()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  pol = policy(fmt, cfg)
  layout = INT4_VARIANTS.get(fmt, ('auto', None))[1] or layouts.default_layout()
  if pol is not None:
    model = quantize_model(model, pol, layout=layout)[0]
  _sync(nnx.state(model))
  gc.collect()
  row = {'model': model_name, 'format': fmt, 'description': DESCRIPTIONS[fmt],
         'group': int4_group(cfg) if fmt in INT4_VARIANTS else None,
         'layout': None if pol is None else layout,
         'path': None if pol is None else (pol.path if pol.path != 'auto' else choose_path(
             pol.rules[0].weight, pol.rules[0].act, layout=layout)),
         'build_s': time.perf_counter() - t0, 'weight_bytes': _state_bytes(model),
         'kv_bytes_per_token': kv_bytes_per_token(cfg, model)}
  mem1 = device_memory(dev)
  if mem0 and mem1:
    row['device_bytes_in_use_after_load'] = mem1['in_use'] - mem0['in_use']
  rng = np.random.default_rng(0)
  prefill_ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, p.prefill)), jnp.int32)
  first = {b: jnp.asarray(rng.integers(3, cfg.vocab_size, (b,)), jnp.int32) for b in p.batches}

  def prefill_once():
    cache = kvcache.init_cache(cfg, 1, p.prefill + 1, fmt=kv_format(model))
    t = time.perf_counter()
    _sync(generate.greedy_step(model, prefill_ids, cache)[0])
    return time.perf_counter() - t

  def host_loop(b: int, steps: int) -> float:
    cache, tok = _decode_cache(cfg, model, b, p), first[b]
    t = time.perf_counter()
    for _ in range(steps):
      tok, cache = generate.greedy_step(model, tok[:, None], cache)
    _sync(tok)
    return time.perf_counter() - t

  def device_loop(b: int) -> float:
    cache = _decode_cache(cfg, model, b, p)
    _sync(cache)
    t = time.perf_counter()
    _sync(generate.decode_steps(model, first[b], cache, p.steps)[0])
    return time.perf_counter() - t

  def step_memory():
    row['decode_step_temp_bytes'] = qmemory.compiled_memory(
        model, p.batches[0], 1, p.prompt + 2 * p.steps + 2)['temp']

  # Warm-up = compile: every executable of the row once, in parallel threads (XLA compiles
  # outside the GIL); the row's compile seconds are this phase's wall time.
  host_batches = [b for b in p.batches if b in p.host_batches]
  jobs = [prefill_once, step_memory] + [functools.partial(host_loop, b, 1)
                                        for b in host_batches] + [
      functools.partial(device_loop, b) for b in p.batches]
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    list(pool.map(lambda f: f(), jobs))
  row['compile_s'] = time.perf_counter() - t0
  row['compiled_executables'] = len(jobs)

  row['prefill_tokens'] = p.prefill
  row['prefill_tok_s'] = p.prefill / statistics.median(prefill_once() for _ in range(p.reps))
  chip = chip_for(dev)
  context = p.prompt + p.steps / 2
  for b in p.batches:
    dev_s = min(device_loop(b) for _ in range(2)) / p.steps
    row[f'b{b}'] = cell = {'device_loop_ms': 1e3 * dev_s, 'device_loop_tok_s': b / dev_s}
    if b in host_batches:
      host_s = min(host_loop(b, p.steps) for _ in range(2)) / p.steps
      cell.update(host_loop_ms=1e3 * host_s, host_loop_tok_s=b / host_s)
    if chip is not None:
      bound = (row['weight_bytes'] + b * context * row['kv_bytes_per_token']) / chip.hbm_bw
      cell['bound_ms'] = 1e3 * bound
      cell['hbm_fraction_device_loop'] = bound / dev_s
      if 'host_loop_ms' in cell:
        cell['hbm_fraction_host_loop'] = bound / host_s
  mem2 = device_memory(dev)
  if mem2:
    row['device_peak_bytes_so_far'] = mem2['peak']
  row['memory_source'] = 'device memory_stats()' if mem2 else 'none on this backend'
  return row


def hf_available() -> Optional[str]:
  """Why HF transformers cannot run here (None: it can, on the same device as jax)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return f'not importable ({e.name})'
  if jax.default_backend() == 'gpu' and not torch.cuda.is_available():
    return 'torch sees no GPU'
  return None


def _hf_model(model_name: str, smoke: bool):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cfg = model_config(model_name, smoke)
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, tie_word_embeddings=True)
  if model_name == 'llama32_1b':
    hf_cfg, cls = transformers.LlamaConfig(**common, rope_theta=cfg.rope_base), \
        transformers.LlamaForCausalLM
  else:
    hf_cfg, cls = transformers.Gemma3TextConfig(**common, sliding_window=cfg.sliding_window), \
        transformers.Gemma3ForCausalLM
  device = 'cuda' if jax.default_backend() == 'gpu' else 'cpu'
  with torch.device(device):
    model = cls(hf_cfg).to(torch.bfloat16).eval()
  return model, device


def run_hf(model_name: str, p: Protocol, smoke: bool) -> dict:
  """HF transformers bf16, eager: prefill forward and `generate` on the same device."""
  import torch  # pylint: disable=g-import-not-at-top
  model, device = _hf_model(model_name, smoke)
  cfg = model_config(model_name, smoke)
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
  rng = np.random.default_rng(0)
  row = {'model': model_name, 'format': 'hf-bf16',
         'description': 'HF transformers bf16, eager, same device',
         'weight_bytes': sum(t.numel() * t.element_size() for t in model.parameters())}
  ids = torch.tensor(rng.integers(3, cfg.vocab_size, (1, p.prefill)), device=device)

  def prefill_once():
    sync()
    t = time.perf_counter()
    with torch.no_grad():
      model(ids, logits_to_keep=1)
    sync()
    return time.perf_counter() - t
  prefill_once()
  row['prefill_tokens'] = p.prefill
  row['prefill_tok_s'] = p.prefill / statistics.median(prefill_once() for _ in range(p.reps))

  def gen(b: int, n: int) -> float:
    x = torch.tensor(rng.integers(3, cfg.vocab_size, (b, p.prompt)), device=device)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
      model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                     do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t
  chip = chip_for(jax.devices()[0])
  for b in p.batches:
    gen(b, 2)
    step_s = max(gen(b, p.steps) - gen(b, 1), 1e-9) / (p.steps - 1)
    row[f'b{b}'] = cell = {'host_loop_ms': 1e3 * step_s, 'host_loop_tok_s': b / step_s}
    if chip is not None:
      cell['hbm_fraction_host_loop'] = row['weight_bytes'] / chip.hbm_bw / step_s
  if device == 'cuda':
    row['device_peak_bytes_so_far'] = int(torch.cuda.max_memory_allocated())
    row['memory_source'] = 'torch.cuda.max_memory_allocated()'
  return row


def _mb(x) -> str:
  if x is None:
    return ''
  return f'{x / 2**20:,.0f}' if x >= 10 * 2**20 else f'{x / 2**20:.2f}'


def markdown(result: dict) -> str:
  """The results as a markdown page: environment, then one table per model."""
  env, p = result['environment'], result['protocol']
  lines = ['# Device check', '',
           f"{env['date_utc']} UTC, {env['device_kind']} ({env['backend']}), "
           f"jax {env['versions']['jax']}, python {env['python']}"
           + (f", {env['nvidia_smi']}" if env.get('nvidia_smi') else '') + '.', '',
           f"Prefill {p['prefill']} tokens at batch 1 (last logits); decode {p['steps']} steps "
           f"after a {p['prompt']}-token context; 'host' = one `greedy_step` call per token "
           "from Python, 'device' = the steps in one jitted `fori_loop`; ms per step; HBM % = "
           "(weight bytes + KV bytes read) / chip bandwidth over the step time. Synthetic "
           'weights.', '']
  batches = p['batches']
  for model_name in dict.fromkeys(r['model'] for r in result['rows']):
    rows = [r for r in result['rows'] if r['model'] == model_name]
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
    rows = [r for r in result['rows'] if r['model'] == model_name and 'b1' in r]
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


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--smoke', action='store_true', help='tiny shapes, a few steps (CPU, CI)')
  ap.add_argument('--out', default='results/device_check')
  ap.add_argument('--models', default=','.join(MODELS))
  ap.add_argument('--formats', default=','.join(FORMATS))
  ap.add_argument('--batches', default=None, help='default 1,8,64 (smoke: 1,2)')
  ap.add_argument('--host_batches', default='1',
                  help='batches also timed as a Python loop of greedy_step (each one more '
                       'executable to compile per row; the device loop runs at every batch)')
  ap.add_argument('--hf', default='auto', choices=('auto', 'no'))
  ap.add_argument('--budget_s', type=float, default=340.0,
                  help='seconds for the whole check, rows and attention section together')
  ap.add_argument('--attention', default='yes', choices=('yes', 'no'),
                  help='the attention section (benchmarks/attention_timing.py) after the rows')
  ap.add_argument('--attention_budget_s', type=float, default=90.0,
                  help='the part of --budget_s kept for the attention section')
  ap.add_argument('--threads', type=int, default=None,
                  help='compile threads per row (default: min(8, cores))')
  ap.add_argument('--render', default=None,
                  help='comma-separated device_check.json files: merge their rows and write '
                       'the markdown and plot to --out (nothing is measured)')
  a = ap.parse_args(argv)
  if a.render:
    return render([json.load(open(f)) for f in a.render.split(',')], a.out)
  start = time.perf_counter()
  batches = tuple(int(b) for b in (a.batches or ('1,2' if a.smoke else '1,8,64')).split(','))
  host_batches = tuple(int(b) for b in a.host_batches.split(',') if b.strip())
  p = (Protocol(prefill=32, prompt=16, steps=4, batches=batches, reps=1,
                host_batches=host_batches) if a.smoke else
       Protocol(prefill=512, prompt=128, steps=64, batches=batches, reps=3,
                host_batches=host_batches))
  threads = a.threads or min(8, os.cpu_count() or 1)
  models = [m.strip() for m in a.models.split(',') if m.strip()]
  formats = [f.strip() for f in a.formats.split(',') if f.strip()]
  for m in models:
    model_config(m, a.smoke)  # unknown names fail before anything runs
  for f in formats:
    if f not in FORMATS:
      raise SystemExit(f'device_check: format {f!r} is unknown; use some of {FORMATS}.')
  hf_why = hf_available() if a.hf == 'auto' else 'not asked for (--hf=no)'
  todo = row_order(models, formats, hf_why is None)
  os.makedirs(a.out, exist_ok=True)
  result = {'environment': environment(), 'protocol': dataclasses.asdict(p), 'rows': [],
            'hf': hf_why or 'run', 'not_run': [], 'smoke': a.smoke}
  json_path = os.path.join(a.out, 'device_check.json')
  budget = Budget(a.budget_s)
  rows_until = a.budget_s - (a.attention_budget_s if a.attention == 'yes' else 0.0)
  for i, (m, f) in enumerate(todo):
    row_start = time.perf_counter()
    if not budget.fits(rows_until):
      result['not_run'] = [f'{m} {f}' for m, f in todo[i:]]
      break
    print(f'device_check: {m} {f} ...', flush=True)
    try:
      row = run_hf(m, p, a.smoke) if f == 'hf-bf16' else run_qjax(m, f, p, a.smoke, threads)
    except Exception as e:  # pylint: disable=broad-except
      row = {'model': m, 'format': f, 'error': f'{type(e).__name__}: {e}'[:300]}
      if a.smoke:
        raise
    result['rows'].append(row)
    result['wall_s'] = time.perf_counter() - start
    with open(json_path, 'w') as fh:
      json.dump(result, fh, indent=1, default=str)
    jax.clear_caches()
    gc.collect()
    budget.ran(row_start)
  if a.attention == 'yes':
    print('device_check: attention ...', flush=True)
    chip = chip_for(jax.devices()[0])
    result['attention'] = attention_timing.measure(
        smoke=a.smoke, models=models, kvs=('int8',) if a.smoke else ('int8', 'bf16'),
        budget_s=max(0.0, a.budget_s - budget.elapsed()),
        hbm_bw=chip and chip.hbm_bw)
  result['wall_s'] = time.perf_counter() - start
  with open(json_path, 'w') as fh:
    json.dump(result, fh, indent=1, default=str)
  return render([result], a.out)


def render(results: list, out: str) -> dict:
  """Write device_check.md and .png for one result, or several runs on one machine merged
  (rows in order; the first run's environment and protocol; wall times added)."""
  merged = dict(results[0], rows=[r for res in results for r in res['rows']],
                not_run=[n for res in results for n in res.get('not_run', [])],
                wall_s=sum(res.get('wall_s', 0) for res in results))
  os.makedirs(out, exist_ok=True)
  text = markdown(merged)
  with open(os.path.join(out, 'device_check.md'), 'w') as fh:
    fh.write(text)
  plot(merged, os.path.join(out, 'device_check.png'))  # a warning without matplotlib
  print(text)
  return merged


if __name__ == '__main__':
  main()
