"""HF checkpoints from `config.json` + `*.safetensors` (no pickle), every family `hf_config` maps.

    model, info = load_hf('path/to/dir')     # Llama 3.x, Mistral, Qwen 2/2.5/3, Gemma 2/3

`hf_families.hf_config` maps config.json onto `TransformerConfig` and refuses what qjax cannot
run before any weight is read; then every tensor's shape in the files is checked against the
shape config.json implies. Sharded checkpoints (`model.safetensors.index.json`) are read
through their index; bf16 / f16 / f32 tensors are converted via float32. Name map (torch
Linear weights are (out, in)):

    model.embed_tokens.weight                  (V, D)   -> embed/w
    model.layers.i.input_layernorm.weight      (D,)     -> layers/i/pre_attn_norm/scale
    model.layers.i.post_attention_layernorm.w. (D,)     -> layers/i/pre_mlp_norm/scale
                                       (Gemma: post_attn_norm; pre_feedforward_layernorm ->
                                        pre_mlp_norm, post_feedforward_layernorm -> post_mlp_norm)
    model.layers.i.self_attn.q_proj.weight     (N*H, D) -> layers/i/attn/q_proj/w (D, N, H)
    model.layers.i.self_attn.{k,v}_proj.weight (K*H, D) -> .../{k,v}_proj/w        (D, K, H)
    model.layers.i.self_attn.{q,k,v}_proj.bias          -> .../{q,k,v}_bias (Qwen2)
    model.layers.i.self_attn.{q,k}_norm.weight (H,)     -> .../{q,k}_norm/scale (Qwen3, Gemma 3)
    model.layers.i.self_attn.o_proj.weight     (D, N*H) -> .../o_proj/w            (N, H, D)
    model.layers.i.mlp.{gate,up}_proj.weight   (F, D)   -> layers/i/mlp/{gate,up}_proj/w (D, F)
    model.layers.i.mlp.down_proj.weight        (D, F)   -> layers/i/mlp/down_proj/w (F, D)
    model.norm.weight                          (D,)     -> final_norm/scale
    lm_head.weight (absent when tied)          (V, D)   -> lm_head/w (D, V)

The multimodal Gemma 3 checkpoint prefixes its text tower (`language_model.model.`, or
`model.language_model.`); those names are mapped as above and the vision tower is skipped.
HF checkpoints store q/k in the split-halves RoPE order qjax uses, so no permutation is needed.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Optional

import numpy as np

from qjax.checkpoints.hf_families import (SUPPORTED_MODEL_TYPES, hf_config, rope_max_len,
                                        text_config)
from qjax.checkpoints.params import model_from_params, param_shapes
from qjax.nn import Transformer, TransformerConfig

__all__ = ['SUPPORTED_MODEL_TYPES', 'hf_config', 'hf_shapes', 'load_hf']

_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some old checkpoints saved
# Text-tower prefixes of multimodal checkpoints -> the causal-LM names; skipped towers.
_PREFIXES = (('language_model.model.', 'model.'), ('model.language_model.', 'model.'),
             ('language_model.lm_head.', 'lm_head.'))
_SKIPPED = ('vision_tower.', 'model.vision_tower.', 'multi_modal_projector.',
            'model.multi_modal_projector.', 'vision_model.')
INDEX_NAME = 'model.safetensors.index.json'


def _canonical(name: str) -> Optional[str]:
  """The causal-LM name of a tensor, or None for a tensor of another tower."""
  if name.startswith(_SKIPPED):
    return None
  for prefix, repl in _PREFIXES:
    if name.startswith(prefix):
      return repl + name[len(prefix):]
  return name


def hf_shapes(cfg: TransformerConfig) -> dict[str, tuple[tuple[int, ...], str, str]]:
  """{HF tensor name: (HF shape, qjax path, kind)}; kind 'linear', 'bias' or 'copy'."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
  out = {'model.embed_tokens.weight': ((cfg.vocab_size, d), 'embed/w', 'copy'),
         'model.norm.weight': ((d,), 'final_norm/scale', 'copy')}
  if not cfg.tie_embeddings:
    out['lm_head.weight'] = ((cfg.vocab_size, d), 'lm_head/w', 'linear')
  for i in range(cfg.num_layers):
    hf, qj = f'model.layers.{i}.', f'layers/{i}/'
    out[hf + 'input_layernorm.weight'] = ((d,), qj + 'pre_attn_norm/scale', 'copy')
    if cfg.post_norms:  # Gemma 2/3: four norms per layer
      out[hf + 'post_attention_layernorm.weight'] = ((d,), qj + 'post_attn_norm/scale', 'copy')
      out[hf + 'pre_feedforward_layernorm.weight'] = ((d,), qj + 'pre_mlp_norm/scale', 'copy')
      out[hf + 'post_feedforward_layernorm.weight'] = ((d,), qj + 'post_mlp_norm/scale',
                                                       'copy')
    else:
      out[hf + 'post_attention_layernorm.weight'] = ((d,), qj + 'pre_mlp_norm/scale', 'copy')
    if cfg.qk_norm:
      out[hf + 'self_attn.q_norm.weight'] = ((h,), qj + 'attn/q_norm/scale', 'copy')
      out[hf + 'self_attn.k_norm.weight'] = ((h,), qj + 'attn/k_norm/scale', 'copy')
    for name, rows in (('q', n * h), ('k', k * h), ('v', k * h)):
      out[hf + f'self_attn.{name}_proj.weight'] = ((rows, d), qj + f'attn/{name}_proj/w',
                                                   'linear')
      if cfg.qkv_bias:
        out[hf + f'self_attn.{name}_proj.bias'] = ((rows,), qj + f'attn/{name}_bias', 'bias')
    out[hf + 'self_attn.o_proj.weight'] = ((d, n * h), qj + 'attn/o_proj/w', 'linear')
    out[hf + 'mlp.gate_proj.weight'] = ((f, d), qj + 'mlp/gate_proj/w', 'linear')
    out[hf + 'mlp.up_proj.weight'] = ((f, d), qj + 'mlp/up_proj/w', 'linear')
    out[hf + 'mlp.down_proj.weight'] = ((d, f), qj + 'mlp/down_proj/w', 'linear')
  return out


# Weight dtypes a checkpoint may store (read via float32); integer or bool tensors are
# another tool's quantized codes or a broken file, never weights to cast.
_FLOAT_DTYPES = ('F64', 'F32', 'F16', 'BF16', 'float64', 'float32', 'float16', 'bfloat16')


def regular_file(path: str) -> None:
  """Raise unless `path` (after symlinks) is a regular file: a FIFO would block a reader
  forever, a device or directory is no checkpoint file."""
  if os.path.islink(path) and not os.path.exists(path):
    raise ValueError(f'{path}: a symlink to {os.readlink(path)!r}, which does not exist (a '
                     'dangling link: the file it pointed to was deleted); download it again.')
  mode = os.stat(path).st_mode
  if not stat.S_ISREG(mode):
    kind = ('a FIFO' if stat.S_ISFIFO(mode) else 'a directory' if stat.S_ISDIR(mode) else
            'a socket' if stat.S_ISSOCK(mode) else 'a device' if stat.S_ISCHR(mode) or
            stat.S_ISBLK(mode) else 'not a regular file')
    raise ValueError(f'{path}: {kind}, not a regular file; a checkpoint holds regular files '
                     '(replace it with the downloaded file).')


def read_config(directory: os.PathLike) -> dict:
  """The parsed config.json of a HF checkpoint directory (a clear error when unreadable)."""
  cfg_path = os.path.join(os.fspath(directory), 'config.json')
  regular_file(cfg_path)
  try:
    with open(cfg_path, encoding='utf-8') as fh:
      return json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{cfg_path}: not valid JSON ({e}); the config.json is truncated or '
                     'corrupted: download it again.') from None


def weight_files(directory: str) -> list[str]:
  """The safetensors files of a checkpoint: its index's shards, else every *.safetensors."""
  index = os.path.join(directory, INDEX_NAME)
  if os.path.lexists(index):
    regular_file(index)
    try:
      with open(index, encoding='utf-8') as fh:
        shards = sorted(set(json.load(fh)['weight_map'].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'{index}: not a safetensors index ({type(e).__name__}: {e}); it '
                       "needs a 'weight_map' object: download it again.") from None
    missing = [f for f in shards if not os.path.lexists(os.path.join(directory, f))]
    if missing:
      raise ValueError(f'{directory!r}: shards {missing[:4]} named by {INDEX_NAME} are '
                       'missing; download every shard of the checkpoint.')
    return [os.path.join(directory, f) for f in shards]
  found = sorted(f for f in os.listdir(directory) if f.endswith('.safetensors'))
  if len(found) > 1:
    # transformers reads model.safetensors alone; another file beside it would redefine
    # tensors without anything saying which copy is meant.
    raise ValueError(f'{directory!r}: {len(found)} safetensors files {found[:6]} and no '
                     f'{INDEX_NAME} to say which tensor lives where; move the files that are '
                     'not part of the checkpoint away (transformers reads model.safetensors '
                     'alone), or add the index that save_pretrained writes for shards.')
  return [os.path.join(directory, f) for f in found]


def load_hf(directory: os.PathLike, *, param_dtype: str = 'float32',
            max_len: Optional[int] = None) -> tuple[Transformer, dict]:
  """Load a HF checkpoint directory (families: `hf_config`) into a qjax `Transformer`.

  Args:
    directory: holds config.json and the *.safetensors files (one, or the shards listed by
      model.safetensors.index.json).
    param_dtype: dtype of the qjax parameters (weights are converted via float32).
    max_len: override of config.json's max_position_embeddings (the longest sequence the
      model accepts; a smaller one keeps KV caches small).

  Returns:
    (model, info) with info 'config', 'hf_config' (the dict), 'model_type', 'files',
    'source_dtypes', 'seconds'.

  Raises:
    ValueError: missing files, an unsupported model type or option (before any weight is
      read), a tensor missing, unexpected, or with a shape config.json does not imply.
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  directory = os.fspath(directory)
  cfg_path = os.path.join(directory, 'config.json')
  files = weight_files(directory) if os.path.isdir(directory) else []
  if not os.path.lexists(cfg_path) or not files:
    raise ValueError(f'{directory!r} must hold config.json and *.safetensors (a HF '
                     '`save_pretrained` directory); found '
                     f'{sorted(os.listdir(directory)) if os.path.isdir(directory) else "nothing"}.')
  hf = read_config(directory)
  cfg = hf_config(hf, param_dtype)
  if max_len is not None:
    limit = rope_max_len(hf)
    if limit is not None and max_len > limit:
      raise ValueError(f"max_len={max_len}: this checkpoint's rope_type 'dynamic' changes its "
                       f'frequencies past max_position_embeddings={limit}, which qjax does not '
                       f'model; pass max_len <= {limit}.')
    cfg = cfg.replace(max_len=max_len)
  model_type = text_config(hf)['model_type']
  expected = hf_shapes(cfg)
  handles, names, tied_head = {}, {}, None
  for path in files:
    regular_file(path)  # a dangling link (a deleted HF cache blob), a FIFO, a directory
  for path in files:
    try:
      fh = safe_open(path, framework='flax')
    except Exception as e:  # pylint: disable=broad-except  (SafetensorError is not exported)
      raise ValueError(f'{path}: not a readable safetensors file ({type(e).__name__}: {e}); '
                       'it is truncated or corrupted: download it again.') from None
    for stored in fh.keys():
      name = _canonical(stored)
      if name is None or name.endswith(_IGNORED_SUFFIXES):
        continue
      if cfg.tie_embeddings and name == 'lm_head.weight':
        tied_head = (fh, stored)  # a tied head saved anyway: checked against the embedding
        continue
      if name not in expected:
        raise ValueError(f'{os.path.basename(path)}: tensor {stored!r} is not part of a '
                         f'{model_type} model as config.json describes it '
                         f'(tie_word_embeddings={cfg.tie_embeddings}, qkv bias={cfg.qkv_bias}, '
                         f'qk norm={cfg.qk_norm}).')
      stored_slice = fh.get_slice(stored)
      dtype = stored_slice.get_dtype()
      if dtype not in _FLOAT_DTYPES:
        raise ValueError(f'{os.path.basename(path)}: tensor {stored!r} is stored as {dtype}, '
                         'not as floats (F32, F16, BF16); integer or bool weights are codes '
                         'of another quantizer or a broken file, and casting them would give '
                         'a wrong model; give the float or bf16 checkpoint.')
      got = tuple(stored_slice.get_shape())
      if got != expected[name][0]:
        raise ValueError(f'{os.path.basename(path)}: tensor {stored!r} has shape {got}, but '
                         f'config.json (hidden_size={cfg.d_model}, heads={cfg.num_heads}/'
                         f'{cfg.num_kv_heads}, head_dim={cfg.head_dim}, intermediate_size='
                         f'{cfg.d_ff}, vocab_size={cfg.vocab_size}) implies '
                         f'{expected[name][0]}; the weights and config.json do not match.')
      handles[name], names[name] = fh, stored
  missing = sorted(set(expected) - set(handles))
  if missing:
    raise ValueError(f'{directory!r}: tensors {missing[:6]} required by config.json are '
                     'missing from the safetensors files.')
  params, dtypes = {}, set()
  for name, (_, key, kind) in expected.items():
    w = handles[name].get_tensor(names[name])
    dtypes.add(str(w.dtype))
    w = np.asarray(w.astype('float32'))
    if kind == 'linear':
      w = w.T
    params[key] = w
  if tied_head is not None and not np.array_equal(
      np.asarray(tied_head[0].get_tensor(tied_head[1]).astype('float32')), params['embed/w']):
    raise ValueError(f'{directory!r}: config.json says tie_word_embeddings=true but '
                     'lm_head.weight differs from model.embed_tokens.weight; fix the config.')
  shapes = param_shapes(cfg)  # split head axes: (in, out) -> e.g. (D, N, H)
  params = {k: np.ascontiguousarray(v).reshape(shapes[k]) for k, v in params.items()}
  model = model_from_params(cfg, params, source=directory)
  return model, dict(config=cfg, hf_config=hf, model_type=model_type,
                     files=[os.path.basename(f) for f in files],
                     source_dtypes=sorted(dtypes), seconds=time.perf_counter() - t0)

