"""Greedy generation: prefill the prompt into a KV cache, then decode one token per step.

The step is one jitted function of (graphdef, state, tokens_BT, num_real, cache), compiled
once per padded prompt width and once for T = 1: a prompt of T > 1 tokens is padded to its
bucket (`bucket_length`: the next power of two by default, or a list) and `num_real` says how
many are real, so prompts of 5, 6 and 7 tokens share one compile (`step_compilations()`
counts them). Padding tokens sit at `kvcache.EMPTY_POSITION`: no real query sees them and no
ring stores them. `greedy_generate` also sizes its cache to a bucket, so decode compiles once
per bucket too. The model's arrays are arguments, not constants, so a
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
* On XLA:CPU without the kernel, bf16/f16 weights run as an f32 copy made once per model
  (`qjax.core.decode_paths.DecodeWeights`): no XLA:CPU form of a bf16 weight decodes at f32
  speed.
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
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

from qjax.core.decode_paths import DecodeWeights
from qjax.nn import kvcache
from qjax.nn import validate
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
  weights: DecodeWeights

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
    return hit[1].static, hit[1].weights(hit[1].state)
  graphdef, state = nnx.split(model)
  # Not the model itself ([1:]): the entry must not keep it alive (it is dropped with it).
  entry = _Split(_Static(graphdef), state, _structure(model, [])[1:], DecodeWeights(state))
  _SPLITS[key] = (weakref.ref(model, functools.partial(_forget, _SPLITS, key)), entry)
  return entry.static, entry.weights(entry.state)


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


def bucket_length(t: int, buckets: Optional[Sequence[int]] = None) -> int:
  """The length a T-token call is padded to: the next power of two (`buckets=None`), the
  smallest of `buckets` >= T, or T itself (T = 1, `buckets=()`, or T above every bucket)."""
  if t <= 1 or (buckets is not None and not buckets):
    return t
  if buckets is None:
    return 1 << (t - 1).bit_length()
  return min((b for b in buckets if b >= t), default=t)


def _check_buckets(buckets, what: str):
  if buckets is None:
    return None
  buckets = tuple(buckets)
  if not all(isinstance(b, (int, np.integer)) and b >= 1 for b in buckets):
    raise ValueError(f'{what}: buckets={buckets!r} must be positive ints (lengths a call is '
                     'padded to), None (powers of two) or () (no padding).')
  return tuple(sorted(int(b) for b in buckets))


def _pad_tokens(tokens_BT, width: int):
  """tokens_BT padded with id 0 at the end to `width` columns (on the host when it is there)."""
  pad = width - tokens_BT.shape[1]
  if not pad:
    return tokens_BT
  if isinstance(tokens_BT, np.ndarray):
    return np.pad(tokens_BT, ((0, 0), (0, pad)))
  return jnp.pad(jnp.asarray(tokens_BT), ((0, 0), (0, pad)))


def _fed_positions(cache, width: int, num_real):
  """positions_BT of a call of `width` tokens, the first `num_real` real: padding sits at
  EMPTY_POSITION, later than every query (hidden by the causal mask) and never written to a
  ring; a full-length layer writes it past the row's length, where a rollback would leave it."""
  positions_BT = kvcache.next_positions(cache, width)
  real_1T = jnp.arange(width, dtype=jnp.int32)[None] < num_real
  return jnp.where(real_1T, positions_BT, kvcache.EMPTY_POSITION)


def _last_logits(model, tokens_BT, cache, num_real):
  """`model(tokens_BT[:, :num_real], cache=cache)` with the head on the last real position;
  NaN logits for a row fed an id outside the vocabulary (`qjax.nn.validate`).

  A prefill of T tokens otherwise computes T x V logits to keep one row (Gemma: 512 x 262k,
  a 512 MiB buffer and ~2/3 of the prefill's FLOPs). The checks `Transformer.__call__` makes
  on the cache run on the host in `_check_and_run`.
  """
  positions_BT = _fed_positions(cache, tokens_BT.shape[1], num_real)
  x_BTD, cache = model.blocks(model.embed_tokens(tokens_BT), positions_BT, cache)
  x_B1D = jax.lax.dynamic_slice_in_dim(x_BTD, num_real - 1, 1, axis=1)
  # Poisoning the (B, 1, D) hidden state, not the (B, V) logits: no extra pass over V.
  ok_B = validate.ids_in_range(tokens_BT, model.config.vocab_size, num_real)
  x_B1D = validate.poison_rows(x_B1D, ok_B)
  return model.logits(x_B1D)[:, 0], kvcache.advance(cache, num_real)


# Traces of each jitted step (one per compilation): `step_compilations()`.
_TRACES = {'greedy': 0, 'pick': 0, 'logits': 0, 'block': 0}


def step_compilations() -> dict[str, int]:
  """How many times each jitted step was traced (= compiled) in this process.

  Keys: 'greedy' (`greedy_step`, `greedy_generate`'s prefill), 'pick' (`decode_step`),
  'logits' (`logits_step`), 'block' (`decode_steps`: the decode loops' many-step dispatch).
  A step compiles once per (padded) token width, cache shape and model structure; with
  buckets, prompts of lengths 5, 6 and 7 share the width 8.
  """
  return dict(_TRACES)


def argmax_last(x_BV: jax.Array) -> jax.Array:
  """`jnp.argmax(x_BV, axis=-1)` as two plain reductions (max, then the first index at it).

  XLA:CPU lowers argmax to a variadic (value, index) reduce that it does not vectorise:
  1.3 ms for Gemma's 262144 logits, ~7% of a quantized decode step (profiled); a max and a
  masked min over an iota are vectorised and fused. A NaN counts as the largest value, as in
  `jnp.argmax` (the first NaN wins; only a row holding both +inf and NaN can differ: the
  first of either).
  """
  return _argmax_top(x_BV)[0]


def _argmax_top(x_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(`argmax_last`, the max with NaN counted as +inf), one pass over V."""
  v = x_BV.shape[-1]
  key = jnp.where(jnp.isnan(x_BV), jnp.inf, x_BV)
  top = jnp.max(key, axis=-1, keepdims=True)
  iota = lax.broadcasted_iota(jnp.int32, x_BV.shape, x_BV.ndim - 1)
  return jnp.min(jnp.where(key == top, iota, v), axis=-1), top[..., 0]


def argmax_or_non_finite(x_BV: jax.Array) -> jax.Array:
  """`argmax_last`, or `validate.NON_FINITE` (-1) for a row holding NaN or +inf (or all
  -inf), from the same reduction (no extra pass over the vocabulary)."""
  idx_B, top_B = _argmax_top(x_BV)
  return jnp.where(jnp.isfinite(top_B), idx_B, validate.NON_FINITE)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _greedy_step(graphdef, state, tokens_BT, num_real, cache):
  _TRACES['greedy'] += 1
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache, num_real)
  return argmax_or_non_finite(logits_BV).astype(tokens_BT.dtype), cache


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=4)
def _pick_step(graphdef, state, tokens_BT, num_real, cache, pick, pick_args):
  _TRACES['pick'] += 1
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache, num_real)
  return pick(logits_BV, *pick_args), cache


def greedy_pick(logits_BV, step, carry):
  """The greedy `decode_steps` pick: (argmax or NON_FINITE, 0, carry)."""
  del step
  return argmax_or_non_finite(logits_BV), jnp.zeros(logits_BV.shape[:1], jnp.float32), carry


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=(3,))
def _block_step(graphdef, state, tok_B, cache, num_steps, pick, block, carry):
  """Up to `block` decode steps (`num_steps` of them, traced) in one `lax.fori_loop`."""
  _TRACES['block'] += 1
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  one = jnp.int32(1)
  b = tok_B.shape[0]

  def body(i, loop):
    tok_B, new_BL, extra_BL, cache, carry = loop
    logits_BV, cache = _last_logits(model, tok_B[:, None], cache, one)
    tok_B, extra_B, carry = pick(logits_BV, i, carry)
    tok_B = tok_B.astype(new_BL.dtype)
    return (tok_B, new_BL.at[:, i].set(tok_B), extra_BL.at[:, i].set(extra_B), cache, carry)
  init = (tok_B, jnp.zeros((b, block), tok_B.dtype), jnp.zeros((b, block), jnp.float32),
          cache, carry)
  _, new_BL, extra_BL, cache, carry = lax.fori_loop(0, num_steps, body, init)
  return new_BL, extra_BL, cache, carry


def decode_steps(model: nnx.Module, tok_B: jax.Array, cache: KVCache, num_steps: int,
                 pick: Callable[..., Any] = greedy_pick, carry: Any = (), *,
                 block: Optional[int] = None):
  """`num_steps` decode steps in one dispatch: the loop runs on the device.

  A Python loop over `greedy_step` pays the host's per-step work (dispatch, argument
  handling) on every token; on an NVIDIA H200 that was half of a Llama-3.2-1B bf16 step at
  batch 1 (docs/accelerators.md). Here one jitted `lax.fori_loop` feeds each step's token
  to the next, and the host sees the tokens once, at the end.

  Args:
    model: a `Transformer`.
    tok_B: the last token of each row (int32), fed first.
    cache: the KV cache (donated: use the returned one); every row must have room for
      `num_steps` more positions (checked here, one read of the lengths).
    num_steps: steps to run (>= 1).
    pick: a hashable function `pick(logits_BV, step, carry) -> (tok_B, extra_B, carry)`
      traced inside the loop (`step` counts from 0 within this call); `extra_B` is a float
      per row kept for every step (the sampled token's log-probability, say).
    carry: a pytree threaded through `pick` (sampling parameters, seen-token masks).
    block: the loop's buffer length (>= num_steps; default the next power of two), so that
      calls with 5, 6 or 7 steps share one compilation.

  Returns:
    (new_BL, extra_BL, cache, carry): the L = num_steps tokens and extras of every row.
  """
  num_steps = validate.count(num_steps, 'num_steps', 'decode_steps')
  block = bucket_length(num_steps) if block is None else block
  if block < num_steps:
    raise ValueError(f'decode_steps: block={block} is shorter than num_steps={num_steps}; '
                     'pass block >= num_steps or None.')
  tok_B = validate.token_ids(tok_B, model.config.vocab_size, 'decode_steps', ndim=1,
                             check_values=False)
  lengths = _host_lengths(cache)
  if lengths is None:
    lengths = np.asarray(cache.length)
  kvcache.check_fits(dataclasses.replace(cache, length=lengths), num_steps)
  graphdef, state = _split(model)
  new_BL, extra_BL, cache, carry = _block_step(graphdef, state, jnp.asarray(tok_B), cache,
                                               np.int32(num_steps), pick, block, carry)
  _remember_lengths(cache, lengths + num_steps)
  return new_BL[:, :num_steps], extra_BL[:, :num_steps], cache, carry


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _logits_step(graphdef, state, tokens_BT, num_real, cache):
  _TRACES['logits'] += 1
  model = nnx.merge(getattr(graphdef, 'graphdef', graphdef), state)
  positions_BT = _fed_positions(cache, tokens_BT.shape[1], num_real)
  x_BTD, cache = model.blocks(model.embed_tokens(tokens_BT), positions_BT, cache)
  ok_B = validate.ids_in_range(tokens_BT, model.config.vocab_size, num_real)
  return model.logits(validate.poison_rows(x_BTD, ok_B)), kvcache.advance(cache, num_real)


def _padded_run(model, tokens_BT, cache, buckets, what: str, run: Callable):
  """`_check_and_run` with tokens_BT padded to its bucket where the cache has room.

  `run(static, state, tokens_BT, num_real)` dispatches the jitted step. Padding needs every
  row's length on the host (a full-length layer writes the padded width from each row's
  length on, and must not run past max_len); otherwise the call runs unpadded.
  """
  buckets = _check_buckets(buckets, what)
  # Host ids are checked here; device ids by dtype here and by value inside the step.
  tokens_BT = validate.token_ids(tokens_BT, model.config.vocab_size, what, ndim=2,
                                 check_values=False)
  t = tokens_BT.shape[1]
  width = bucket_length(t, buckets)
  if width > t and isinstance(cache, KVCache):
    lengths = _host_lengths(cache)
    if lengths is None and not isinstance(cache.length, jax.core.Tracer) and getattr(
        cache.length, 'is_fully_addressable', True):
      lengths = np.asarray(cache.length)
    room = None if lengths is None else cache.max_len - int(np.max(lengths))
    width = t if room is None else max(t, min(width, room))
  else:
    width = t
  fed_BT = _pad_tokens(tokens_BT, width)
  num_real = np.int32(t)
  return _check_and_run(model, tokens_BT, cache,
                        lambda g, s: run(g, s, fed_BT, num_real))


def decode_step(model: nnx.Module, tokens_BT: jax.Array, cache: KVCache,
                pick: Callable[..., Any], *pick_args,
                buckets: Optional[Sequence[int]] = None) -> tuple[Any, KVCache]:
  """Feed `tokens_BT` through the cached model and `pick` from the last position's logits.

  Args:
    model: a `Transformer`.
    tokens_BT: int token ids, T >= 1 per row (the prompt, or the last token).
    cache: the KV cache (donated: use the returned one).
    pick: a hashable function `pick(logits_BV, *pick_args) -> out` (a module-level function,
      so that the step compiles once per pick); traced inside the step.
    *pick_args: arrays (pytrees) passed to `pick`.
    buckets: a prompt (T > 1) is padded to `bucket_length(T, buckets)` so that the step
      compiles once per bucket: None = powers of two, a list of lengths, () = no padding.

  Returns:
    (out, cache): what `pick` returned, and the cache advanced by T. A row fed an id outside
    [0, V) reaches `pick` with NaN logits (`qjax.nn.validate`).
  """
  return _padded_run(model, tokens_BT, cache, buckets, 'decode_step', lambda g, s, x, n:
                     _pick_step(g, s, x, n, cache, pick, pick_args))


def logits_step(model: nnx.Module, tokens_BT: jax.Array, cache: KVCache, *,
                buckets: Optional[Sequence[int]] = ()) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model: (logits_BTV of every fed position, cache).

  The cache passed in is donated (its buffers are reused); use the returned one. `buckets`
  as `decode_step`, but off by default: a verifier feeds a fixed T, where padding only adds
  work. A row fed an id outside [0, V) gets NaN logits (`qjax.nn.validate`).
  """
  t = np.shape(tokens_BT)[1] if np.ndim(tokens_BT) == 2 else 0
  logits_BTV, cache = _padded_run(model, tokens_BT, cache, buckets, 'logits_step',
                                  lambda g, s, x, n: _logits_step(g, s, x, n, cache))
  return (logits_BTV if logits_BTV.shape[1] == t else logits_BTV[:, :t]), cache


def greedy_step(model: nnx.Module, tokens_BT: jax.Array, cache: KVCache, *,
                buckets: Optional[Sequence[int]] = None) -> tuple[jax.Array, KVCache]:
  """Feed `tokens_BT` through the cached model; the argmax next token_B and the new cache.

  The cache passed in is donated (its buffers are reused); use the returned one. A step that
  would write past the cache's max_len raises here, on the host, naming the row. A prompt
  (T > 1) is padded to its bucket (`decode_step`'s `buckets`): one compile per bucket.
  A row whose logits are not finite (NaN weights, an overflow, an id outside [0, V) fed on
  the device) gets the token `validate.NON_FINITE` (-1), never an argmax of NaN.
  """
  return _padded_run(model, tokens_BT, cache, buckets, 'greedy_step',
                     lambda g, s, x, n: _greedy_step(g, s, x, n, cache))


def greedy_generate(model: nnx.Module, prompt_BT: jax.Array, num_steps: int, *,
                    buckets: Optional[Sequence[int]] = None) -> jax.Array:
  """Greedy continuation of `prompt_BT` by `num_steps` tokens.

  Args:
    model: a `Transformer` (float, quantized or fake-quantized).
    prompt_BT: int token ids, the same length for every row.
    num_steps: tokens to generate (>= 0).
    buckets: the prompt is padded to `bucket_length(T, buckets)` and the cache sized to
      `bucket_length(T + num_steps, buckets)` (at most config.max_len), so that prefill and
      decode compile once per bucket: None = powers of two, a list, () = exact sizes.

  Returns:
    tokens of shape (B, T + num_steps): the prompt followed by the generated tokens.

  Raises:
    ValueError: bad ids (`qjax.nn.validate.token_ids`: read once, on the host) or counts.
    FloatingPointError: non-finite logits at some step (read once, after the loop).

  The cache stores K/V in the model's KV format (`kv_format(model)`; float when it has none).
  """
  cfg = model.config
  prompt_BT = validate.token_ids(prompt_BT, cfg.vocab_size, 'greedy_generate', ndim=2)
  num_steps = validate.count(num_steps, 'num_steps', 'greedy_generate', minimum=0)
  b, t = prompt_BT.shape
  if t + num_steps > cfg.max_len:
    raise ValueError(f'greedy_generate: a prompt of {t} tokens + {num_steps} steps = '
                     f'{t + num_steps} exceeds config.max_len={cfg.max_len}; shorten the '
                     'prompt or generate fewer tokens.')
  if num_steps == 0:
    return jnp.asarray(prompt_BT)
  buckets = _check_buckets(buckets, 'greedy_generate')
  size = min(cfg.max_len, max(t + num_steps, bucket_length(t + num_steps, buckets)))
  cache = kvcache.init_cache(cfg, b, size, fmt=kv_format(model))
  graphdef, state = _split(model)  # the sizes above make every step fit: no further checks
  width = min(size, max(t, bucket_length(t, buckets)))
  tok_B, cache = _greedy_step(graphdef, state, _pad_tokens(prompt_BT, width), np.int32(t),
                              cache)
  out = [prompt_BT, tok_B[:, None]]
  if num_steps > 1:  # the rest in one dispatch, the loop on the device
    new_BL, _, cache, _ = _block_step(graphdef, state, tok_B, cache, np.int32(num_steps - 1),
                                      greedy_pick, bucket_length(num_steps - 1), ())
    out.append(new_BL[:, :num_steps - 1])
  out = jnp.concatenate(out, axis=1)
  validate.raise_non_finite(out, 'greedy_generate', start=t)
  return out
