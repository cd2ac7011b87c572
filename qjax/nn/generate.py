"""Greedy generation: prefill the prompt into a KV cache, then decode one token per step.

The step is one jitted function of (graphdef, state, tokens_BT, cache), compiled once for
the prompt length and once for T = 1; the model's arrays are arguments, not constants, so a
quantized model's codes are not baked into the executable. Sampling strategies and batching
belong to `qjax.infer`; this is the minimal loop the experiments need.

`decode_step` is the general step: a static `pick(logits_BV, *pick_args)` turns the last
position's logits into whatever the caller wants (argmax for greedy; `qjax.infer` passes a
sampler with per-row keys), inside the same compiled function. `logits_step` returns the
logits of every fed position (a verifier scoring several tokens at once).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.nn import kvcache
from qjax.nn.attention import kv_format
from qjax.nn.kvcache import KVCache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _greedy_step(graphdef, state, tokens_BT, cache):
  model = nnx.merge(graphdef, state)
  logits_BTV, cache = model(tokens_BT, cache=cache)
  return jnp.argmax(logits_BTV[:, -1], axis=-1).astype(tokens_BT.dtype), cache


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _pick_step(graphdef, state, tokens_BT, cache, pick, pick_args):
  model = nnx.merge(graphdef, state)
  logits_BTV, cache = model(tokens_BT, cache=cache)
  return pick(logits_BTV[:, -1], *pick_args), cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _logits_step(graphdef, state, tokens_BT, cache):
  model = nnx.merge(graphdef, state)
  return model(tokens_BT, cache=cache)


def decode_step(model: nnx.Module, tokens_BT: jax.Array, cache: KVCache,
                pick: Callable[..., Any], *pick_args) -> tuple[Any, KVCache]:
  """Feed `tokens_BT` through the cached model and `pick` from the last position's logits.

  Args:
    model: a `Transformer`.
    tokens_BT: int token ids, T >= 1 per row (the prompt, or the last token).
    cache: the KV cache (donated: use the returned one).
    pick: a hashable function `pick(logits_BV, *pick_args) -> out` (a module-level function,
      so that the step compiles once per pick); traced inside the step.
    *pick_args: arrays (pytrees) passed to `pick`.

  Returns:
    (out, cache): what `pick` returned, and the cache advanced by T.
  """
  graphdef, state = nnx.split(model)  # before the check: it overlaps the running step
  kvcache.check_fits(cache, tokens_BT.shape[1])  # reads the lengths: waits for that step
  return _pick_step(graphdef, state, tokens_BT, cache, pick, pick_args)


def logits_step(model: nnx.Module, tokens_BT: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model: (logits_BTV of every fed position, cache).

  The cache passed in is donated (its buffers are reused); use the returned one.
  """
  graphdef, state = nnx.split(model)  # before the check: it overlaps the running step
  kvcache.check_fits(cache, tokens_BT.shape[1])  # reads the lengths: waits for that step
  return _logits_step(graphdef, state, tokens_BT, cache)


def greedy_step(model: nnx.Module, tokens_BT: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model; the argmax next token_B and the new cache.

  The cache passed in is donated (its buffers are reused); use the returned one. A step that
  would write past the cache's max_len raises here, on the host, naming the row.
  """
  graphdef, state = nnx.split(model)  # before the check: it overlaps the running step
  kvcache.check_fits(cache, tokens_BT.shape[1])  # reads the lengths: waits for that step
  return _greedy_step(graphdef, state, tokens_BT, cache)


def greedy_generate(model: nnx.Module, prompt_BT: jax.Array, num_steps: int) -> jax.Array:
  """Greedy continuation of `prompt_BT` by `num_steps` tokens.

  Args:
    model: a `Transformer` (float, quantized or fake-quantized).
    prompt_BT: int token ids, the same length for every row.
    num_steps: tokens to generate (>= 0).

  Returns:
    tokens of shape (B, T + num_steps): the prompt followed by the generated tokens.

  The cache stores K/V in the model's KV format (`kv_format(model)`; float when it has none).
  """
  cfg = model.config
  b, t = prompt_BT.shape
  if num_steps < 0:
    raise ValueError(f'greedy_generate: num_steps={num_steps} must be >= 0.')
  if t + num_steps > cfg.max_len:
    raise ValueError(f'greedy_generate: a prompt of {t} tokens + {num_steps} steps = '
                     f'{t + num_steps} exceeds config.max_len={cfg.max_len}; shorten the '
                     'prompt or generate fewer tokens.')
  if num_steps == 0:
    return prompt_BT
  cache = kvcache.init_cache(cfg, b, t + num_steps, fmt=kv_format(model))
  graphdef, state = nnx.split(model)
  tok_B, cache = _greedy_step(graphdef, state, prompt_BT, cache)
  out = [prompt_BT, tok_B[:, None]]
  for _ in range(num_steps - 1):
    tok_B, cache = _greedy_step(graphdef, state, tok_B[:, None], cache)
    out.append(tok_B[:, None])
  return jnp.concatenate(out, axis=1)
