"""Gemma 3 270M side by side: qjax f32 / bf16 / int8 / int4 / W8A8, google/qwix, HF transformers.

    .venv/bin/python -m benchmarks.peers [--rows=qjax-f32,qjax-int4] [--quick|--smoke]
        [--out=results/peers]

One run, one table: every row runs in its own subprocess (so its peak RSS is its own), on the
same prompts: prefill = one forward of 512 Tiny Shakespeare tokens (all logits, as HF's
forward); decode = 64 greedy steps after a 128-token prompt at batch 1 and 8, only the steps
timed; median of 3 for prefill; perplexity on the first 2 WikiText-2 valid windows of 512
(BOS per window, `qjax.pipeline.gemma`). Prints tok/s, ms/token, peak RSS, weight bytes,
ppl and ratios to qjax f32. Two prefill columns: all logits (the protocol above) and the
logits of the last position only (what `greedy_step` and HF's generate compute). Peak RSS
"serving" is taken after load, prefill and decode, before the all-logits passes (a 512 x 262k
f32 logits buffer is 512 MiB by itself); quantized qjax rows are quantized while loading
(`load_gemma3_270m(policy=)`), never holding the float model; writes <out>.json and <out>.png.

Rows: qjax (float32, bfloat16, int8 / int4 g128 with every weight or with the embedding/head
float, W8A8 and W4A8: every weight incl. the head with dynamic int8 activations, the VNNI
decode kernels); google/qwix PTQ int8 / int4 tile 128 of the same float Gemma, embedding/head
float (`_qwix_model` says why qwix runs over plain-einsum projections, and why the tied head
stays float), when `qwix` imports (`pip install -e '.[bench]'`); HF transformers on CPU torch
fp32 / bf16 when `transformers` and `torch` import (`pip install -e '.[reference]'`).

`--quick`: prefill 128, 16 steps, 1 window. `--smoke`: prefill 32, a 16-token prompt, 2
steps, 1 window: proves every row runs (3-6 min per row on 2 shared cores, most of it
loading and compiling). The full protocol takes ~15 min for every row on 2 cores, so run it
as two halves of ~8-11 min that share qjax-f32 for the ratios:

    --rows=qjax-f32,qjax-bf16,qjax-int8,qjax-int8-headf,qjax-int4,qjax-int4-headf \
      --out=results/peers_a
    --rows=qjax-f32,qjax-w8a8,qwix-int8-headf,qwix-int4-headf,hf-fp32,hf-bf16 \
      --out=results/peers_b

The runs docs/fast_decode.md shows name their commands there.

Timing needs an idle machine: the script prints the load average before and after each row;
compare rows only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROWS = ('qjax-f32', 'qjax-bf16', 'qjax-int8', 'qjax-int8-headf', 'qjax-int4', 'qjax-int4-headf',
        'qjax-w8a8', 'qjax-w4a8', 'qwix-int8-headf', 'qwix-int4-headf', 'hf-fp32', 'hf-bf16')
DESCRIPTIONS = {
    'qjax-f32': 'qjax, float32 params',
    'qjax-bf16': 'qjax, bfloat16 params',
    'qjax-int8': 'qjax int8 per-channel, every weight incl. the tied head',
    'qjax-int8-headf': 'qjax int8 per-channel, embedding/head float',
    'qjax-int4': 'qjax int4 g128 (RTN), every weight incl. the tied head',
    'qjax-int4-headf': 'qjax int4 g128 (RTN), embedding/head float',
    'qjax-w8a8': 'qjax W8A8: int8 per-channel weights, every weight incl. the tied head, with '
                 'dynamic int8 activations (per token and weight group)',
    'qjax-w4a8': 'qjax W4A8: int4 g128 (RTN) weights, every weight incl. the tied head, with '
                 'dynamic int8 activations per token and group of 128 (llama.cpp Q4 x Q8 '
                 'style)',
    'qwix-int8-headf': 'google/qwix PTQ int8 per-channel weight-only, embedding/head float',
    'qwix-int4-headf': 'google/qwix PTQ int4 tile 128 weight-only, embedding/head float',
    'hf-fp32': 'HF transformers (torch CPU), fp32',
    'hf-bf16': 'HF transformers (torch CPU), bf16',
}


def _peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(tok, cfg, a):
  """(prefill ids, 8 decode prompts, ppl windows): the corpora, or random ids without a
  tokenizer."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if tok is None:
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, a.prefill + 8 * a.prompt)
    return ids[:a.prefill], ids[a.prefill:].reshape(8, a.prompt), None
  return _data(tok, a.prefill, a.windows, a.prompt)


def _data(tok, prefill: int, windows: int, prompt: int = 128):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from qjax import data as qdata  # pylint: disable=g-import-not-at-top
  from qjax.pipeline.gemma import bos_windows  # pylint: disable=g-import-not-at-top
  bos = tok.encode('').ids[0] if tok.encode('').ids else 2
  ts = np.asarray(tok.encode(qdata.corpus('tinyshakespeare')[:200_000]).ids, np.int32)
  wt2 = np.asarray(tok.encode(qdata.corpus('wikitext2_valid')[:100_000]).ids, np.int32)
  return ts[:prefill], ts[prefill:prefill + 8 * prompt].reshape(8, prompt), bos_windows(
      wt2, bos, 512, windows)


def _policy(row: str):
  from qjax import int_format  # pylint: disable=g-import-not-at-top
  from qjax.nn import QuantPolicy, QuantRule  # pylint: disable=g-import-not-at-top
  bits = 4 if 'int4' in row or 'w4' in row else 8
  fmt = int_format(bits, group_size=128 if bits == 4 else None)
  rules = [QuantRule('embed', exempt=True)] if row.endswith('-headf') else []
  if row in ('qjax-w8a8', 'qjax-w4a8'):  # the head too: its int8-activation kernel is fast
    rules.append(QuantRule('.*', fmt, act=int_format(8)))
  else:
    rules.append(QuantRule('.*', fmt))
  return QuantPolicy(tuple(rules))


def _run_qjax(row: str, a) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from qjax import eval as qeval  # pylint: disable=g-import-not-at-top
  from qjax import kernels  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.nn import generate, kvcache  # pylint: disable=g-import-not-at-top

  pdtype = 'bfloat16' if row == 'qjax-bf16' else 'float32'
  if a.synthetic:  # Gemma 3 270M's shapes, random weights: the cost, not the quality
    from qjax.nn import Transformer, TransformerConfig, quantize_model  # pylint: disable=g-import-not-at-top
    model = Transformer(TransformerConfig.gemma3_270m(param_dtype=pdtype),
                        rngs=nnx.Rngs(0))
    if row not in ('qjax-f32', 'qjax-bf16'):
      model = quantize_model(model, _policy(row))[0]
    tok = None
  elif row in ('qjax-f32', 'qjax-bf16'):
    model, tok, _ = load_gemma3_270m(param_dtype=pdtype)
  else:  # quantized weight by weight from the param cache: the float model is never held
    model, tok, _ = load_gemma3_270m(policy=_policy(row))
  weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                     for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, 'dtype'))
  rss_loaded = _peak_rss_mib()
  cfg = model.config
  prefill_ids, prompts, windows = _inputs(tok, cfg, a)

  def prefill_once(step):
    cache = kvcache.init_cache(cfg, 1, a.prefill + 1)
    t = time.perf_counter()
    out, _ = step(model, jnp.asarray(prefill_ids[None]), cache)
    jax.block_until_ready(out)
    return time.perf_counter() - t

  prefill_once(generate.greedy_step)  # compile
  serve_s = statistics.median(prefill_once(generate.greedy_step) for _ in range(3))

  def decode(batch: int, steps: int) -> float:
    # One cache length for the warm-up and the timed run: the step compiles once per shape.
    cache = kvcache.init_cache(cfg, batch, a.prompt + a.steps + 1)
    tok_B, cache = generate.greedy_step(model, jnp.asarray(prompts[:batch]), cache)
    jax.block_until_ready(tok_B)
    t = time.perf_counter()
    for _ in range(steps):
      tok_B, cache = generate.greedy_step(model, tok_B[:, None], cache)
    jax.block_until_ready(tok_B)
    return time.perf_counter() - t

  out = {'weight_bytes': weight_bytes, 'prefill_serve_tok_s': a.prefill / serve_s,
         'kernel': kernels.status(), 'rss_loaded_mib': rss_loaded}
  for b in (1, 8):
    decode(b, 2)  # compile both steps
    s = decode(b, a.steps)
    out[f'decode_b{b}_tok_s'] = b * a.steps / s
    out[f'decode_b{b}_ms_per_step'] = 1e3 * s / a.steps
  out['peak_rss_serving_mib'] = _peak_rss_mib()
  # The benchmark's prefill protocol: one forward with the logits of every position, as HF's
  # forward computes them (the serving prefill above keeps the last position's only).
  prefill_once(generate.logits_step)
  out['prefill_tok_s'] = a.prefill / statistics.median(
      prefill_once(generate.logits_step) for _ in range(3))
  out['ppl_wikitext2'] = (float('nan') if windows is None else
                          qeval.perplexity(model, windows, 1)['ppl'])
  out['backend'] = jax.default_backend()
  return out


def _qwix_model(row: str, model, prompt_len: int):
  """qwix PTQ of the float Gemma: every projection weight-only, the embedding/head float.

  qwix cannot wrap qjax's `Einsum` as it is: PTQ replaces the weight Variable by its own
  `WithAux` array, which the layer reads with `get_value()`. So in this process each Einsum
  becomes a plain NNX projection (`jnp.einsum(spec, x, self.w[...])`, what qwix intercepts)
  over the same weights, the rest of the model (norms, RoPE, attention, KV cache) unchanged.
  The tied embedding stays float: one table read by a gather and by the head's einsum, which
  qwix's PTQ (it quantizes what an einsum reads) cannot serve to the gather.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import qwix  # pylint: disable=g-import-not-at-top
  from qjax.nn import layers  # pylint: disable=g-import-not-at-top

  def plain_call(self, x, out_dtype=None):
    out = jnp.einsum(self.spec, x, self.w[...], preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)
  layers.Einsum.__call__ = plain_call
  bits, tile = ('int4', 128) if 'int4' in row else ('int8', None)
  rules = [qwix.QtRule(module_path='layers/.*', weight_qtype=bits, tile_size=tile)]
  return qwix.quantize_model(model, qwix.PtqProvider(rules),
                             jnp.zeros((1, prompt_len), jnp.int32))


def _run_qwix(row: str, a) -> dict:
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from qjax import eval as qeval  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.nn import kvcache  # pylint: disable=g-import-not-at-top

  if a.synthetic:
    from qjax.nn import Transformer, TransformerConfig  # pylint: disable=g-import-not-at-top
    fmodel, tok = Transformer(TransformerConfig.gemma3_270m(), rngs=nnx.Rngs(0)), None
  else:
    fmodel, tok, _ = load_gemma3_270m()
  model = _qwix_model(row, fmodel, a.prompt)
  del fmodel  # qwix quantized a clone; the float projections go with the original
  graphdef, state = nnx.split(model)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  rss_loaded = _peak_rss_mib()
  cfg = model.config
  prefill_ids, prompts, windows = _inputs(tok, cfg, a)

  # The qwix model's own __call__ (qwix intercepts it), one jitted step per shape.
  @functools.partial(jax.jit, donate_argnums=2)
  def step(state, tokens_BT, cache):
    logits_BTV, cache = nnx.merge(graphdef, state)(tokens_BT, cache=cache)
    return logits_BTV, jnp.argmax(logits_BTV[:, -1], -1).astype(jnp.int32), cache

  def prefill_once():
    cache = kvcache.init_cache(cfg, 1, a.prefill + 1)
    t = time.perf_counter()
    out = step(state, jnp.asarray(prefill_ids[None]), cache)
    jax.block_until_ready(out[1])
    return time.perf_counter() - t

  prefill_once()
  prefill_s = statistics.median(prefill_once() for _ in range(3))

  def decode(batch: int, steps: int) -> float:
    cache = kvcache.init_cache(cfg, batch, a.prompt + a.steps + 1)
    _, tok_B, cache = step(state, jnp.asarray(prompts[:batch]), cache)
    jax.block_until_ready(tok_B)
    t = time.perf_counter()
    for _ in range(steps):
      _, tok_B, cache = step(state, tok_B[:, None], cache)
    jax.block_until_ready(tok_B)
    return time.perf_counter() - t

  # No last-position-only head here: both prefill columns are the all-logits forward.
  out = {'weight_bytes': weight_bytes, 'prefill_tok_s': a.prefill / prefill_s,
         'prefill_serve_tok_s': a.prefill / prefill_s, 'rss_loaded_mib': rss_loaded}
  for b in (1, 8):
    decode(b, 2)
    s = decode(b, a.steps)
    out[f'decode_b{b}_tok_s'] = b * a.steps / s
    out[f'decode_b{b}_ms_per_step'] = 1e3 * s / a.steps
  out['peak_rss_serving_mib'] = _peak_rss_mib()
  out['ppl_wikitext2'] = (float('nan') if windows is None else
                          qeval.perplexity(model, windows, 1)['ppl'])
  out['backend'] = jax.default_backend()
  return out


def _run_hf(row: str, a) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import gemma3_270m_path, load_gemma3_270m  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count() or 2)
  path = gemma3_270m_path()
  dtype = torch.bfloat16 if row == 'hf-bf16' else torch.float32
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
  _, tok, _ = load_gemma3_270m()  # the same ids as the qjax rows
  prefill_ids, prompts, windows = _data(tok, a.prefill, a.windows, a.prompt)
  weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
  with torch.no_grad():
    ids = torch.as_tensor(prefill_ids[None], dtype=torch.long)
    model(ids)
    ts = []
    for _ in range(3):
      t = time.perf_counter()
      model(ids)
      ts.append(time.perf_counter() - t)
    out = {'weight_bytes': weight_bytes, 'prefill_tok_s': a.prefill / statistics.median(ts)}
    ts = []
    try:
      for _ in range(3):  # as generate's prefill: the logits of the last position only
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        ts.append(time.perf_counter() - t)
      out['prefill_serve_tok_s'] = a.prefill / statistics.median(ts)
    except TypeError:  # a transformers without logits_to_keep
      out['prefill_serve_tok_s'] = float('nan')
    for b in (1, 8):
      p = torch.as_tensor(prompts[:b], dtype=torch.long)
      res = model(p, use_cache=True)
      past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
      t = time.perf_counter()
      for _ in range(a.steps):
        res = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
      s = time.perf_counter() - t
      out[f'decode_b{b}_tok_s'] = b * a.steps / s
      out[f'decode_b{b}_ms_per_step'] = 1e3 * s / a.steps
    out['peak_rss_serving_mib'] = _peak_rss_mib()
    nll, n = 0.0, 0
    for w in windows:
      x = torch.as_tensor(w[None], dtype=torch.long)
      logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
      nll -= float(logp.gather(1, x[0, 1:, None]).sum())
      n += len(w) - 1
    out['ppl_wikitext2'] = float(np.exp(nll / n))
  return out


def _child(row: str, a) -> None:
  t = time.perf_counter()
  run = {'hf': _run_hf, 'qwix': _run_qwix}.get(row.split('-')[0], _run_qjax)
  out = run(row, a)
  out.update(row=row, description=DESCRIPTIONS[row], peak_rss_mib=_peak_rss_mib(),
             seconds=time.perf_counter() - t)
  if not row.startswith('hf'):  # on an accelerator the model lives in device memory
    from qjax.eval import process  # pylint: disable=g-import-not-at-top
    device = process.device_memory()
    if device is not None:
      out['peak_device_mib'] = device['peak'] / 2**20
  print('PEERS_JSON ' + json.dumps(out), flush=True)


def _importable(name: str) -> bool:
  try:
    __import__(name)
    return True
  except ImportError:
    return False


def _hf_importable() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return all(importlib.util.find_spec(m) is not None for m in ('torch', 'transformers'))


def _table(results: list[dict]) -> str:
  base = next((r for r in results if r['row'] == 'qjax-f32' and 'error' not in r), None)
  cols = ['prefill_tok_s', 'prefill_serve_tok_s', 'decode_b1_tok_s', 'decode_b8_tok_s']
  lines = ['| row | prefill 512 tok/s (all logits) | prefill 512, last logits | decode b1 '
           'tok/s (ms/tok) | decode b8 tok/s | peak RSS serving / overall MiB | weights MB | '
           'ppl WT2 | x f32 (prefill / serve / b1 / b8) |',
           '|---|---|---|---|---|---|---|---|---|']
  for r in results:
    if 'error' in r:
      lines.append(f"| {r['row']} | failed: {r['error'][:80]} ||||||||")
      continue
    ratio = ' / '.join(f"{r[c] / base[c]:.2f}" for c in cols) if base else ''
    lines.append(f"| {r['row']} | {r['prefill_tok_s']:.0f} | {r['prefill_serve_tok_s']:.0f} | "
                 f"{r['decode_b1_tok_s']:.1f} ({r['decode_b1_ms_per_step']:.1f}) | "
                 f"{r['decode_b8_tok_s']:.1f} | {r['peak_rss_serving_mib']:.0f} / "
                 f"{r['peak_rss_mib']:.0f}"
                 + (f" (device {r['peak_device_mib']:.0f})" if 'peak_device_mib' in r else '')
                 + f" | {r['weight_bytes'] / 1e6:.0f} | "
                 f"{r['ppl_wikitext2']:.2f} | {ratio} |")
  return '\n'.join(lines)


def _plot(results: list[dict], path: str) -> None:
  from qjax.eval.report import PlotsUnavailable, pyplot  # pylint: disable=g-import-not-at-top
  try:
    plt = pyplot()
  except PlotsUnavailable as e:
    print(f'{path} not written: {e}')
    return
  ok = [r for r in results if 'error' not in r]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for ax, key, title in zip(axes, ['prefill_tok_s', 'decode_b1_tok_s', 'decode_b8_tok_s'],
                            ['prefill 512 tok/s', 'decode b1 tok/s', 'decode b8 tok/s']):
    ax.barh([r['row'] for r in ok], [r[key] for r in ok])
    ax.set_title(title)
    ax.invert_yaxis()
  fig.suptitle('Gemma 3 270M on CPU (one run, side by side)')
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--rows', default=','.join(ROWS), help=f'comma-separated subset of {ROWS}')
  ap.add_argument('--quick', action='store_true', help='prefill 128, 16 steps, 1 window')
  ap.add_argument('--out', default='results/peers')
  ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
  ap.add_argument('--prefill', type=int, default=512)
  ap.add_argument('--steps', type=int, default=64)
  ap.add_argument('--windows', type=int, default=2)
  ap.add_argument('--prompt', type=int, default=128, help='decode prompt length')
  ap.add_argument('--smoke', action='store_true',
                  help='prove every row runs: prefill 32, prompt 16, 2 steps, 1 window')
  ap.add_argument('--synthetic', action='store_true',
                  help="qjax rows only: Gemma 3 270M's shapes with random weights (no GGUF "
                       'or tokenizer needed, e.g. on an accelerator machine); ppl is nan')
  a = ap.parse_args()
  if a.quick:
    a.prefill, a.steps, a.windows = 128, 16, 1
  if a.smoke:
    a.prefill, a.prompt, a.steps, a.windows = 32, 16, 2, 1
  if a.child:
    _child(a.child, a)
    return
  rows = [r for r in a.rows.split(',') if r]
  bad = [r for r in rows if r not in ROWS]
  if bad:
    raise SystemExit(f'peers: unknown rows {bad}; choose from {ROWS}.')
  if a.synthetic:
    rows = [r for r in rows if not r.startswith('hf-')]
  if not _importable('qwix'):
    skipped = [r for r in rows if r.startswith('qwix-')]
    rows = [r for r in rows if not r.startswith('qwix-')]
    if skipped:
      print(f"peers: qwix not importable, leaving out {skipped} (pip install -e '.[bench]').")
  if not _hf_importable():
    skipped = [r for r in rows if r.startswith('hf-')]
    rows = [r for r in rows if not r.startswith('hf-')]
    if skipped:
      print(f'peers: transformers/torch not importable, leaving out {skipped} '
            "(pip install -e '.[reference]').")
  results = []
  for row in rows:
    load0 = os.getloadavg()[0]
    cmd = [sys.executable, '-m', 'benchmarks.peers', f'--child={row}', f'--prefill={a.prefill}',
           f'--steps={a.steps}', f'--windows={a.windows}', f'--prompt={a.prompt}'] + (
               ['--synthetic'] if a.synthetic else [])
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((l for l in p.stdout.splitlines() if l.startswith('PEERS_JSON ')), None)
    if line is None:
      tail = (p.stderr.strip().splitlines() or ['no output'])[-1]
      res = {'row': row, 'error': tail}
    else:
      res = json.loads(line[len('PEERS_JSON '):])
    res['load_avg_before'], res['load_avg_after'] = load0, os.getloadavg()[0]
    results.append(res)
    print(json.dumps(res), flush=True)
  os.makedirs(os.path.dirname(a.out) or '.', exist_ok=True)
  meta = {'cpus': os.cpu_count(), 'quick': a.quick, 'prefill': a.prefill, 'steps': a.steps,
          'windows': a.windows, 'time': time.strftime('%Y-%m-%d %H:%M:%S')}
  with open(a.out + '.json', 'w') as f:
    json.dump({'meta': meta, 'rows': results}, f, indent=1)
  _plot(results, a.out + '.png')
  print(_table(results))
  print(f'wrote {a.out}.json and {a.out}.png')


if __name__ == '__main__':
  main()
