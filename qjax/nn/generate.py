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

`decode_loop` dispatches the library's one decode loop (`qjax.nn.decode_core.run_block`, a
jitted `lax.while_loop` of up to `decode_block` (U) steps) with a model step: the token choice
(`pick`), stop tokens, per-row token limits and finished rows stay on the device; the host
reads the tokens once per block and dispatches the next block before it reads (jax dispatch
is asynchronous), so the device is not idle while the host handles a block.
`greedy_generate`, `decode_steps` and `qjax.infer.sample_generate` run on it; the engine and
speculative decoding run their own steps on the same `run_block`. The host-side split of the
model (once per model, its graphdef hashed once, bf16 widened once on XLA:CPU) is
`qjax.nn.model_split`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

from qjax.nn import decode_core
from qjax.nn import kvcache
from qjax.nn import traces
from qjax.nn import validate
from qjax.nn.attention import kv_format
from qjax.nn.decode_core import LoopState, stop_table  # noqa: F401  (re-exported)
from qjax.nn.kvcache import KVCache
from qjax.nn.model_split import host_lengths as _host_lengths
from qjax.nn.model_split import merge as _merge
from qjax.nn.model_split import remember_lengths as _remember_lengths
from qjax.nn.model_split import split_for_decode as _split


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


def _last_logits(model, tokens_BT, cache, num_real):
  """`model(tokens_BT[:, :num_real], cache=cache)` with the head on the last real position;
  NaN logits for a row fed an id outside the vocabulary (`qjax.nn.validate`).

  A prefill of T tokens otherwise computes T x V logits to keep one row (Gemma: 512 x 262k,
  a 512 MiB buffer and ~2/3 of the prefill's FLOPs). The checks `Transformer.__call__` makes
  on the cache run on the host in `_check_and_run`.
  """
  x_BTD, cache = kvcache.forward(model, tokens_BT, cache, num_real, num_real=num_real)
  x_B1D = jax.lax.dynamic_slice_in_dim(x_BTD, num_real - 1, 1, axis=1)
  # Poisoning the (B, 1, D) hidden state, not the (B, V) logits: no extra pass over V.
  ok_B = validate.ids_in_range(tokens_BT, model.config.vocab_size, num_real)
  x_B1D = validate.poison_rows(x_B1D, ok_B)
  return model.logits(x_B1D)[:, 0], cache


# The names under which each jitted step counts its traces (`qjax.nn.traces`).
_STEPS = {'greedy': 'generate.greedy', 'pick': 'generate.pick', 'logits': 'generate.logits',
          'block': 'generate.block'}


def step_compilations() -> dict[str, int]:
  """How many times each jitted step was traced (= compiled) in this process.

  Keys: 'greedy' (`greedy_step`, `greedy_generate`'s prefill), 'pick' (`decode_step`),
  'logits' (`logits_step`), 'block' (`decode_steps`: the decode loops' many-step dispatch).
  A step compiles once per (padded) token width, cache shape and model structure; with
  buckets, prompts of lengths 5, 6 and 7 share the width 8.
  """
  return {key: traces.count(name) for key, name in _STEPS.items()}


def argmax_last(x_BV: jax.Array) -> jax.Array:
  """`jnp.argmax(x_BV, axis=-1)` as two plain reductions (max, then the first index at it).

  XLA:CPU lowers argmax to a variadic (value, index) reduce that it does not vectorise, a
  visible share of a decode step over a 262k vocabulary (docs/fast_decode.md); a max and a
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
  traces.traced(_STEPS['greedy'])
  model = _merge(graphdef, state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache, num_real)
  return argmax_or_non_finite(logits_BV).astype(tokens_BT.dtype), cache


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=4)
def _pick_step(graphdef, state, tokens_BT, num_real, cache, pick, pick_args):
  traces.traced(_STEPS['pick'])
  model = _merge(graphdef, state)
  logits_BV, cache = _last_logits(model, tokens_BT, cache, num_real)
  return pick(logits_BV, *pick_args), cache


def greedy_pick(logits_BV, count_B, carry):
  """The greedy `decode_loop` pick: (argmax or NON_FINITE, 0, carry)."""
  del count_B
  return argmax_or_non_finite(logits_BV), jnp.zeros(logits_BV.shape[:1], jnp.float32), carry


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def _loop_block(graphdef, state, cache, loop: LoopState, pick, block: int):
  """Up to `block` decode steps of the live rows on `decode_core.run_block`."""
  traces.traced(_STEPS['block'])
  model = _merge(graphdef, state)
  one = jnp.int32(1)

  def step(loop, cache):
    logits_BV, cache = _last_logits(model, loop.tok_B[:, None], cache, one)
    tok_B, extra_B, carry = pick(logits_BV, loop.count_B, loop.carry)
    return tok_B[:, None], extra_B[:, None], jnp.ones_like(loop.count_B), carry, cache

  out, cache = decode_core.run_block(step, loop, cache, block)
  return cache, out.state, out.tok_BW, out.extra_BW


class DecodeLoop:
  """`decode_loop`'s iterator: one `(new_BW, extra_BW, num_B)` per block; `state` and `cache`
  hold the latest dispatch's (the last one's once iteration ends)."""

  def __init__(self, model, cache, state: LoopState, pick, decode_block: int, steps: int):
    self.pick, self.block, self.steps_left = pick, decode_block, steps
    self.static, self.weights = _split(model)
    self.cache, self.state = cache, state

  def _dispatch(self):
    before = self.state
    self.cache, self.state, new_BW, extra_BW = _loop_block(
        self.static, self.weights, self.cache, before, self.pick, self.block)
    self.steps_left -= self.block
    return before.count_B, self.state.count_B, self.state.live_B, new_BW, extra_BW

  def __iter__(self):
    pending = self._dispatch() if self.steps_left > 0 else None
    while pending is not None:
      # The next block is queued before this one is read, so the device does not wait for
      # the host; a block queued after every row stopped early (a stop token) runs no step.
      nxt = self._dispatch() if self.steps_left > 0 else None
      count0_B, count_B, live_B, new_BW, extra_BW = jax.device_get(pending)
      yield new_BW, extra_BW, count_B - count0_B
      if not live_B.any():
        return
      pending = nxt


def decode_loop(model: nnx.Module, cache: KVCache, state: LoopState, *,
                pick: Callable[..., Any] = greedy_pick,
                decode_block: int = 8) -> DecodeLoop:
  """Decode the live rows of `state` until each is finished, U = `decode_block` steps per
  dispatch; iterate it for the tokens.

  Args:
    model: a `Transformer`.
    cache: its KV cache (donated: read the final one from the returned loop's `cache`); every
      row must have room for the steps the longest row has left (checked here, on the host).
    state: the rows' `LoopState` (`LoopState.start`).
    pick: a hashable function `pick(logits_BV, count_B, carry) -> (tok_B, extra_B, carry)`
      traced inside the loop (`count_B`: each row's output index of the token drawn);
      `extra_B` is a float per row kept for every step (the token's log-probability, say).
    decode_block: U, steps per dispatch (one compilation per U).

  Returns:
    A `DecodeLoop`: iterating it yields, per block, (new_BW, extra_BW, num_B) on the host:
    row b generated new_BW[b, :num_B[b]] in that block (later columns repeat its last
    token, extra 0). Stop tokens end a row and are kept; a `NON_FINITE` token ends it too.
  """
  decode_block = validate.count(decode_block, 'decode_block', 'decode_loop')
  lengths = _host_lengths(cache)
  if lengths is None:
    lengths = np.asarray(cache.length)
  count_B, max_B, live_B = jax.device_get((state.count_B, state.max_B, state.live_B))
  steps = int(np.max(np.where(live_B, max_B - count_B, 0), initial=0))
  kvcache.check_fits(dataclasses.replace(cache, length=lengths), steps)
  return DecodeLoop(model, cache, state, pick, decode_block, steps)


def decode_steps(model: nnx.Module, tok_B: jax.Array, cache: KVCache, num_steps: int,
                 pick: Callable[..., Any] = greedy_pick, carry: Any = (), *,
                 block: Optional[int] = None):
  """`num_steps` decode steps in one dispatch of `decode_loop`: the loop runs on the device.

  A Python loop over `greedy_step` pays the host's per-step work (dispatch, argument
  handling) on every token; on an NVIDIA H200 that was half of a Llama-3.2-1B bf16 step at
  batch 1 (docs/accelerators.md). Here the steps run in one jitted `lax.while_loop`, and the
  host sees the tokens once, at the end.

  Args:
    model: a `Transformer`.
    tok_B: the last token of each row (int32), fed first.
    cache: the KV cache (donated: use the returned one); every row must have room for
      `num_steps` more positions (checked here, one read of the lengths).
    num_steps: steps to run (>= 1).
    pick: as `decode_loop`'s (`count_B` counts from 0 within this call).
    carry: a pytree threaded through `pick` (sampling parameters, seen-token masks).
    block: the loop's buffer length (>= num_steps; default the next power of two), so that
      calls with 5, 6 or 7 steps share one compilation.

  Returns:
    (new_BO, extra_BO, cache, carry): the O = num_steps tokens and extras of every row (a row
    that met a `NON_FINITE` token repeats it).
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
  tok_B = jnp.asarray(tok_B, jnp.int32)
  loop = LoopState(tok_B, jnp.zeros(tok_B.shape, jnp.int32),
                   jnp.full(tok_B.shape, num_steps, jnp.int32),
                   jnp.full(tok_B.shape + (1,), -1, jnp.int32), tok_B >= 0, carry)
  # (No host copy of the lengths: a row that met NON_FINITE may stop the loop early.)
  cache, loop, new_BO, extra_BO = _loop_block(graphdef, state, cache, loop, pick, block)
  return new_BO[:, :num_steps], extra_BO[:, :num_steps], cache, loop.carry


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _logits_step(graphdef, state, tokens_BT, num_real, cache):
  traces.traced(_STEPS['logits'])
  model = _merge(graphdef, state)
  x_BTD, cache = kvcache.forward(model, tokens_BT, cache, num_real, num_real=num_real)
  ok_B = validate.ids_in_range(tokens_BT, model.config.vocab_size, num_real)
  return model.logits(validate.poison_rows(x_BTD, ok_B)), cache


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


def collect(loop: DecodeLoop, num: int) -> tuple[np.ndarray, np.ndarray]:
  """(new_BO, extra_BO): the first `num` tokens and extras `loop` generates per row, on the
  host; a row that stopped early repeats its last token (extra 0) to width O = num."""
  b = loop.state.tok_B.shape[0]
  toks, extras = [np.zeros((b, 0), np.int32)], [np.zeros((b, 0), np.float32)]
  for new_BW, extra_BW, num_B in loop:
    k = int(np.max(num_B, initial=0))  # finished rows repeat their last token up to k
    toks.append(new_BW[:, :k])
    extras.append(extra_BW[:, :k])
  new_BO = np.concatenate(toks, axis=1)[:, :num]
  extra_BO = np.concatenate(extras, axis=1)[:, :num]
  short = num - new_BO.shape[1]
  if short:  # every row stopped early (or none had a token to generate)
    last_B1 = np.asarray(loop.state.tok_B)[:, None]
    new_BO = np.concatenate([new_BO, np.repeat(last_B1, short, axis=1)], axis=1)
    extra_BO = np.concatenate([extra_BO, np.zeros((b, short), np.float32)], axis=1)
  return new_BO, extra_BO


def greedy_generate(model: nnx.Module, prompt_BT: jax.Array, num_steps: int, *,
                    buckets: Optional[Sequence[int]] = None,
                    decode_block: Optional[int] = None) -> jax.Array:
  """Greedy continuation of `prompt_BT` by `num_steps` tokens.

  Args:
    model: a `Transformer` (float, quantized or fake-quantized).
    prompt_BT: int token ids, the same length for every row.
    num_steps: tokens to generate (>= 0).
    buckets: the prompt is padded to `bucket_length(T, buckets)` and the cache sized to
      `bucket_length(T + num_steps, buckets)` (at most config.max_len), so that prefill and
      decode compile once per bucket: None = powers of two, a list, () = exact sizes.
    decode_block: decode steps per dispatch of `decode_loop`; None: all of them in one
      (padded to a power of two, so nearby lengths share a compilation).

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
  graphdef, state = _split(model)
  width = min(size, max(t, bucket_length(t, buckets)))
  tok_B, cache = _greedy_step(graphdef, state, _pad_tokens(prompt_BT, width), np.int32(t),
                              cache)
  out = [np.asarray(prompt_BT), np.asarray(tok_B)[:, None]]
  if num_steps > 1:  # the rest on the device, `decode_block` steps per dispatch
    _remember_lengths(cache, np.full((b,), t, np.int32))  # the sizes above make it fit
    block = bucket_length(num_steps - 1) if decode_block is None else decode_block
    loop = decode_loop(model, cache, LoopState.start(tok_B, num_steps, count_B=np.ones(b)),
                       decode_block=block)
    out.append(collect(loop, num_steps - 1)[0])
  out = np.concatenate(out, axis=1).astype(np.int32)
  validate.raise_non_finite(out, 'greedy_generate', start=t)
  return jnp.asarray(out)
