"""Llama-family models from HF checkpoints: `config.json` + `*.safetensors` (no pickle).

    model, info = load_safetensors('path/to/dir')      # Llama, Qwen2 or Mistral naming

`hf_config` maps config.json onto `TransformerConfig` (RMSNorm, RoPE, GQA, SwiGLU, tied or
untied head, Qwen2's q/k/v biases, Mistral's sliding window). Before any weight is read,
every tensor's shape in the files is checked against the shape config.json implies. Name map
(torch Linear weights are (out, in)):

    model.embed_tokens.weight                  (V, D)   -> embed/w
    model.layers.i.input_layernorm.weight      (D,)     -> layers/i/pre_attn_norm/scale
    model.layers.i.post_attention_layernorm.w. (D,)     -> layers/i/pre_mlp_norm/scale
    model.layers.i.self_attn.q_proj.weight     (N*H, D) -> layers/i/attn/q_proj/w (D, N, H)
    model.layers.i.self_attn.{k,v}_proj.weight (K*H, D) -> .../{k,v}_proj/w        (D, K, H)
    model.layers.i.self_attn.{q,k,v}_proj.bias          -> .../{q,k,v}_bias (Qwen2)
    model.layers.i.self_attn.o_proj.weight     (D, N*H) -> .../o_proj/w            (N, H, D)
    model.layers.i.mlp.{gate,up}_proj.weight   (F, D)   -> layers/i/mlp/{gate,up}_proj/w (D, F)
    model.layers.i.mlp.down_proj.weight        (D, F)   -> layers/i/mlp/down_proj/w (F, D)
    model.norm.weight                          (D,)     -> final_norm/scale
    lm_head.weight (absent when tied)          (V, D)   -> lm_head/w (D, V)

HF checkpoints store q/k in the split-halves RoPE order qjax uses, so no permutation is needed.
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Optional

import numpy as np

from qjax.checkpoints.params import model_from_params, param_shapes
from qjax.nn import Transformer, TransformerConfig

SUPPORTED_MODEL_TYPES = ('llama', 'qwen2', 'mistral')
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some old checkpoints saved


def _rope_theta(c: dict) -> float:
  rope = c.get('rope_parameters') or c.get('rope_scaling') or {}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind != 'default':
    raise ValueError(f'config.json: rope_type {kind!r} is not supported (only plain RoPE); '
                     'a scaled-RoPE model would load but give wrong logits.')
  theta = rope.get('rope_theta', c.get('rope_theta', 10_000.0))
  return float(theta)


def _window(c: dict, num_layers: int) -> dict:
  """sliding_window / global_every from Mistral's or Qwen2's keys."""
  window = c.get('sliding_window')
  if c['model_type'] == 'qwen2':
    kinds = c.get('layer_types')
    if kinds is None:
      kinds = ['sliding_attention' if c.get('use_sliding_window') and
               i >= c.get('max_window_layers', num_layers) else 'full_attention'
               for i in range(num_layers)]
    local = [k == 'sliding_attention' for k in kinds]
    if not any(local):
      return dict(sliding_window=None)
    if all(local):
      return dict(sliding_window=int(window))
    raise ValueError(f'config.json: Qwen2 layer_types {kinds} mix sliding and full attention '
                     'in a pattern qjax cannot express (every k-th layer global).')
  return dict(sliding_window=int(window) if window else None)


_REQUIRED_KEYS = ('hidden_size', 'num_attention_heads', 'num_hidden_layers', 'vocab_size',
                  'intermediate_size')


def hf_config(c: dict, param_dtype: str = 'float32') -> TransformerConfig:
  """TransformerConfig from a HF Llama / Qwen2 / Mistral config.json dict."""
  mt = c.get('model_type')
  if mt not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f'config.json: model_type {mt!r} is not supported; qjax loads '
                     f'{SUPPORTED_MODEL_TYPES} from safetensors (Gemma 3: load_gguf).')
  if c.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f"config.json: hidden_act {c['hidden_act']!r}; Llama-family models "
                     "use 'silu' (SwiGLU).")
  for flag in ('attention_bias', 'mlp_bias'):
    if c.get(flag):
      raise ValueError(f'config.json: {flag}=true is not supported (qjax has biases only on '
                       'q/k/v, as in Qwen2).')
  missing = [k for k in _REQUIRED_KEYS if k not in c]
  if missing:
    raise ValueError(f'config.json: missing {missing} (model_type {mt!r} needs '
                     f'{list(_REQUIRED_KEYS)}); the file is incomplete: take the config.json '
                     "saved with the weights (save_pretrained's).")
  d, n = int(c['hidden_size']), int(c['num_attention_heads'])
  layers = int(c['num_hidden_layers'])
  return TransformerConfig(
      vocab_size=int(c['vocab_size']), d_model=d, num_layers=layers, num_heads=n,
      num_kv_heads=int(c.get('num_key_value_heads') or n),
      head_dim=int(c.get('head_dim') or d // n), d_ff=int(c['intermediate_size']),
      max_len=int(c.get('max_position_embeddings', 2048)), mlp='swiglu',
      tie_embeddings=bool(c.get('tie_word_embeddings', False)),
      rope_base=_rope_theta(c), rms_eps=float(c.get('rms_norm_eps', 1e-6)),
      qkv_bias=mt == 'qwen2', param_dtype=param_dtype, **_window(c, layers))


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
    out[hf + 'post_attention_layernorm.weight'] = ((d,), qj + 'pre_mlp_norm/scale', 'copy')
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


def load_safetensors(directory: os.PathLike, *, param_dtype: str = 'float32',
                     max_len: Optional[int] = None) -> tuple[Transformer, dict]:
  """Load a HF Llama / Qwen2 / Mistral checkpoint directory into a qjax `Transformer`.

  Args:
    directory: holds config.json and one or more *.safetensors files.
    param_dtype: dtype of the qjax parameters (weights are converted via float32).
    max_len: override of config.json's max_position_embeddings.

  Returns:
    (model, info) with info 'config', 'hf_config' (the dict), 'files', 'source_dtypes',
    'seconds'.

  Raises:
    ValueError: missing files, an unsupported model type or option, a tensor missing,
      unexpected, or with a shape config.json does not imply.
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  directory = os.fspath(directory)
  cfg_path = os.path.join(directory, 'config.json')
  files = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
  if not os.path.isfile(cfg_path) or not files:
    raise ValueError(f'{directory!r} must hold config.json and *.safetensors (a HF '
                     '`save_pretrained` directory); found '
                     f'{sorted(os.listdir(directory)) if os.path.isdir(directory) else "nothing"}.')
  try:
    with open(cfg_path, encoding='utf-8') as fh:
      hf = json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{cfg_path}: not valid JSON ({e}); the config.json is truncated or '
                     'corrupted: download it again.') from None
  cfg = hf_config(hf, param_dtype)
  if max_len is not None:
    cfg = cfg.replace(max_len=max_len)
  expected = hf_shapes(cfg)
  handles, tied_head = {}, None
  for path in files:
    if not os.path.exists(path):  # glob lists a dangling symlink (a deleted HF cache blob)
      raise ValueError(f'{path}: a symlink to {os.readlink(path)!r}, which does not exist (a '
                       'dangling link: the file it pointed to was deleted); download it again.')
    try:
      fh = safe_open(path, framework='flax')
    except Exception as e:  # pylint: disable=broad-except  (SafetensorError is not exported)
      raise ValueError(f'{path}: not a readable safetensors file ({type(e).__name__}: {e}); '
                       'it is truncated or corrupted: download it again.') from None
    for name in fh.keys():
      if name.endswith(_IGNORED_SUFFIXES):
        continue
      if cfg.tie_embeddings and name == 'lm_head.weight':
        tied_head = fh  # a tied head saved anyway: checked against the embedding below
        continue
      if name not in expected:
        raise ValueError(f'{os.path.basename(path)}: tensor {name!r} is not part of a '
                         f'{hf["model_type"]} model as config.json describes it '
                         f'(tie_word_embeddings={cfg.tie_embeddings}, qkv bias={cfg.qkv_bias}).')
      got = tuple(fh.get_slice(name).get_shape())
      if got != expected[name][0]:
        raise ValueError(f'{os.path.basename(path)}: tensor {name!r} has shape {got}, but '
                         f'config.json (hidden_size={cfg.d_model}, heads={cfg.num_heads}/'
                         f'{cfg.num_kv_heads}, head_dim={cfg.head_dim}, intermediate_size='
                         f'{cfg.d_ff}, vocab_size={cfg.vocab_size}) implies '
                         f'{expected[name][0]}; the weights and config.json do not match.')
      handles[name] = fh
  missing = sorted(set(expected) - set(handles))
  if missing:
    raise ValueError(f'{directory!r}: tensors {missing[:6]} required by config.json are '
                     'missing from the safetensors files.')
  params, dtypes = {}, set()
  for name, (_, key, kind) in expected.items():
    w = handles[name].get_tensor(name)
    dtypes.add(str(w.dtype))
    w = np.asarray(w.astype('float32'))
    if kind == 'linear':
      w = w.T
    params[key] = w
  if tied_head is not None and not np.array_equal(
      np.asarray(tied_head.get_tensor('lm_head.weight').astype('float32')), params['embed/w']):
    raise ValueError(f'{directory!r}: config.json says tie_word_embeddings=true but '
                     'lm_head.weight differs from model.embed_tokens.weight; fix the config.')
  shapes = param_shapes(cfg)  # split head axes: (in, out) -> e.g. (D, N, H)
  params = {k: np.ascontiguousarray(v).reshape(shapes[k]) for k, v in params.items()}
  model = model_from_params(cfg, params, source=directory)
  return model, dict(config=cfg, hf_config=hf, files=[os.path.basename(f) for f in files],
                     source_dtypes=sorted(dtypes), seconds=time.perf_counter() - t0)

