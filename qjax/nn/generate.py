"""Greedy generation: prefill the prompt into a KV cache, then decode one token per step.

The step is one jitted function of (graphdef, state, tokens_BT, cache), compiled once for
the prompt length and once for T = 1; the model's arrays are arguments, not constants, so a
quantized model's codes are not baked into the executable. Sampling strategies and batching
belong to `qjax.infer`; this is the minimal loop the experiments need.

`decode_step` is the general step: a static `pick(logits_BV, *pick_args)` turns the last
position's logits into whatever the caller wants (argmax for greedy; `qjax.infer` passes a
sampler with per-row keys), inside the same compiled function. `logits_step` returns the
logits of every fed position (a verifier scoring several tokens at once).

Per-step host work is kept off the critical path (Gemma 3 270M decodes in ~40 ms a step):
* The model is split (`nnx.split`, ~15-25 ms for Gemma's 1,455 graph nodes) once per model,
  not per token: the split's state holds the model's own Variables, so new values assigned to
  them reach the next step; a change of structure (a replaced Variable or submodule, a new
  static attribute such as a KV format) is seen by a walk over the module attributes (~1 ms)
  and the model is split again.
* The graphdef is a static argument; jit hashes static arguments on every call (~2-5 ms for
  Gemma's graphdef), so it is passed in a wrapper that hashes once.
* The overflow check needs every row's length on the host. A cache returned by these steps
  carries its lengths on the host too (`_HOST_LENGTHS`), so the next step checks without
  waiting for the device, and steps queue back to back; any other cache is read once.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.nn import kvcache
from qjax.nn.attention import kv_format
from qjax.nn.kvcache import KVCache


class _Static:
  """A graphdef as a jit static argument whose hash is computed once."""

  __slots__ = ('graphdef', '_hash')

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, _Static) and self._hash == other._hash and
                             self.graphdef == other.graphdef)


def _structure(node, out: list) -> list:
  """Every module, Variable and static attribute under `node`, in a fixed order."""
  out.append(node)
  for value in vars(node).values():
    if isinstance(value, nnx.Pytree):  # modules, nnx.List / nnx.Dict
      _structure(value, out)
    else:
      out.append(value)
  return out


@dataclasses.dataclass
class _Split:
  static: _Static
  state: Any
  structure: list

  def current(self, model) -> bool:
    now = _structure(model, [])[1:]
    return len(now) == len(self.structure) and all(
        a is b for a, b in zip(now, self.structure))


_SPLITS: dict[int, tuple[weakref.ref, _Split]] = {}


def _forget(table: dict, key: int, _ref) -> None:
  """Weakref callback: drop `key` from `table`.

  The table is bound here, not looked up as a module global: at interpreter shutdown the
  module's globals are set to None before the last models and arrays die, and a callback
  that then read `_SPLITS` printed "Exception ignored ... 'NoneType' object has no attribute
  'pop'".
  """
  table.pop(key, None)


def _split(model: nnx.Module) -> tuple[_Static, Any]:
  """(graphdef wrapper, state) of `model`, split again only when its structure changed."""
  key = id(model)
  hit = _SPLITS.get(key)
  if hit is not None and hit[0]() is model and hit[1].current(model):
    return hit[1].static, hit[1].state
  graphdef, state = nnx.split(model)
  # Not the model itself ([1:]): the entry must not keep it alive (it is dropped with it).
  entry = _Split(_Static(graphdef), state, _structure(model, [])[1:])
  _SPLITS[key] = (weakref.ref(model, functools.partial(_forget, _SPLITS, key)), entry)
  return entry.static, entry.state


# id(cache.length) -> (weakref to that array, its values on the host): caches these steps
# returned, so that the next step checks overflow without reading the device.
_HOST_LENGTHS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _host_lengths(cache) -> Optional[np.ndarray]:
  hit = _HOST_LENGTHS.get(id(cache.length))
  if hit is not None and hit[0]() is cache.length:
    return hit[1]
  return None


def _remember_lengths(cache, lengths: np.ndarray) -> None:
  arr = cache.length
  key = id(arr)
  try:
    ref = weakref.ref(arr, functools.partial(_forget, _HOST_LENGTHS, key))
  except TypeError:  # not weak-referenceable: the next step reads the device
    return
  _HOST_LENGTHS[key] = (ref, lengths)


def _check_and_run(model, tokens_BT, cache, run: Callable):
  """Split (cached), check that T more positions fit, dispatch `run(static, state)`."""
  static, state = _split(model)
  b, t = tokens_BT.shape
  if cache.batch != b or cache.num_layers != model.config.num_layers:
    raise ValueError(f'Transformer: cache has batch {cache.batch} and {cache.num_layers} '
                     f'layers, tokens have batch {b} and the model {model.config.num_layers} '
                     'layers; build it with init_cache(config, batch).')
  lengths = _host_lengths(cache) if isinstance(cache, KVCache) else None
  if lengths is None:
    kvcache.check_fits(cache, t)  # reads the lengths: waits for the step that wrote them
    known = (isinstance(cache, KVCache) and not isinstance(cache.length, jax.core.Tracer) and
             getattr(cache.length, 'is_fully_addressable', True))
    lengths = np.asarray(cache.length) if known else None
  else:
    kvcache.check_fits(dataclasses.replace(cache, length=lengths), t)
  out, new_cache = run(static, state)
  if lengths is not None and isinstance(new_cache, KVCache):
    _remember_lengths(new_cache, lengths + t)
  return out, new_cache


def _last_logits(model, tokens_BT, cache):
  """`model(tokens_BT, cache=cache)` with the head applied to the last position only.

  A prefill of T tokens otherwise computes T x V logits to keep one row (Gemma: 512 x 262k,
  a 512 MiB buffer and ~2/3 of the prefill's FLOPs). The checks `Transformer.__call__` makes
  on the cache run on the host in `_check_and_run`.
  """
  t = tokens_BT.shape[1]
  positions_BT = kvcache.next_positions(cache, t)
  x_BTD, cache = model.blocks(model.embed_tokens(tokens_BT), positions_BT, cache)
  return model.logits(x_BTD[:, -1:])[:, 0], kvcache.advance(cache, t)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _greedy_step(graphdef, state, tokens_BT, cache):
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache)
  return jnp.argmax(logits_BV, axis=-1).astype(tokens_BT.dtype), cache


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _pick_step(graphdef, state, tokens_BT, cache, pick, pick_args):
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache)
  return pick(logits_BV, *pick_args), cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _logits_step(graphdef, state, tokens_BT, cache):
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
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
  return _check_and_run(model, tokens_BT, cache, lambda g, s: _pick_step(
      g, s, tokens_BT, cache, pick, pick_args))


def logits_step(model: nnx.Module, tokens_BT: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model: (logits_BTV of every fed position, cache).

  The cache passed in is donated (its buffers are reused); use the returned one.
  """
  return _check_and_run(model, tokens_BT, cache,
                        lambda g, s: _logits_step(g, s, tokens_BT, cache))


def greedy_step(model: nnx.Module, tokens_BT: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model; the argmax next token_B and the new cache.

  The cache passed in is donated (its buffers are reused); use the returned one. A step that
  would write past the cache's max_len raises here, on the host, naming the row.
  """
  return _check_and_run(model, tokens_BT, cache,
                        lambda g, s: _greedy_step(g, s, tokens_BT, cache))


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
  graphdef, state = _split(model)  # the sizes above make every step fit: no further checks
  tok_B, cache = _greedy_step(graphdef, state, prompt_BT, cache)
  out = [prompt_BT, tok_B[:, None]]
  for _ in range(num_steps - 1):
    tok_B, cache = _greedy_step(graphdef, state, tok_B[:, None], cache)
    out.append(tok_B[:, None])
  return jnp.concatenate(out, axis=1)
