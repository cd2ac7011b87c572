"""qjax's own programs as (function, abstract arguments) pairs, ready for `compile_for`.

A model is built abstractly (`nnx.eval_shape`: no weight is materialised, so a Llama-3-8B
step compiles without 16 GB of memory) and quantized while the target is in force, so its
codes take the target's layout (native `s4`/`s8`/`f8` on GPU and TPU) and every layer the
target's path. The programs are the library's own jitted steps, unwrapped so `compile_for`
owns the jit:

| program | what | qjax function |
|---|---|---|
| prefill | one (B, T) prompt into an empty cache, the next token | `nn.generate.greedy_step` |
| decode | one token per row against a cache holding `context` tokens | `nn.generate.greedy_step` |
| decode_loop | `steps` decode steps in one `lax.while_loop` | `nn.generate.decode_steps` |

Formats (`FORMATS`): every projection and the (tied) head in the format, activations in bf16
(weight-only) except W8A8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.aot import _compile
from qjax.core import fp8_format, int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, quantize_model
from qjax.nn import decode_core, generate, kvcache
from qjax.nn.attention import kv_format

FORMATS = ('bf16', 'int8', 'int4', 'int4_g128', 'fp8', 'w8a8')
DESCRIPTIONS = {
    'bf16': 'bfloat16 weights',
    'int8': 'int8 per channel, weight-only',
    'int4': 'int4 per channel, weight-only',
    'int4_g128': 'int4 in groups of 128 along the contraction, weight-only',
    'fp8': 'fp8 e4m3 per channel, weight-only',
    'w8a8': 'int8 per channel x dynamic int8 activations',
}


def int4_group(cfg: TransformerConfig, group: int = 128) -> int:
  """`group` where every projection's (flattened) contraction allows it, else the largest
  power of two dividing them all (o_proj contracts N*H)."""
  return math.gcd(group, cfg.num_heads * cfg.head_dim, cfg.d_model, cfg.d_ff)


def policy(fmt: str, cfg: TransformerConfig) -> Optional[QuantPolicy]:
  """Every weight (the tied embedding and head included) in `fmt`; None for bf16."""
  weights = {'int8': int_format(8), 'w8a8': int_format(8), 'int4': int_format(4),
             'int4_g128': int_format(4, group_size=int4_group(cfg)), 'fp8': fp8_format('e4m3')}
  if fmt == 'bf16':
    return None
  if fmt not in weights:
    raise ValueError(f'qjax.aot: format {fmt!r} is unknown; use one of {FORMATS}.')
  act = int_format(8) if fmt == 'w8a8' else None
  return QuantPolicy((QuantRule('.*', weights[fmt], act=act),))


def compute_bits(fmt: str) -> int:
  """Matmul operand width of a format's dots (the roofline's peak): 8 for W8A8."""
  return 8 if fmt == 'w8a8' else 16


@dataclasses.dataclass
class Program:
  """One program to compile: `fn(*args)`, its name, what it donates, its dot width."""

  name: str
  fn: Callable
  args: tuple
  donate_argnums: tuple = ()
  compute_bits: int = 16
  tokens: int = 1  # tokens the program produces or consumes per row (per-token figures)

  def compile(self, target: str, **kw) -> _compile.Report:
    return _compile.compile_for(self.fn, *self.args, target=target, program=self.name,
                                donate_argnums=self.donate_argnums,
                                compute_bits=self.compute_bits, **kw)


@dataclasses.dataclass
class AbstractModel:
  """A model's graph and abstract state, built for one target and format."""

  config: TransformerConfig
  fmt: str
  target: str
  graphdef: Any
  state: Any
  kv_fmt: Any

  @property
  def weight_bytes(self) -> int:
    """Bytes the target holds for the weights (int4 codes two to a byte, as XLA stores s4)."""
    return sum(_leaf_bytes(x) for x in jax.tree.leaves(self.state))

  def cache(self, batch: int, max_len: int, context: int = 0):
    """The abstract KV cache of `batch` rows and `max_len` slots, `context` of them filled."""
    def make():
      c = kvcache.init_cache(self.config, batch, max_len, fmt=self.kv_fmt)
      return kvcache.advance(c, context) if context else c
    return jax.eval_shape(make)


def _leaf_bytes(x) -> int:
  dtype = jnp.dtype(x.dtype)
  bits = 4 if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8 * dtype.itemsize
  return -(-math.prod(x.shape) * bits // 8)


def cache_bytes(cache) -> int:
  """Bytes of a (possibly abstract) KV cache."""
  return sum(_leaf_bytes(x) for x in jax.tree.leaves(cache))


def abstract_model(cfg: TransformerConfig, fmt: str, target: str) -> AbstractModel:
  """`cfg` in `fmt`, built and quantized abstractly while `target` is in force."""
  pol = policy(fmt, cfg)

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return model if pol is None else quantize_model(model, pol)[0]

  with _compile.tracing_for(target):
    model = nnx.eval_shape(build)
    graphdef, state = nnx.split(model)
    kv_fmt = kv_format(model)
  return AbstractModel(cfg, fmt, target, graphdef, state, kv_fmt)


def _greedy(graphdef):
  step = generate._greedy_step.__wrapped__  # pylint: disable=protected-access
  return lambda state, tokens_BT, num_real, cache: step(graphdef, state, tokens_BT, num_real,
                                                        cache)


def prefill(m: AbstractModel, length: int, batch: int = 1) -> Program:
  """One (batch, length) prompt into an empty cache of `length + 1` slots."""
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  return Program(f'prefill T={length} B={batch}', _greedy(m.graphdef),
                 (m.state, tokens, jnp.int32(length), m.cache(batch, length + 1)),
                 donate_argnums=(3,), compute_bits=compute_bits(m.fmt), tokens=length)


def decode(m: AbstractModel, batch: int, context: int) -> Program:
  """One decode step of `batch` rows against `context` cached tokens."""
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  return Program(f'decode B={batch}', _greedy(m.graphdef),
                 (m.state, tokens, jnp.int32(1), m.cache(batch, context + 1, context)),
                 donate_argnums=(3,), compute_bits=compute_bits(m.fmt))


def decode_loop(m: AbstractModel, batch: int, context: int, steps: int) -> Program:
  """`steps` greedy decode steps in one `lax.while_loop` (`generate.decode_steps`)."""
  block_fn = generate._loop_block.__wrapped__  # pylint: disable=protected-access
  graphdef = m.graphdef

  def run(state, cache, loop):
    return block_fn(graphdef, state, cache, loop, generate.greedy_pick, steps)

  tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
  loop = jax.eval_shape(lambda t: decode_core.LoopState(
      t, jnp.zeros(t.shape, jnp.int32), jnp.full(t.shape, steps, jnp.int32),
      jnp.full(t.shape + (1,), -1, jnp.int32), t >= 0, ()), tok)
  return Program(f'decode_loop B={batch} x{steps}', run,
                 (m.state, m.cache(batch, context + steps + 1, context), loop),
                 donate_argnums=(1,), compute_bits=compute_bits(m.fmt), tokens=steps)


def standard_programs(m: AbstractModel, *, prefill_len: int = 512, batches=(1, 8),
                      context: int = 128, loop_steps: Optional[int] = 16) -> list[Program]:
  """Prefill, the decode step at each batch and (when `loop_steps`) the decode loop at the
  first batch."""
  out = [prefill(m, prefill_len)] + [decode(m, b, context) for b in batches]
  if loop_steps:
    out.append(decode_loop(m, batches[0], context, loop_steps))
  return out


def check_format(fmt: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f'qjax.aot: format {fmt!r} is unknown; use one of {FORMATS}.')
  return fmt

