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
import hashlib
import json
import os
from typing import Optional

import numpy as np

from qjax import checkpoints as qckpt
from qjax.checkpoints.hf_tokenizer import HFTokenizer, copy_tokenizer
from qjax.checkpoints.safetensors_io import INDEX_NAME, weight_files
from qjax.data import corpus
from qjax.pipeline.ptq import FloatReference, quantize_and_evaluate
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
    raise ValueError(f'config.source={source!r} does not exist; pass a HF checkpoint '
                     'directory (config.json + *.safetensors) or a .gguf file.')
  os.makedirs(out, exist_ok=True)
  if os.path.isfile(source):
    if not source.endswith('.gguf'):
      raise ValueError(f'config.source={source!r} is a file but not a .gguf; pass a HF '
                       'checkpoint directory or a Gemma 3 .gguf file.')
    model = _gguf_with_tokenizer(source, out, param_dtype)
    what = f'GGUF {os.path.basename(source)}'
  else:
    model, info = qckpt.load_hf(source, param_dtype=param_dtype, max_len=max_len or None)
    if not copy_tokenizer(source, out):
      raise ValueError(f'{source!r} has no tokenizer.json; the converted checkpoint must carry '
                       'its tokenizer: copy tokenizer.json (and tokenizer_config.json) from '
                       'the checkpoint the weights came from.')
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
  if not c.out:
    raise ValueError('config.out is empty; pass --config.out=DIR, the directory the '
                     'quantized checkpoint is written to.')
  model, tokenizer, base, what = load_source(c.source, c.out, c.param_dtype, c.max_len)
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
  return quantize_and_evaluate(ref, c.quant, c.out, base, calib=c.calib, options=c.options,
                               base_source=what)


def load_converted(out: str):
  """(quantized model, HFTokenizer, conversion record) of a `convert` output, verified."""
  model, record = qckpt.load_quantized(out)
  return model, HFTokenizer.from_dir(out), record
