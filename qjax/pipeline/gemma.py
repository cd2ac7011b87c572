"""Gemma 3 270M's evaluation data and per-source-type metrics, for the real-model PTQ sweep
(`python -m experiments.gemma_ptq`) and the Gemma benchmarks.

Protocol (it matches HF transformers' fp32 perplexity on the dequantized GGUF: docs/ptq.md): each
corpus is tokenized whole by the GGUF tokenizer, cut into non-overlapping windows, and the
first token of every window is set to BOS (Gemma degrades badly without a BOS per window).
WikiText-2 valid's first windows are scored; the tokens after them are the calibration split.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import numpy as np

from qjax import data as qjax_data
from qjax import eval as qeval
from qjax.core import QArray, dequantize
from qjax.nn import einsum_layers
from qjax.train import data as qdata


class GemmaTokenizer:
  """The GGUF tokenizer in the interface the pipeline reads (`name`, `encode`)."""

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
  """The first `n` non-overlapping `window`-token windows of `ids`, first token := BOS.

  Args:
    ids: the whole corpus' token ids.
    bos: the BOS id.
    window: tokens per window, BOS included.
    n: how many windows.

  Returns:
    int [n, window] windows.
  """
  if ids.size < n * window:
    raise ValueError(f'bos_windows: {ids.size} tokens hold fewer than {n} windows of {window}.')
  w = ids[:n * window].reshape(n, window).copy()
  w[:, 0] = bos
  return w


def eval_data(tok, bos: int, gguf_sha256: str, window: int, n: int):
  """Gemma's evaluation data on the vendored corpora (`qjax.data`).

  Args:
    tok: the GGUF tokenizer (`tokenizers.Tokenizer`).
    bos: its BOS id.
    gguf_sha256: the GGUF file's sha256 (names the vocabulary in records).
    window, n: window length and number of scored windows.

  Returns:
    (GemmaData on WikiText-2 valid, its [n, window] scored windows, Tiny Shakespeare's
    [n, window] windows).
  """
  gtok = GemmaTokenizer(tok, gguf_sha256)
  wt2_ids = gtok.encode(qjax_data.corpus('wikitext2_valid'))
  ts_ids = gtok.encode(qjax_data.corpus('tinyshakespeare'))
  wt2, ts = bos_windows(wt2_ids, bos, window, n), bos_windows(ts_ids, bos, window, n)
  data = GemmaData(train=wt2_ids[n * window:], valid=wt2.reshape(-1),
                   source='qjax.data wikitext2_valid (WikiText-2 valid)',
                   sha256=hashlib.sha256(wt2_ids.tobytes()).hexdigest(),
                   tokenizer=gtok, window_bos=bos)
  return data, wt2, ts


def per_source_type(ref_model, tensor_types: dict):
  """extra_metrics: per GGUF source type, relative weight error and output error vs RTN.

  Args:
    ref_model: the float model.
    tensor_types: {'<layer path>/w': GGUF type name} (the loader's `info['tensor_types']`).

  Returns:
    `(qmodel, calibration record) -> {'by_source_type': {type: {layers, rel_weight_err,
    output_err_vs_rtn}}}`.
  """

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


def other_ppl(windows: np.ndarray, name: str, batch: int, base: float):
  """extra_metrics: perplexity on a second dataset, and its change from the float `base`."""

  def metrics(qmodel, calibration) -> dict:
    del calibration
    p = qeval.perplexity(qmodel, windows, batch)['ppl']
    return {f'ppl_{name}': p, f'ppl_{name}_delta': p - base}

  return metrics


def source_type_table(rows) -> str:
  """Markdown table of the rows' `by_source_type` columns (one line per point and type)."""
  lines = ['| point | source type | layers | rel. weight error | output error / RTN |',
           '|---|---|---|---|---|']
  fmt = lambda x: '' if x is None else f'{x:.4g}'
  for r in rows:
    for kind, v in sorted((r.get('by_source_type') or {}).items()):
      lines.append(f"| {r['name']} | {kind} | {v['layers'] or ''} | "
                   f"{fmt(v['rel_weight_err'])} | {fmt(v['output_err_vs_rtn'])} |")
  return '\n'.join(lines)


def plot_ppl_vs_quantized_bytes(rows, path: str) -> None:
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
