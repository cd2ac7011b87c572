"""What the device check's rows are built from: model shapes, weight formats, the protocol.

Model shapes (synthetic weights: the cost, not the quality): 'llama32_1b' is Llama 3.2 1B
(1.24 B parameters, tied head, GQA 32/8, head_dim 64); 'gemma3_270m' is Gemma 3 270M. int4
groups are 128 (o_proj's groups run along its flattened N*H contraction, two heads of 64 per
group on llama32_1b).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
from flax import nnx

from qjax import fp8_format, int_format
from qjax.core import layouts
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, kvcache
from qjax.nn import quantize_model
from qjax.nn.attention import kv_format

FORMATS = ('bf16', 'int4', 'int4_pallas', 'int4_packed', 'w8a8', 'int8', 'fp8', 'fp8xfp8')
# Forms measured to compare with the rows above them (two other ways an int4 weight reaches the
# matmul, fp8 activations): they run last, so a budget that ends the check early cuts these
# first.
COMPARISON_FORMATS = ('int4_pallas', 'int4_packed', 'fp8xfp8')
DESCRIPTIONS = {
    'bf16': 'bfloat16 weights',
    'int8': 'int8 per-channel, weight-only',
    'int4': 'int4 grouped (see group), weight-only, the backend default layout and path',
    'int4_pallas': 'int4 grouped, weight-only, packed codes on the Pallas kernel at decode',
    'int4_packed': "int4 grouped, weight-only, packed codes dequantized by XLA ops ('dequant')",
    'w8a8': 'int8 per-channel weights x dynamic int8 activations',
    'fp8': 'fp8 e4m3 per-channel, weight-only',
    'fp8xfp8': 'fp8 e4m3 per-channel weights x dynamic fp8 activations',
}
MODELS = ('llama32_1b', 'gemma3_270m')
# The int4 variants: (QuantPolicy.path, quantize_model layout); None = the backend's default.
INT4_VARIANTS = {'int4': ('auto', None), 'int4_pallas': ('pallas', 'packed'),
                 'int4_packed': ('dequant', 'packed')}
# Formats whose dots take 8-bit operands (the roofline's peak is the chip's 8-bit one).
EIGHT_BIT_DOTS = ('w8a8', 'fp8xfp8')


def model_config(name: str, smoke: bool) -> TransformerConfig:
  """The model shape `name` in bf16 (tiny layers and vocab in smoke mode)."""
  if name == 'llama32_1b':
    cfg = TransformerConfig.llama_like(tie_embeddings=True, max_len=2048)
  elif name == 'gemma3_270m':
    cfg = TransformerConfig.gemma3_270m(max_len=2048)
  else:
    raise ValueError(f'device_check: model {name!r} is unknown; use one of {MODELS}.')
  cfg = cfg.replace(dtype='bfloat16', param_dtype='bfloat16')
  if smoke:
    cfg = cfg.replace(vocab_size=512, d_model=128, num_layers=2, d_ff=256, max_len=256,
                      head_dim=64 if name == 'llama32_1b' else 32,
                      num_heads=4, num_kv_heads=2 if name == 'llama32_1b' else 1)
  return cfg


def int4_group(cfg: TransformerConfig) -> int:
  """128 where every projection's (flattened) contraction allows it, else the largest power of
  two that divides them all (o_proj contracts N*H: groups of 128 span two heads of 64)."""
  return math.gcd(128, cfg.num_heads * cfg.head_dim, cfg.d_model, cfg.d_ff)


def policy(fmt: str, cfg: TransformerConfig) -> Optional[QuantPolicy]:
  """Every weight (the tied embedding / head included) in `fmt`; None for bf16."""
  if fmt == 'bf16':
    return None
  int4 = int_format(4, group_size=int4_group(cfg))
  weights = {'int8': int_format(8), 'w8a8': int_format(8), 'fp8': fp8_format('e4m3'),
             'fp8xfp8': fp8_format('e4m3'), **{v: int4 for v in INT4_VARIANTS}}
  if fmt not in weights:
    raise ValueError(f'device_check: format {fmt!r} is unknown; use one of {FORMATS}.')
  act = {'w8a8': int_format(8), 'fp8xfp8': fp8_format('e4m3')}.get(fmt)
  path = INT4_VARIANTS.get(fmt, ('auto', None))[0]
  return QuantPolicy((QuantRule('.*', weights[fmt], act=act),), path=path)


def build(model_name: str, fmt: str, smoke: bool):
  """(config, model, policy, layout): the model shape in `fmt`, its weights on the device."""
  cfg = model_config(model_name, smoke)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  pol = policy(fmt, cfg)
  layout = INT4_VARIANTS.get(fmt, ('auto', None))[1] or layouts.default_layout()
  if pol is not None:
    model = quantize_model(model, pol, layout=layout)[0]
  jax.block_until_ready(nnx.state(model))
  return cfg, model, pol, layout


def state_bytes(model) -> int:
  """Bytes the device holds (`Array.nbytes` counts one byte per jnp.int4 element even where
  XLA packs two in a byte)."""
  return sum(x.on_device_size_in_bytes() if hasattr(x, 'on_device_size_in_bytes') else x.nbytes
             for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, 'nbytes'))


def kv_bytes_per_token(cfg: TransformerConfig, model) -> int:
  """Bytes of K and V one token adds over every layer (the cache's own format)."""
  cache = kvcache.init_cache(cfg, 1, 1, fmt=kv_format(model), ring=False)
  return kvcache.nbytes(cache)


@dataclasses.dataclass
class Protocol:
  """Prefill `prefill` tokens; decode `steps` steps after a `prompt`-token context at each of
  `batches` (the Python loop at `host_batches` only), `reps` timings each; the engine rows
  serve `engine_rows` requests in decode blocks of `engine_block` steps."""

  prefill: int
  prompt: int
  steps: int
  batches: tuple
  reps: int
  host_batches: tuple = (1,)
  engine_rows: int = 8
  engine_block: int = 8

  @property
  def context(self) -> int:
    """The decode caches' length: the context, the steps and a second run's."""
    return self.prompt + 2 * self.steps + 2


def decode_cache(cfg, model, batch: int, p: Protocol):
  """A cache holding a `p.prompt`-token context (values do not change the cost)."""
  cache = kvcache.init_cache(cfg, batch, p.context, fmt=kv_format(model))
  return kvcache.advance(cache, p.prompt)
