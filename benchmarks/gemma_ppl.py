"""Gemma 3 270M perplexity (float, RTN int8 / int4 g128) vs the HF transformers reference.

    .venv/bin/python -m benchmarks.gemma_ppl --config=configs/gemma3_270m_eval.py

The protocol, expected numbers and run time are in the config's docstring. Check `uptime`
first: other processes on the machine slow this down, but do not change the numbers.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time

from absl import app
from ml_collections import config_flags
import numpy as np

from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import int_format
from qjax.data import corpus
from qjax.eval import perplexity
from qjax.nn import QuantPolicy, QuantRule, quantize_model, weight_bytes
from qjax.pipeline.gemma import bos_windows

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/gemma3_270m_eval.py')
ROOT = pathlib.Path(__file__).resolve().parents[1]
FORMATS = {'int8_channel': int_format(8), 'int4_g128': int_format(4, group_size=128)}


def windows(ids: list[int], bos: int, window: int, n: int, mode: str) -> np.ndarray:
  """[n, window] token windows with BOS first (the config's docstring); ids start with BOS."""
  if ids[0] != bos:
    raise ValueError('windows: the tokenizer did not put BOS first; use the GGUF tokenizer.')
  if mode == 'prepend':
    body = ids[1:]
    rows = [[bos] + body[i * (window - 1):(i + 1) * (window - 1)] for i in range(n)]
    if any(len(r) != window for r in rows):
      raise ValueError(f'windows: the file has fewer than {n} windows of {window} tokens.')
    return np.asarray(rows, np.int32)
  if mode == 'replace':
    return bos_windows(np.asarray(ids, np.int32), bos, window, n)
  raise ValueError(f"windows: mode={mode!r}; use 'prepend' or 'replace'.")


def main(_):
  cfg = _CONFIG.value
  print(f'load average: {os.getloadavg()}', flush=True)
  t0 = time.perf_counter()
  model, tok, info = load_gemma3_270m(param_dtype=cfg.param_dtype)
  print(f"loaded in {info['seconds']:.1f} s (cache {info['cache']})", flush=True)
  results = {'protocol': dict(cfg.to_dict()), 'float': {}, 'quantized': {}}
  data = {}
  for name in cfg.datasets.split(','):
    ids = tok.encode(corpus(name)).ids
    data[name] = windows(ids, tok.token_to_id('<bos>'), cfg.window, cfg.windows, cfg.bos_mode)
    t = time.perf_counter()
    r = perplexity(model, data[name], batch=cfg.batch)
    ref = cfg.hf_reference_ppl[name]
    r.update(hf_reference=ref, rel_diff=r['ppl'] / ref - 1, file_tokens=len(ids),
             seconds=time.perf_counter() - t)
    results['float'][name] = r
    print(f"float {name}: ppl {r['ppl']:.3f} (HF {ref}, {100 * r['rel_diff']:+.2f}%), "
          f"{r['tokens']} tokens, {r['seconds']:.0f} s", flush=True)
  for qname in filter(None, cfg.quant.split(',')):
    rules = (QuantRule(cfg.exempt, exempt=True),) if cfg.exempt else ()
    policy = QuantPolicy(rules + (QuantRule('.*', FORMATS[qname]),))
    t = time.perf_counter()
    qmodel, _ = quantize_model(model, policy)
    qtime = time.perf_counter() - t
    r = perplexity(qmodel, data[cfg.quant_dataset], batch=cfg.batch)
    base = results['float'][cfg.quant_dataset]['ppl']
    r.update(dataset=cfg.quant_dataset, delta_vs_float=r['ppl'] / base - 1,
             quantize_seconds=qtime, weight_bytes=weight_bytes(qmodel))
    results['quantized'][qname] = r
    print(f"{qname} ({cfg.quant_dataset}, exempt {cfg.exempt!r}): ppl {r['ppl']:.3f} "
          f"({100 * r['delta_vs_float']:+.2f}% vs float), quantized in {qtime:.1f} s, "
          f"weight bytes {r['weight_bytes']}", flush=True)
    del qmodel
  ok = all(abs(r['rel_diff']) <= cfg.tolerance for r in results['float'].values())
  results['float_within_tolerance'] = ok
  results['seconds'] = time.perf_counter() - t0
  out = ROOT / cfg.out
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=1, default=str))
  print(f"{'PASS' if ok else 'FAIL'}: float ppl within {100 * cfg.tolerance}% of HF; "
        f'wrote {out}', flush=True)
  if not ok or not all(math.isfinite(r['ppl']) for r in results['quantized'].values()):
    raise SystemExit(1)


if __name__ == '__main__':
  app.run(main)
