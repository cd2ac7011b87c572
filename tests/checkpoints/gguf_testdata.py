"""Tiny Gemma 3-shaped GGUF files written with `gguf.GGUFWriter`, for loader tests.

The writer is the inverse of `qjax.checkpoints.gguf`'s name map: qjax layouts are flattened
back to GGUF's (out, in) matrices and norms are stored as 1 + w, as llama.cpp writes them.
"""

from __future__ import annotations

import numpy as np

from qjax.nn import TransformerConfig

SPECIALS = ['<pad>', '<eos>', '<bos>', '<unk>', '<mask>', '<start_of_turn>']
PIECES = ['\u2581', 'a', 'b', 'c', 'ab', 'bc', 'abc', '\u2581a', '\u2581ab', '\u2581abc', '  ',
          '\n', '\n\n']
BYTES = [f'<0x{i:02X}>' for i in range(256)]
TOKENS = SPECIALS + PIECES + BYTES
TYPES = [3] * len(SPECIALS) + [1] * 10 + [4] * 3 + [6] * 256  # control, normal, user, byte
QUANTIZED = {'attn_q': 'Q8_0', 'ffn_gate': 'Q5_0', 'token_embd': 'Q8_0'}


def tiny_config(**overrides) -> TransformerConfig:
  base = dict(vocab_size=len(TOKENS), d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=32, d_ff=128, max_len=128, mlp='geglu', tie_embeddings=True,
              embed_scale=True, qk_norm=True, post_norms=True, norm_plus_one=True,
              sliding_window=4, global_every=6, rope_base=1e6, local_rope_base=1e4,
              query_scale=32 ** -0.5, rms_eps=1e-6)
  return TransformerConfig(**{**base, **overrides})


def random_params(cfg: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
  from qjax.checkpoints.params import param_shapes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  return {k: (0.3 * rng.standard_normal(s)).astype(np.float32)
          for k, s in param_shapes(cfg).items()}


def _gguf_tensors(cfg: TransformerConfig, params: dict) -> dict[str, np.ndarray]:
  """GGUF name -> float32 array in GGUF's numpy layout (out, in), norms as 1 + w."""
  out = {'token_embd.weight': params['embed/w'],
         'output_norm.weight': params['final_norm/scale'] + 1}
  norms = {'attn_norm': 'pre_attn_norm', 'post_attention_norm': 'post_attn_norm',
           'ffn_norm': 'pre_mlp_norm', 'post_ffw_norm': 'post_mlp_norm',
           'attn_q_norm': 'attn/q_norm', 'attn_k_norm': 'attn/k_norm'}
  for i in range(cfg.num_layers):
    p = lambda k, i=i: params[f'layers/{i}/{k}']
    for g, q in norms.items():
      out[f'blk.{i}.{g}.weight'] = p(f'{q}/scale') + 1
    d = cfg.d_model
    out[f'blk.{i}.attn_q.weight'] = p('attn/q_proj/w').reshape(d, -1).T
    out[f'blk.{i}.attn_k.weight'] = p('attn/k_proj/w').reshape(d, -1).T
    out[f'blk.{i}.attn_v.weight'] = p('attn/v_proj/w').reshape(d, -1).T
    out[f'blk.{i}.attn_output.weight'] = p('attn/o_proj/w').reshape(-1, d).T
    out[f'blk.{i}.ffn_gate.weight'] = p('mlp/gate_proj/w').T
    out[f'blk.{i}.ffn_up.weight'] = p('mlp/up_proj/w').T
    out[f'blk.{i}.ffn_down.weight'] = p('mlp/down_proj/w').T
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_gguf(path, cfg: TransformerConfig, params: dict, *, arch: str = 'gemma3',
               tokens=None, types=None) -> dict[str, np.ndarray]:
  """Write a GGUF; returns {GGUF name: what a reader dequantizes} (quantization applied)."""
  import gguf  # pylint: disable=g-import-not-at-top
  tokens = TOKENS if tokens is None else tokens
  types = TYPES if types is None else types
  w = gguf.GGUFWriter(str(path), arch)
  w.add_uint32(f'{arch}.context_length', cfg.max_len)
  w.add_uint32(f'{arch}.embedding_length', cfg.d_model)
  w.add_uint32(f'{arch}.block_count', cfg.num_layers)
  w.add_uint32(f'{arch}.feed_forward_length', cfg.d_ff)
  w.add_uint32(f'{arch}.attention.head_count', cfg.num_heads)
  w.add_uint32(f'{arch}.attention.head_count_kv', cfg.num_kv_heads)
  w.add_uint32(f'{arch}.attention.key_length', cfg.head_dim)
  w.add_uint32(f'{arch}.attention.value_length', cfg.head_dim)
  w.add_float32(f'{arch}.attention.layer_norm_rms_epsilon', cfg.rms_eps)
  w.add_float32(f'{arch}.rope.freq_base', cfg.rope_base)
  w.add_uint32(f'{arch}.attention.sliding_window', cfg.sliding_window)
  w.add_tokenizer_model('llama')
  w.add_token_list(tokens)
  w.add_token_scores([0.0] * len(tokens))
  w.add_token_types(types)
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_bos_token(True)
  w.add_add_eos_token(False)
  stored = {}
  for name, arr in _gguf_tensors(cfg, params).items():
    qname = QUANTIZED.get(name.split('.')[-2] if name.startswith('blk') else name.split('.')[0])
    if qname is None:
      w.add_tensor(name, arr)
      stored[name] = arr
    else:
      qtype = getattr(gguf.GGMLQuantizationType, qname)
      data = gguf.quants.quantize(arr, qtype)
      w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
      stored[name] = gguf.quants.dequantize(data, qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return stored
