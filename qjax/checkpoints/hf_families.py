"""HF `config.json` -> `TransformerConfig`, for the families qjax loads from safetensors.

    cfg = hf_config(json.load(open('config.json')))

Families (`model_type`): 'llama' (Llama 2/3.x), 'mistral', 'qwen2' (Qwen 2/2.5), 'qwen3',
'gemma2', 'gemma3_text' and 'gemma3' (the text tower of the multimodal checkpoint, whose
config nests it under `text_config`). What differs between them:

    family   MLP     norm      q/k norm  qkv bias  softcaps  post norms  embed * sqrt(D)
    llama    swiglu  x*w       -         -         -         -           -
    mistral  swiglu  x*w       -         -         -         -           -
    qwen2    swiglu  x*w       -         yes       -         -           -
    qwen3    swiglu  x*w       yes       -         -         -           -
    gemma2   geglu   x*(1+w)   -         -         yes       yes         yes
    gemma3   geglu   x*(1+w)   yes       -         (opt.)    yes         yes

Layer kinds come from `layer_types` (or the family's older keys) and must follow a pattern
`TransformerConfig` expresses: all global, all sliding, or every k-th layer global. RoPE:
'default', 'linear', 'llama3', 'yarn' (`qjax.nn.rope.RopeScaling`) and 'dynamic' (NTK
scaling that changes nothing up to max_position_embeddings, so the model's max_len stops
there). Gemma 3 scales only its global layers; its sliding layers use plain RoPE at
`rope_local_base_freq`. Anything else is refused here, before a weight is read, with the
value and what is supported: a model that loads with wrong logits is worse than none.
"""

from __future__ import annotations

import math
from typing import Optional

from qjax.nn import TransformerConfig
from qjax.nn.rope import RopeScaling, yarn_attention_factor

SUPPORTED_MODEL_TYPES = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text',
                         'gemma3')
ROPE_TYPES = ('default', 'linear', 'dynamic', 'llama3', 'yarn')
_GEMMA = ('gemma2', 'gemma3_text')
_SOFTCAP_DEFAULTS = {
    'gemma2': {'final_logit_softcapping': 30.0, 'attn_logit_softcapping': 50.0},
    'gemma3_text': {'final_logit_softcapping': None, 'attn_logit_softcapping': None}}
_ACTIVATION = {'silu': 'swiglu', 'gelu_pytorch_tanh': 'geglu'}
_REQUIRED_KEYS = ('hidden_size', 'num_attention_heads', 'num_hidden_layers', 'vocab_size',
                  'intermediate_size')
_ROPE_KEYS = {'rope_type', 'type', 'rope_theta', 'factor', 'original_max_position_embeddings',
              'low_freq_factor', 'high_freq_factor', 'beta_fast', 'beta_slow', 'mscale',
              'mscale_all_dim', 'attention_factor', 'truncate', 'partial_rotary_factor'}
# Keys whose presence means an architecture qjax does not have (experts, a vision-language
# rope, weights already quantized by another tool).
_REFUSED_KEYS = {
    'num_experts': 'a mixture-of-experts model', 'num_local_experts': 'a mixture-of-experts '
    'model', 'n_routed_experts': 'a mixture-of-experts model',
    'quantization_config': 'a checkpoint already quantized by another tool (give the float '
    'or bf16 checkpoint: qjax quantizes it itself)',
}


def _refuse(msg: str):
  raise ValueError(f'config.json: {msg}')


# The released multimodal Gemma 3 config.json files write only the text keys that differ
# from transformers' Gemma3TextConfig defaults (4B: hidden_size, intermediate_size, layers,
# rope_scaling, sliding_window); transformers fills in the rest from those defaults, as here.
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, sliding_window=4096,
    hidden_activation='gelu_pytorch_tanh', rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)


def text_config(c: dict) -> dict:
  """The language model's config: `text_config` of a multimodal Gemma 3 (absent keys at
  transformers' defaults), else `c`."""
  if c.get('model_type') != 'gemma3':
    return c
  text = c.get('text_config')
  if not isinstance(text, dict):
    _refuse("model_type 'gemma3' without a text_config object; take the config.json saved "
            'with the weights.')
  text = dict(text, model_type='gemma3_text')
  if not isinstance(text.get('rope_parameters'), dict):  # the older rope keys: defaults apply
    text = {**_GEMMA3_TEXT_DEFAULTS, **text}
  else:
    text = {**{k: v for k, v in _GEMMA3_TEXT_DEFAULTS.items() if 'rope' not in k}, **text}
  text.setdefault('tie_word_embeddings', c.get('tie_word_embeddings', True))
  return text


def _check_family(c: dict) -> str:
  mt = c.get('model_type')
  if mt not in SUPPORTED_MODEL_TYPES:
    kind = ' (a mixture-of-experts model)' if 'moe' in str(mt) or mt == 'mixtral' else ''
    _refuse(f'model_type {mt!r}{kind} is not supported; qjax loads {SUPPORTED_MODEL_TYPES} '
            'from safetensors (Gemma 3 270M GGUF: load_gguf).')
  for key, what in _REFUSED_KEYS.items():
    if c.get(key):
      _refuse(f'{key}={c[key]!r}: {what} is not supported by the {mt!r} loader.')
  act_key = 'hidden_activation' if mt in _GEMMA else 'hidden_act'
  act = c.get(act_key) or c.get('hidden_act') or ('gelu_pytorch_tanh' if mt in _GEMMA else 'silu')
  want = 'gelu_pytorch_tanh' if mt in _GEMMA else 'silu'
  if act != want:
    _refuse(f"{act_key} {act!r}; {mt} models use {want!r} "
            f"({_ACTIVATION[want]}), the only activation qjax's {mt} loader supports.")
  for flag in ('attention_bias', 'mlp_bias', 'use_bidirectional_attention'):
    if c.get(flag):
      _refuse(f'{flag}=true is not supported (qjax has biases only on q/k/v, as in Qwen2, '
              'and causal attention only).')
  if float(c.get('partial_rotary_factor') or 1.0) != 1.0:
    _refuse(f"partial_rotary_factor={c['partial_rotary_factor']} is not supported (RoPE on "
            'the whole head only).')
  missing = [k for k in _REQUIRED_KEYS if k not in c]
  if missing:
    _refuse(f'missing {missing} (model_type {mt!r} needs {list(_REQUIRED_KEYS)}); the file is '
            "incomplete: take the config.json saved with the weights (save_pretrained's).")
  return mt


def _local_layers(c: dict, mt: str, n: int) -> list[bool]:
  """Which layers use sliding-window attention."""
  kinds = c.get('layer_types')
  if kinds is not None:
    bad = sorted({k for k in kinds if k not in ('sliding_attention', 'full_attention')})
    if bad or len(kinds) != n:
      _refuse(f'layer_types {kinds} must list num_hidden_layers={n} entries of '
              "'sliding_attention' / 'full_attention'" + (f' (unknown: {bad})' if bad else '.'))
    return [k == 'sliding_attention' for k in kinds]
  if mt == 'gemma2':
    return [(i + 1) % 2 != 0 for i in range(n)]
  if mt == 'gemma3_text':
    every = int(c.get('sliding_window_pattern') or c.get('_sliding_window_pattern') or 6)
    return [(i + 1) % every != 0 for i in range(n)]
  if mt in ('qwen2', 'qwen3'):
    return [bool(c.get('use_sliding_window')) and i >= c.get('max_window_layers', n)
            for i in range(n)]
  return [bool(c.get('sliding_window'))] * n


def _window(c: dict, mt: str, n: int) -> dict:
  """sliding_window / global_every of the layer pattern."""
  local = _local_layers(c, mt, n)
  if not any(local):
    return dict(sliding_window=None)
  window = c.get('sliding_window')
  if not window:
    _refuse(f'layers {[i for i, l in enumerate(local) if l]} use sliding attention but '
            f'sliding_window={window!r}; set the window the checkpoint was trained with.')
  if all(local):
    return dict(sliding_window=int(window))
  every = local.index(False) + 1
  if local != [(i + 1) % every != 0 for i in range(n)]:
    _refuse(f'{mt} layer kinds {["sliding" if l else "full" for l in local]} mix sliding and '
            'full attention in a pattern qjax cannot express (every k-th layer global).')
  return dict(sliding_window=int(window), global_every=every)


def _rope_object(c: dict, key: str) -> Optional[dict]:
  """config.json's `key` ('rope_parameters', 'rope_scaling'), which must be an object."""
  value = c.get(key)
  if value is not None and not isinstance(value, dict):
    _refuse(f'{key}={value!r} is a {type(value).__name__}, not an object; write it as '
            f'"{key}": {{"rope_type": "linear", "factor": 4.0}} (the rope_type and its '
            'parameters), or null for plain RoPE.')
  return value


def _rope_dicts(c: dict) -> tuple[dict, Optional[dict]]:
  """(global layers' rope parameters, sliding layers' or None), from either HF layout.

  Both layouts at once (`rope_parameters` and the older `rope_scaling`) must mean the same
  scaling: transformers applies `rope_scaling` over `rope_parameters`, so one that says
  otherwise is refused rather than silently dropped."""
  rp, rs = _rope_object(c, 'rope_parameters'), _rope_object(c, 'rope_scaling')
  local = None
  if rp and ('full_attention' in rp or 'sliding_attention' in rp):
    for key in ('full_attention', 'sliding_attention'):
      if rp.get(key) is not None and not isinstance(rp[key], dict):
        _refuse(f'rope_parameters[{key!r}]={rp[key]!r} must be an object (a rope_type and '
                'its parameters).')
    glob, local = dict(rp.get('full_attention') or {}), rp.get('sliding_attention')
  else:
    glob = dict(rp or rs or {})
    glob.setdefault('rope_theta', c.get('rope_theta', 10_000.0))
    if c.get('rope_local_base_freq') is not None:  # Gemma 3 before rope_parameters
      local = {'rope_type': 'default', 'rope_theta': c['rope_local_base_freq']}
  theta = lambda r: r.get('rope_theta', glob.get('rope_theta'))
  if rp and rs and (_scaling(rs, c) != _scaling(glob, c) or theta(rs) != theta(glob)):
    _refuse(f'rope_parameters {rp} and rope_scaling {rs} give different RoPE scalings '
            "(transformers applies rope_scaling, so the model's logits depend on which one is "
            'meant); keep the one the checkpoint was trained with and delete the other.')
  return glob, local


def _number(r: dict, key: str, kind: str, *, integer: bool = False):
  """A rope parameter that must be a positive number (or integer), or None when absent."""
  v = r.get(key)
  if v is None:
    return None
  if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
      or (integer and float(v) != int(v))):
    _refuse(f'rope parameter {key}={v!r} (rope_type {kind!r}) must be a positive '
            f'{"integer" if integer else "number"}; fix config.json (or take the one saved '
            'with the weights).')
  return int(v) if integer else float(v)


def _scaling(r: dict, c: dict) -> tuple[Optional[RopeScaling], Optional[int]]:
  """(RopeScaling or None, a cap on max_len or None) of one rope-parameters dict."""
  kind = r.get('rope_type', r.get('type', 'default'))
  if kind not in ROPE_TYPES:
    _refuse(f'rope_type {kind!r} is not supported; qjax supports {ROPE_TYPES}. A model '
            'with another RoPE scaling would load but give wrong logits.')
  unknown = sorted(set(r) - _ROPE_KEYS)
  if unknown:
    _refuse(f'rope parameters {unknown} (rope_type {kind!r}) are not supported; qjax reads '
            f'{sorted(_ROPE_KEYS)}.')
  if float(r.get('partial_rotary_factor') or 1.0) != 1.0:
    _refuse(f"partial_rotary_factor={r['partial_rotary_factor']} is not supported (RoPE on "
            'the whole head only).')
  max_pos = _max_positions(c)
  num = lambda key, **kw: _number(r, key, kind, **kw)
  num('rope_theta')
  original = num('original_max_position_embeddings', integer=True)
  factor = num('factor')
  if kind == 'default':
    return None, None
  if kind == 'dynamic':  # identical to plain RoPE up to max_position_embeddings
    return None, max_pos
  if kind == 'yarn':
    original = original or max_pos
    factor = factor if factor is not None else max_pos / original
    attention = num('attention_factor')
    if attention is None:
      attention = yarn_attention_factor(factor, r.get('mscale'), r.get('mscale_all_dim'))
    beta_fast, beta_slow = num('beta_fast'), num('beta_slow')
    return RopeScaling('yarn', factor, original_max_len=original,
                       beta_fast=32.0 if beta_fast is None else beta_fast,
                       beta_slow=1.0 if beta_slow is None else beta_slow,
                       truncate=bool(r.get('truncate', True)),
                       attention_factor=float(attention)), None
  if factor is None:
    _refuse(f'rope_type {kind!r} needs a factor.')
  if kind == 'linear':
    return RopeScaling('linear', factor), None
  if original is None:
    _refuse("rope_type 'llama3' needs original_max_position_embeddings.")
  low, high = num('low_freq_factor'), num('high_freq_factor')
  return RopeScaling('llama3', factor, original_max_len=original,
                     low_freq_factor=1.0 if low is None else low,
                     high_freq_factor=4.0 if high is None else high), None


def _max_positions(c: dict) -> int:
  """max_position_embeddings (2048 when absent), a positive integer."""
  v = c.get('max_position_embeddings', 2048)
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    _refuse(f'max_position_embeddings={v!r} must be a positive integer (the longest context '
            'the checkpoint was trained for).')
  return v


def _rope(c: dict) -> dict:
  glob, local = _rope_dicts(c)
  scaling, cap = _scaling(glob, c)
  out = dict(rope_base=float(glob.get('rope_theta', c.get('rope_theta', 10_000.0))),
             rope_scaling=scaling)
  if local is not None:
    local_scaling, _ = _scaling(local, c)
    if local_scaling is not None:
      _refuse(f"sliding layers' rope_type {local.get('rope_type')!r}: qjax scales only the "
              "global layers' RoPE; sliding layers use 'default'.")
    out['local_rope_base'] = float(local.get('rope_theta', 10_000.0))
  max_len = _max_positions(c)
  out['max_len'] = min(max_len, cap) if cap else max_len
  return out


def rope_max_len(c: dict) -> Optional[int]:
  """The longest context the checkpoint's RoPE is exact for in qjax ('dynamic': its
  max_position_embeddings), or None (no limit from RoPE)."""
  return _scaling(_rope_dicts(text_config(c))[0], text_config(c))[1]


def hf_config(c: dict, param_dtype: str = 'float32') -> TransformerConfig:
  """TransformerConfig from a HF config.json dict (families: the module docstring).

  Args:
    c: the parsed config.json.
    param_dtype: dtype of the qjax parameters.

  Returns:
    The TransformerConfig.

  Raises:
    ValueError: an unsupported model_type, activation, RoPE type or option, naming it.
  """
  if not isinstance(c, dict):
    _refuse(f'holds a JSON {type(c).__name__}, not an object; a HF config.json is one object '
            '({"model_type": ..., "hidden_size": ...}): take the one saved with the weights.')
  c = text_config(c)
  mt = _check_family(c)
  d, n = int(c['hidden_size']), int(c['num_attention_heads'])
  layers = int(c['num_hidden_layers'])
  head_dim = int(c.get('head_dim') or d // n)
  gemma = mt in _GEMMA
  extra = {}
  if gemma:  # absent keys take HF's defaults of the family
    scalar = c.get('query_pre_attn_scalar', 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
      _refuse(f'query_pre_attn_scalar={scalar!r} must be a positive number (queries are '
              'scaled by its inverse square root; Gemma uses 256, or head_dim); fix '
              'config.json.')
    c = {**_SOFTCAP_DEFAULTS[mt], **c}
    softcap = lambda key: float(c[key]) if c[key] else None
    extra = dict(embed_scale=True, post_norms=True, norm_plus_one=True,
                 query_scale=float(scalar) ** -0.5,
                 final_logit_softcap=softcap('final_logit_softcapping'),
                 attn_logit_softcap=softcap('attn_logit_softcapping'))
  return TransformerConfig(
      vocab_size=int(c['vocab_size']), d_model=d, num_layers=layers, num_heads=n,
      num_kv_heads=int(c.get('num_key_value_heads') or n), head_dim=head_dim,
      d_ff=int(c['intermediate_size']), mlp='geglu' if gemma else 'swiglu',
      tie_embeddings=bool(c.get('tie_word_embeddings', gemma)),
      rms_eps=float(c.get('rms_norm_eps', 1e-6)), qkv_bias=mt == 'qwen2',
      qk_norm=mt in ('qwen3', 'gemma3_text'), param_dtype=param_dtype,
      **_rope(c), **_window(c, mt, layers), **extra)
