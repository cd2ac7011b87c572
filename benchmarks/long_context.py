r"""Gemma 3 270M perplexity at long context through blockwise attention, in bounded memory.

    XLA_FLAGS= .venv/bin/python -m benchmarks.long_context [--seq_len=8192] [--size_only=32768]
    XLA_FLAGS= .venv/bin/python -m benchmarks.long_context --points=float,rtn-int8,gptq-int4-g128 \
        --size_only= --out=results/long_context/points.json

`--points` runs the same window through converted models too (the points of
configs/validate_gemma3.py: RTN int8 per channel and GPTQ int4 g128, the tied embedding /
head float; GPTQ calibrated on the same 16 x 256 WikiText-2 tokens), for the validation
reports' perplexity by position bucket out to 8k tokens (Tiny Shakespeare: the GPTQ
calibration tokens are WikiText-2's, so an 8k WikiText-2 window would contain them).

One window of `seq_len` tokens of a corpus (BOS, then the text from its start: the first 512
predictions are exactly the first window of the 512-token protocol in
configs/gemma3_270m_eval.py), one cache-free forward with `attention_impl='blockwise'` and
the LM head a chunk of positions at a time (`qjax.infer.blockwise.token_nll`). Prints:
- perplexity per position bucket ([0, 512), [512, 1024), [1024, 2048), ...): it stays in the
  range of the first 512 predictions (no blow-up past the 512-token sliding window, where
  only the global layers see further back);
- a check: the first 512 predictions' NLL from the same tokens alone through the dense path
  (max |delta NLL|, float tolerance);
- peak RSS of the process (resource.getrusage) after loading, and the peak of the forward
  alone (VmHWM after resetting it through /proc/self/clear_refs, Linux), and the
  compiled temp memory (XLA's memory analysis) of the forward at `seq_len` and at every
  `--size_only` length, compiled but not run (32768 is too slow to run on 2 CPU cores: its
  attention alone is 16x the 8k one's).
Expected run time: 8192 tokens ~3-6 minutes on 2 idle cores (every layer's attention is
  O(T^2) compute, O(T) memory); the 32k size check ~1 minute of compilation.
Expected result: every bucket's perplexity in the range of the first 512 predictions; the
  first 511 predictions equal to the dense 512-token forward within float tolerance; compiled
  temp linear in T. The measured runs: docs/validation.md (perplexity by position out to 8k).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import time

from absl import app
from absl import flags
import numpy as np

from qjax.algorithms import apply_method
from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import int_format
from qjax.data import corpus
from qjax.nn import QuantPolicy, QuantRule, quantize_model
from qjax.infer.blockwise import (bucket_perplexity, forward_temp_bytes, token_nll,
                                  with_attention_impl)

_SEQ_LEN = flags.DEFINE_integer('seq_len', 8192, 'tokens in the window that is run')
_SIZE_ONLY = flags.DEFINE_list('size_only', ['32768'], 'lengths only compiled and sized')
_CORPUS = flags.DEFINE_string('corpus', 'tinyshakespeare', 'a qjax.data corpus')
_BLOCK = flags.DEFINE_integer('block', 512, 'keys per attention block')
_CHUNK = flags.DEFINE_integer('logits_chunk', 256, 'positions per LM-head call')
_POINTS = flags.DEFINE_list('points', ['float'], 'models run: float, rtn-int8, gptq-int4-g128')
_OUT = flags.DEFINE_string('out', 'results/long_context/long_context.json', 'JSON written')


def _rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _reset_peak() -> bool:
  """Reset this process's VmHWM (Linux: '5' to /proc/self/clear_refs); False if unsupported."""
  try:
    pathlib.Path('/proc/self/clear_refs').write_text('5')
    return True
  except OSError:
    return False


def _hwm_gib() -> float:
  for line in pathlib.Path('/proc/self/status').read_text().splitlines():
    if line.startswith('VmHWM:'):
      return int(line.split()[1]) / 2**20
  return float('nan')


def _policy(fmt):
  return QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', fmt)))


def build_point(model, name, tok):
  """The converted model `name` (configs/validate_gemma3.py's points), from the float one."""
  if name == 'float':
    return model
  if name == 'rtn-int8':
    return quantize_model(model, _policy(int_format(8)))[0]
  if name == 'gptq-int4-g128':  # experiments/validate.py's calibration windows (BOS first)
    ids = np.asarray(tok.encode(corpus('wikitext2_valid')).ids)
    start, n, length = 2 * 512 + 4 * 32, 16, 256
    calib = ids[start:start + n * length].reshape(n, length).copy()
    calib[:, 0] = tok.token_to_id('<bos>')
    return apply_method(model, _policy(int_format(4, group_size=128)), 'gptq', calib,
                        {'source': 'wikitext2_valid after the evaluated windows', 'seed': 0,
                         'batch_size': 4})[0]
  raise ValueError(f'--points: {name!r} is unknown; use float, rtn-int8 or gptq-int4-g128.')


def run_points(model, tok, tokens, edges):
  """Perplexity by position bucket of each --points model on one window; JSON after each."""
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  res = {'seq_len': tokens.shape[1], 'corpus': _CORPUS.value, 'block': _BLOCK.value,
         'points': {}}
  for name in _POINTS.value:
    ts = time.perf_counter()
    qmodel = build_point(model, name, tok)
    built = time.perf_counter() - ts
    blockwise = with_attention_impl(qmodel, 'blockwise', block_size=_BLOCK.value)
    reset = _reset_peak()
    ts = time.perf_counter()
    nll = np.asarray(token_nll(blockwise, tokens, logits_chunk=_CHUNK.value))[0]
    run_s = time.perf_counter() - ts
    res['points'][name] = dict(
        buckets=bucket_perplexity(nll, edges), ppl=float(np.exp(nll.mean())),
        build_seconds=built, forward_seconds=run_s,
        forward_peak_rss_gib=_hwm_gib() if reset else float('nan'),
        load_average=os.getloadavg())
    print(f"{name}: ppl {res['points'][name]['ppl']:.3f} over {nll.size} predictions; "
          + ', '.join(f"{b['start']}-{b['end']}: {b['ppl']:.2f}"
                      for b in res['points'][name]['buckets'])
          + f' (built {built:.0f} s, forward {run_s:.0f} s, under load)', flush=True)
    out.write_text(json.dumps(res, indent=1))
    del blockwise, qmodel
  print(f'wrote {out}')


def main(_):
  print(f'load average: {os.getloadavg()}', flush=True)
  t0 = time.perf_counter()
  model, tok, _ = load_gemma3_270m()
  rss_loaded = _rss_gib()
  t = _SEQ_LEN.value
  if t > model.config.max_len:
    raise ValueError(f'--seq_len={t} exceeds the model context {model.config.max_len}.')
  ids = tok.encode(corpus(_CORPUS.value)).ids  # BOS first
  if len(ids) < t:
    raise ValueError(f'--corpus={_CORPUS.value} has {len(ids)} tokens, fewer than {t}.')
  tokens = np.asarray([ids[:t]], np.int32)
  if _POINTS.value != ['float']:
    edges = [0, 512]
    while edges[-1] * 2 < t:
      edges.append(edges[-1] * 2)
    return run_points(model, tok, tokens, edges)
  blockwise = with_attention_impl(model, 'blockwise', block_size=_BLOCK.value)
  sizes = {}
  for n in [t] + [int(s) for s in _SIZE_ONLY.value if s]:
    ts = time.perf_counter()
    sizes[n] = forward_temp_bytes(blockwise, n, logits_chunk=_CHUNK.value)
    print(f'compiled temp memory at T={n}: {sizes[n] / 2**30:.2f} GiB '
          f'({time.perf_counter() - ts:.0f} s to compile)', flush=True)
  reset = _reset_peak()
  ts = time.perf_counter()
  nll = np.asarray(token_nll(blockwise, tokens, logits_chunk=_CHUNK.value))[0]
  run_s = time.perf_counter() - ts
  rss_run = _rss_gib()
  forward_peak = _hwm_gib() if reset else float('nan')
  print(f'forward of {t} tokens: {run_s:.0f} s ({(t - 1) / run_s:.0f} predictions/s), peak RSS '
        f'{rss_run:.2f} GiB (after loading {rss_loaded:.2f} GiB; the forward alone peaked at '
        f'{forward_peak:.2f} GiB)', flush=True)
  dense_first = np.asarray(token_nll(model, tokens[:, :512], logits_chunk=_CHUNK.value))[0]
  delta = float(np.abs(dense_first - nll[:511]).max())
  edges = [0, 512]
  while edges[-1] * 2 < t:
    edges.append(edges[-1] * 2)
  buckets = bucket_perplexity(nll, edges)
  print('\n| predictions | tokens | ppl |\n|---|---|---|')
  for b in buckets:
    print(f"| {b['start']}-{b['end']} | {b['tokens']} | {b['ppl']:.2f} |")
  print(f'\nall {t - 1}: ppl {np.exp(nll.mean()):.3f}; first 511 predictions, dense 512-token '
        f'forward vs blockwise {t}: max |delta NLL| = {delta:.2e}')
  print('compiled temp GiB: ' + ', '.join(f'T={n}: {b / 2**30:.2f}' for n, b in sizes.items()))
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(
      seq_len=t, corpus=_CORPUS.value, block=_BLOCK.value, buckets=buckets,
      ppl=float(np.exp(nll.mean())), first_window_max_abs_delta_nll=delta,
      peak_rss_gib=rss_run, rss_after_load_gib=rss_loaded, forward_peak_rss_gib=forward_peak,
      forward_seconds=run_s,
      compiled_temp_bytes={str(k): v for k, v in sizes.items()},
      load_average=os.getloadavg(), seconds=time.perf_counter() - t0), indent=1))
  print(f'wrote {out}')
  if delta > 1e-2:
    raise SystemExit(f'FAIL: blockwise NLL differs from the dense path by {delta:.3g}.')


if __name__ == '__main__':
  app.run(main)
