"""Checks at the library's boundary: token ids, counts, string lists, non-finite logits.

Every public entry point that takes token ids (`Transformer.__call__`, `greedy_generate`,
`greedy_step`, `decode_step`, `logits_step`, `sample_generate`, `speculative_generate`,
`Engine.add_request` / `generate`) checks them here, once per call and on the host, so a bad
value is an error that names it and the fix instead of a silently wrong output.

The contract inside `jax.jit` (values unknown while tracing): JAX's gather wraps a negative
id and clamps an id >= V, silently. qjax turns that into NaN instead:
* under jit the model embeds an id outside [0, V) as NaN (`Transformer.embed_tokens`), which
  reaches the logits of its position and of later ones;
* the jitted steps of `qjax.nn.generate` check each row's ids: a row fed one gets NaN logits;
* a row whose logits are not finite yields the token `NON_FINITE` (-1) instead of an argmax
  (which would be id 0): the loops (`greedy_generate`, `sample_generate`,
  `speculative_generate`) raise on it and the engine ends that request with finish reason
  'error'.
A forward jitted by the caller gives NaN logits for a bad id rather than raising;
`checked_forward` is its checked variant, which raises.

Device arrays passed to the per-token steps are checked for their dtype only (reading the
values back would wait for the previous step and serialise the loop); their values are
covered by the in-step check above.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

NON_FINITE = -1  # the token a jitted step returns for a row whose logits are not finite


def token_ids(tokens: Any, vocab_size: int, what: str, *, ndim: Optional[int] = None,
              check_values: bool = True):
  """`tokens` checked as token ids: integer dtype, in [0, vocab_size), of rank `ndim`.

  Args:
    tokens: a list (nested for 2-d), a numpy array, a jax array or a tracer.
    vocab_size: V.
    what: the entry point, for the message ('greedy_generate', 'request 3', ...).
    ndim: the rank required (1: one prompt, 2: a (B, T) batch), or None (any).
    check_values: read a concrete jax array back to check its values (a host input is always
      checked; a tracer never is).

  Returns:
    A numpy int32 array for host input (lists, numpy); a jax array or tracer unchanged.

  Raises:
    ValueError: naming the bad value and the fix (a float, bool or None id, a ragged or
      wrongly shaped prompt, an empty prompt, an id outside the vocabulary).
  """
  on_device = isinstance(tokens, jax.Array)
  if on_device:
    ids = tokens
  else:
    try:
      ids = np.asarray(tokens)
    except ValueError:  # ragged nested lists
      raise ValueError(f'{what}: token ids {_short(tokens)} are ragged; give every row the '
                       'same length (pad, or run the rows separately).') from None
    if not isinstance(tokens, np.ndarray):  # numpy would turn True into 1 and 3 into '3'
      elements = np.asarray(tokens, dtype=object)
      flags = [x for x in elements.ravel() if isinstance(x, (bool, np.bool_))]
      if flags:
        raise ValueError(f'{what}: token id {flags[0]!r} is a bool, not an integer; pass int '
                         "ids (the tokenizer's output).")
      if ids.dtype.kind in 'USV':
        ids = elements
  if ids.dtype == object or ids.dtype.kind in 'USV':
    flat = np.ravel(ids)
    not_int = [x for x in flat if not isinstance(x, numbers.Integral) or isinstance(x, bool)]
    if not_int or not len(flat) or ids.dtype != object:
      bad = not_int[0] if not_int else ids.dtype
      bad = bad.item() if isinstance(bad, np.generic) else bad
      raise ValueError(f'{what}: token id {bad!r} is not an integer; pass int ids (the '
                       "tokenizer's output).")
    outside = [x for x in flat if not 0 <= x < vocab_size]  # e.g. ints too large for int64
    if outside:
      raise ValueError(f'{what}: token id {outside[0]} is outside the vocabulary [0, '
                       f"{vocab_size}); use the model's tokenizer (ids < config.vocab_size).")
    ids = ids.astype(np.int64)
  if ids.size == 0 and (ndim is not None or not on_device):
    if ndim is not None:
      raise ValueError(f'{what}: the prompt is empty (shape {tuple(ids.shape)}); give at '
                       'least one token.')
    return ids.astype(np.int32)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    hint = ', e.g. np.asarray(ids, np.int32) if the ids are whole numbers'
    raise ValueError(f'{what}: token ids must be integers, got dtype {ids.dtype}; pass the '
                     f"tokenizer's int ids{hint}.")
  if ndim is not None and ids.ndim != ndim:
    shape = '(T,), one prompt' if ndim == 1 else '(B, T), a batch of prompts'
    fix = ('wrap it: [prompt]' if ids.ndim == ndim - 1 else
           'pass one prompt' if ids.ndim > ndim else 'reshape it')
    raise ValueError(f'{what}: token ids of shape {tuple(ids.shape)}; expected shape {shape}; '
                     f'{fix}.')
  if isinstance(ids, jax.core.Tracer) or (on_device and not check_values):
    return ids
  host = np.asarray(ids)
  bad = (host < 0) | (host >= vocab_size)
  if bad.any():
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    raise ValueError(f'{what}: token id {int(host[i])} at index {i} is outside the '
                     f'vocabulary [0, {vocab_size}); {int(bad.sum())} id(s) are. Use the '
                     "model's tokenizer (ids < config.vocab_size).")
  return ids if on_device else host.astype(np.int32)


def count(value: Any, name: str, what: str, *, minimum: int = 1) -> int:
  """`value` as an int >= `minimum`; refuses bools, floats (even 2.0) and other types."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f'{what}: {name}={value!r} must be an int >= {minimum} (got '
                     f'{type(value).__name__}).')
  if value < minimum:
    raise ValueError(f'{what}: {name}={value!r} must be an int >= {minimum}.')
  return int(value)


def string_tuple(value: Any, name: str, what: str) -> tuple[str, ...]:
  """`value` as a tuple of non-empty strings; a bare str is refused (it is not a list of
  its characters)."""
  if isinstance(value, (str, bytes)):
    raise ValueError(f'{what}: {name}={value!r} is one string, not a sequence of them (it '
                     f'would match each character); pass {name}=({value!r},).')
  try:
    out = tuple(value)
  except TypeError:
    raise ValueError(f'{what}: {name}={value!r} must be a sequence of str.') from None
  for s in out:
    if not isinstance(s, str) or not s:
      raise ValueError(f'{what}: {name} contains {s!r}; its entries are non-empty str.')
  return out


def int_tuple(value: Any, name: str, what: str) -> tuple[int, ...]:
  """`value` as a tuple of ints >= 0 (token ids); a bare int is refused with the fix."""
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    raise ValueError(f'{what}: {name}={value!r} is one id, not a sequence of them; pass '
                     f'{name}=({value!r},).')
  try:
    out = tuple(value)
  except TypeError:
    raise ValueError(f'{what}: {name}={value!r} must be a sequence of int token ids.') from None
  for tok in out:
    if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
      raise ValueError(f'{what}: {name} contains {tok!r}; token ids are ints >= 0.')
  return tuple(int(t) for t in out)


def ids_in_range(tokens_BT: jax.Array, vocab_size: int, num_real=None) -> jax.Array:
  """In-jit: whether each row's (first `num_real`) ids lie in [0, vocab_size), shape (B,)."""
  ok_BT = (tokens_BT >= 0) & (tokens_BT < vocab_size)
  if num_real is not None:
    ok_BT = ok_BT | (jnp.arange(tokens_BT.shape[1])[None] >= num_real)
  return jnp.all(ok_BT, axis=1)


def poison_ids(x_BTD: jax.Array, tokens_BT: jax.Array, vocab_size: int) -> jax.Array:
  """In-jit: NaN embeddings where an id is outside [0, vocab_size) (gather would clamp it)."""
  ok_BT = (tokens_BT >= 0) & (tokens_BT < vocab_size)
  return jnp.where(ok_BT[..., None], x_BTD, jnp.nan)


def poison_rows(logits_BxV: jax.Array, ok_B: jax.Array) -> jax.Array:
  """In-jit: NaN logits for the rows not `ok_B` (logits of rank >= 2, rows first)."""
  ok = ok_B.reshape(ok_B.shape + (1,) * (logits_BxV.ndim - 1))
  return jnp.where(ok, logits_BxV, jnp.nan)


def finite_rows(logits_BV: jax.Array) -> jax.Array:
  """In-jit: whether each row's logits are all finite, shape (B,) (the max propagates NaN)."""
  return jnp.isfinite(jnp.max(logits_BV, axis=-1))


def mark_non_finite(tok_B: jax.Array, logits_BV: jax.Array) -> jax.Array:
  """In-jit: `tok_B` with `NON_FINITE` where the row's logits are not finite."""
  return jnp.where(finite_rows(logits_BV), tok_B, jnp.asarray(NON_FINITE, tok_B.dtype))


def raise_non_finite(tokens_BO, what: str, start: int = 0) -> None:
  """Host: raise if a generated token is `NON_FINITE`, naming the row and the step.

  Args:
    tokens_BO: generated tokens (one host read, after the loop).
    what: the loop, for the message.
    start: the column of the first generated token.
  """
  if isinstance(tokens_BO, jax.core.Tracer):  # a loop traced by an outer jit: no values
    return
  out = np.asarray(tokens_BO)[:, start:]
  hit = np.argwhere(out == NON_FINITE)
  if hit.size:
    row, step = (int(j) for j in hit[0])
    raise FloatingPointError(
        f'{what}: the logits of row {row} at generated token {step} are not finite (NaN or '
        'inf), so no token can be chosen; the weights hold NaN/inf, an activation overflowed '
        '(try float32 compute) or a token id fed on the device was outside the vocabulary. '
        'Check the weights (e.g. jnp.isfinite on every parameter).')


def checked_forward(model, tokens_BT, **kwargs):
  """`model(tokens_BT, **kwargs)` jitted, with the ids and the logits checked on the device.

  The checked variant of a caller's own `jax.jit(model)`: ids outside [0, V) and non-finite
  logits raise (`checkify`) instead of turning into NaN or being passed on. It compiles on
  each call (`kwargs` are closed over): meant for debugging and tests, not a serving loop.

  Returns:
    what `model(tokens_BT, **kwargs)` returns.

  Raises:
    ValueError: a token id outside the vocabulary, or non-finite logits.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  token_ids(tokens_BT, model.config.vocab_size, 'checked_forward', check_values=False)
  graphdef, state = nnx.split(model)
  vocab = model.config.vocab_size

  def run(state, tokens_BT):
    checkify.check(jnp.all((tokens_BT >= 0) & (tokens_BT < vocab)),
                   f'checked_forward: a token id is outside the vocabulary [0, {vocab}); use '
                   "the model's tokenizer.")
    out = nnx.merge(graphdef, state)(tokens_BT, **kwargs)
    logits = out[0] if isinstance(out, tuple) else out
    checkify.check(jnp.all(jnp.isfinite(logits)),
                   'checked_forward: the logits are not finite (NaN or inf); check the '
                   'weights for NaN/inf or compute in float32.')
    return out

  err, out = _checked_jit(run)(state, jnp.asarray(tokens_BT))
  try:
    err.throw()
  except checkify.JaxRuntimeError as e:
    raise ValueError(str(e).split('(check failed at')[0].strip()) from None
  return out


def _checked_jit(fn):
  return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))


def _short(value, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + '...'
