"""The KV cache: a small pytree and the only functions that touch its arrays.

Every read and write of cached keys and values goes through this module, so that paged,
sharded or quantized caches can replace `KVCache` without touching the attention code.

Layout: one (k_BSKH, v_BSKH) pair per layer, S = the cache's max length, keys stored after
RoPE. Slot s of every row holds position s; `length` (int32 of shape (B,)) is the number of
positions written to each row, so the rows of one batch may hold sequences of different
lengths (a ragged batch: rows prefilled apart and stacked, or a batch whose rows finish at
different steps). A step writes T new positions at slot `length[b]` of row b in every layer
(`write`), then the model advances every row's length by T once (`advance`). Slots at or
beyond `length[b] + T` hold zeros or stale keys; they sit at positions later than every
query of that row, so the causal mask already hides them. `write` puts each new key at the
slot of its position, so attention under a sharded layout writes the rows it holds without
reading `length` (which `qjax.sharding` keeps replicated: positions are computed from it
outside attention, where every shard wants them whole).

Sliding-window layers keep a ring (default; `init_cache(..., ring=False)` turns it off). A
local layer of window w only ever reads the last w positions, so its buffer has R = w +
`ring_slack` slots and position p lives in slot p mod R (Gemma 3 270M at 32k context: five of
six layers hold 576 slots instead of 32,768). Which position a ring slot holds is computed,
not stored: the latest p < end with p = s mod R, where end is one past the row's last written
position. The slack is what makes two things exact:
* rollback (lowering `length`, as speculative decoding does after a rejected draft): after a
  call, a row's length may be lowered by up to `ring_slack` tokens. The overwritten slots then
  held positions at least w + 1 before every later query, outside its window.
* a call of T <= ring_slack + 1 tokens writes first and then reads the ring (no key a query
  needs is overwritten in the same call). A longer call (a long prefill) reads the ring as it
  was, attends over it plus the chunk's own keys, and writes only the last R positions.
Rule: `ring_slack` >= the largest number of tokens a caller rolls back (speculative decoding:
gamma); the default 64 covers gamma <= 64. A ring needs w + ring_slack < max_len, otherwise
the layer keeps max_len slots. Tokens at positions >= `EMPTY_POSITION` (padding a bucketed
prefill, `qjax.nn.generate`) are not written to a ring (`qjax.infer.PagedKVCache` keeps a ring
of pages for local layers the same way).

Other cache types. `write` hands a cache that is not a `KVCache` to its own
`cache.write(layer, k_BTKH, v_BTKH, positions_BT)`, and attention then calls
`cache.attend(layer, q_BTNH, positions_BT, window=, logit_softcap=)`; that is the whole
protocol a paged cache implements (it also has `k`, `v` and `qformat`, for `through_format`).
`forward(model, tokens_BT, cache, num_new_B)` runs a model's layers over a `KVCache` under a
caller's jit, each row's length advanced by its own count: the cache forward speculative
rounds take (`qjax.infer.spec_round`; `qjax.infer.paged.forward` is the paged cache's).

Overflow. Writing past `max_len` would clamp onto the last slots and run on with plausible
numbers, so `check_fits` raises: the model's forward calls it when the lengths are concrete,
and the jitted step functions (`qjax.nn.generate.greedy_step` / `decode_step` /
`logits_step`, the engine) call it on the host at the step boundary, before they dispatch.
Under a caller's own jit nothing can raise: the forward makes an overflowing row's logits
NaN (`poison_overflow`), as it does for an out-of-vocabulary id.

Quantized storage: `init_cache(..., fmt='int8')` (or 'int4', 'fp8', 'fp8_e5m2', or a
`QFormat` with a scale per token and kv head) stores every layer's keys and values as a
`QArray`; `write` quantizes the new tokens, `read` dequantizes. Scales never span tokens, so
a write never changes what earlier tokens decode to. `cache.format` names the storage (for
conversion records). `through_format` gives a cache-free forward the same K/V values (the
attention's `kv_fmt` hook, for QAT and for perplexity under a quantized cache).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core import (QArray, QFormat, dequantize, fake_quant, fp8_format, int_format,
                       quantize)
from qjax.nn.config import TransformerConfig

# Ring slots beyond a local layer's window (module docstring): the most tokens one row may
# be rolled back by after a call, and one less than the longest write-then-read call.
DEFAULT_RING_SLACK = 64
# Position of a slot or token that holds nothing (`qjax.nn.attention.EMPTY_POSITION`): later
# than every query, so the causal mask hides it.
EMPTY_POSITION = 2 ** 30

# Quantized cache formats by name: a scale per (batch, slot, kv head), shared by the H
# features of one head. (A QFormat may also group H, e.g. group_size=32, group_axis=3.)
KV_FORMATS = {
    'int8': int_format(8, channel_axes=(0, 1, 2)),
    'int4': int_format(4, channel_axes=(0, 1, 2)),
    'fp8': fp8_format('e4m3', channel_axes=(0, 1, 2)),
    'fp8_e5m2': fp8_format('e5m2', channel_axes=(0, 1, 2)),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Cached keys and values.

  Attributes:
    k: per layer, keys k_BSKH (after RoPE), in the cache dtype or as a QArray.
    v: per layer, values v_BSKH.
    length: int32 of shape (B,): positions written so far to each row (row b's next write
      goes to slot length[b]).
    qformat: the QFormat quantized storage is written in (static; axes non-negative, as
      `check_format` returns them), or None for a float cache.
    windows: per layer, the window w of a layer kept as a ring of `k[layer].shape[1]` slots,
      or 0 for a layer of max_len slots (static; () = every layer full length).
    capacity: positions a row holds, max_len (static; 0 = `k[0].shape[1]`, a cache without
      rings).
  """

  k: tuple[Union[jax.Array, QArray], ...]
  v: tuple[Union[jax.Array, QArray], ...]
  length: jax.Array
  qformat: Optional[QFormat] = dataclasses.field(default=None, metadata=dict(static=True))
  windows: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  capacity: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def max_len(self) -> int:
    return self.capacity or int(self.k[0].shape[1])

  def ring_size(self, layer: int) -> int:
    """R, the slots of `layer` when it is a ring, else 0."""
    if not self.windows or not self.windows[layer]:
      return 0
    return int(self.k[layer].shape[1])

  @property
  def batch(self) -> int:
    return int(self.k[0].shape[0])

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def format(self) -> str:
    """Storage format for records: a dtype name ('float32') or a QFormat name ('int8-ch012')."""
    if self.qformat is None:
      return jnp.dtype(self.k[0].dtype).name
    return self.qformat.name


def init_cache(config: TransformerConfig, batch: int, max_len: Optional[int] = None,
               dtype=None, fmt: Union[None, str, QFormat] = None, *, ring: bool = True,
               ring_slack: int = DEFAULT_RING_SLACK) -> KVCache:
  """An empty cache.

  Args:
    config: the model's config (layers, K, H, windows).
    batch: B.
    max_len: S, the longest prompt + generation the cache holds (default `config.max_len`).
    dtype: storage dtype of a float cache, and the dtype a quantized one reads back as
      (default `config.dtype`).
    fmt: None (float storage), a name in `KV_FORMATS`, or a QFormat whose scales are per
      token and kv head (channel axes 0, 1, 2 of k_BSKH; groups only along H).
    ring: keep each sliding-window layer as a ring of window + ring_slack slots where that
      is shorter than max_len (module docstring); False: every layer keeps max_len slots.
    ring_slack: ring slots beyond the window: at least the most tokens a caller rolls a row
      back by after a call (speculative decoding: gamma).

  Returns:
    A KVCache of zeros; every row's length is 0.
  """
  max_len = config.max_len if max_len is None else max_len
  if not 1 <= max_len <= config.max_len:
    raise ValueError(f'init_cache: max_len={max_len} must be in [1, config.max_len='
                     f'{config.max_len}]; the model is not defined beyond config.max_len.')
  if batch < 1:
    raise ValueError(f'init_cache: batch={batch} must be >= 1.')
  if not isinstance(ring_slack, int) or ring_slack < 1:
    raise ValueError(f'init_cache: ring_slack={ring_slack!r} must be a positive integer (at '
                     'least the most tokens a row is rolled back by); or pass ring=False.')
  windows = []
  for layer in range(config.num_layers):
    w = config.window(layer) if ring else None
    windows.append(w if w is not None and w + ring_slack < max_len else 0)
  dtype = jnp.dtype(dtype or config.dtype)
  fmt = check_format(fmt, config.head_dim)

  def zeros():  # distinct buffers per leaf, so that the cache can be donated
    out = []
    for w in windows:
      shape = (batch, w + ring_slack if w else max_len, config.num_kv_heads, config.head_dim)
      # all-zero groups quantize to codes 0, scale 1
      out.append(jnp.zeros(shape, dtype) if fmt is None else
                 quantize(jnp.zeros(shape, dtype), fmt))
    return tuple(out)
  return KVCache(k=zeros(), v=zeros(), length=jnp.zeros((batch,), jnp.int32), qformat=fmt,
                 windows=tuple(windows) if any(windows) else (),
                 capacity=max_len if any(windows) else 0)


def overflow_message(row: int, length: int, num_new: int, max_len: int,
                     what: str = 'KV cache') -> str:
  """The error text for a row whose `length + num_new` positions exceed `max_len`."""
  return (f'{what}: sequence at row {row} has {length} cached + {num_new} new tokens exceed '
          f'the cache max_len={max_len} ({length + num_new} > {max_len}); build a longer cache '
          '(init_cache(..., max_len=)) or stop generating.')


def _raise_if_overflow(length_B, num_new, max_len) -> None:
  lengths = np.asarray(length_B)
  over = np.nonzero(lengths + int(num_new) > int(max_len))[0]
  if over.size:
    row = int(over[0])
    raise ValueError(overflow_message(row, int(lengths[row]), int(num_new), int(max_len)))


def check_fits(cache: KVCache, num_new: int) -> None:
  """Raise if `num_new` more positions cannot fit in every row.

  With concrete lengths the check runs here; with traced ones (inside `jit`) it is skipped:
  the step functions check on the host before they dispatch the jitted step. Where this process
  does not hold every row (multi-process), only `num_new` is checked.
  """
  if cache.length.shape != (cache.batch,):
    raise ValueError(f'KV cache: length has shape {cache.length.shape}, but a cache of batch '
                     f'{cache.batch} keeps one length per row, shape ({cache.batch},); build '
                     'it with init_cache(config, batch).')
  if num_new > cache.max_len:
    raise ValueError(f'KV cache: a prompt of {num_new} tokens is longer than the cache '
                     f'max_len={cache.max_len}; build the cache with init_cache(..., '
                     f'max_len>={num_new}) or shorten the prompt.')
  if isinstance(cache.length, jax.core.Tracer):
    # Traced (inside a jitted step): the step functions that own the loop check on the host
    # before they dispatch (`qjax.nn.generate`, the engine's `check_step`). A host callback
    # here would stop every step to wait for the device, which costs more than the check.
    return
  if not getattr(cache.length, 'is_fully_addressable', True):
    return
  _raise_if_overflow(cache.length, num_new, cache.max_len)


def poison_overflow(cache: KVCache, num_new: int, x_BTD: jax.Array) -> jax.Array:
  """In-jit: `x_BTD` with NaN in the rows whose `num_new` new positions pass `max_len`."""
  over_B = cache.length + num_new > cache.max_len
  return jnp.where(over_B[:, None, None], jnp.asarray(jnp.nan, x_BTD.dtype), x_BTD)


def check_format(fmt: Union[None, str, QFormat], head_dim: Optional[int] = None,
                 what: str = 'init_cache: fmt') -> Optional[QFormat]:
  """The QFormat a KV cache of `fmt` stores (None for float storage), or a ValueError.

  Args:
    fmt: None, a name in `KV_FORMATS`, or a QFormat with a scale per token and kv head.
    head_dim: H, checked against the format's group size when given.
    what: how the caller names the argument, for the error message.
  """
  if fmt is None:
    return None
  if isinstance(fmt, str):
    if fmt not in KV_FORMATS:
      raise ValueError(f'{what}={fmt!r} is unknown; use one of {sorted(KV_FORMATS)} or a '
                       'QFormat (None: a float cache).')
    fmt = KV_FORMATS[fmt]
  if not isinstance(fmt, QFormat):
    raise ValueError(f'{what}={fmt!r} is not a KV cache format; use one of '
                     f'{sorted(KV_FORMATS)} or a QFormat (None: a float cache).')
  channels = {a % 4 for a in fmt.channel_axes}
  grouped_h = fmt.group_size is not None and fmt.group_axis % 4 == 3
  if not {0, 1, 2} <= channels or (fmt.group_size is not None and not grouped_h):
    raise ValueError(f'{what}: KV format {fmt.name} must have a scale per token and kv '
                     f'head (channel_axes containing 0, 1, 2 of k_BSKH, groups only along '
                     f'axis 3), got channel_axes={fmt.channel_axes}, group_axis='
                     f'{fmt.group_axis}; otherwise writing a token would rescale earlier '
                     "ones. Use e.g. KV_FORMATS['int8'].")
  if grouped_h and head_dim is not None and head_dim % fmt.group_size:
    raise ValueError(f'{what}: KV format {fmt.name} groups head_dim={head_dim} by '
                     f'{fmt.group_size}, which does not divide it; use a divisor of it.')
  return fmt.replace(channel_axes=tuple(sorted(a % 4 for a in fmt.channel_axes)),
                     group_axis=fmt.group_axis % 4)


def same_format(a: Optional[QFormat], b: Optional[QFormat]) -> bool:
  """Whether two KV formats store the same codes (axes compared modulo the rank, 4)."""
  norm = lambda f: f if f is None else check_format(f)
  return norm(a) == norm(b)


def write(cache: KVCache, layer: int, k_BTKH: jax.Array, v_BTKH: jax.Array,
          positions_BT: Optional[jax.Array] = None) -> KVCache:
  """Write T new keys/values of `layer` to the slots of their positions (does not advance).

  Args:
    cache: the cache.
    layer: the layer whose keys/values these are.
    k_BTKH: new keys (after RoPE).
    v_BTKH: new values.
    positions_BT: their positions, consecutive in each row (default `next_positions(cache,
      T)`: row b at slot `cache.length[b]`). Attention passes the positions it rotated by,
      so under a sharded layout a shard writes its own rows without reading `length`.

  Returns:
    The cache with row b's T new entries at slots positions_BT[b, 0] onwards.
  """
  if not isinstance(cache, KVCache):
    return cache.write(layer, k_BTKH, v_BTKH, positions_BT)
  t = k_BTKH.shape[1]
  if positions_BT is None:
    positions_BT = next_positions(cache, t)
  positions_BT = positions_BT.astype(jnp.int32)
  ring = cache.ring_size(layer)
  if not ring:
    # One dynamic_update_slice per row, vmapped over B (a scatter of T slots per row): rows
    # may sit at different lengths, and nothing outside the T new slots is read or rewritten.
    put_row = jax.vmap(lambda old_S, new_T, start: jax.lax.dynamic_update_slice_in_dim(
        old_S, new_T.astype(old_S.dtype), start, axis=0))
    index_B = positions_BT[:, 0]
  elif t == 1:  # a decode step: one slot, no wrap and no padding
    put_row = jax.vmap(lambda old_R, new_1, slot: jax.lax.dynamic_update_slice_in_dim(
        old_R, new_1.astype(old_R.dtype), slot, axis=0))
    index_B = positions_BT[:, 0] % ring
  else:
    # Slot p mod R for the row's last R real positions; the rest (older ones a long chunk
    # evicts itself, padding at EMPTY_POSITION) go to slot R, out of range: dropped.
    end_B = written_end(positions_BT)
    keep_BT = (positions_BT < EMPTY_POSITION) & (positions_BT >= end_B[:, None] - ring)
    index_B = jnp.where(keep_BT, positions_BT % ring, ring)
    put_row = jax.vmap(lambda old_R, new_T, slots_T: old_R.at[slots_T].set(
        new_T.astype(old_R.dtype), mode='drop'))

  def put(arrs, new):
    old = arrs[layer]
    if isinstance(old, QArray):  # quantize on write; scales are per token: B, S tile by 1
      new = quantize(new.astype(old.dtype), cache.qformat)
      upd = jax.tree.map(lambda o, n: put_row(o, n, index_B), old, new)
    else:
      upd = put_row(old, new, index_B)
    return arrs[:layer] + (upd,) + arrs[layer + 1:]
  return dataclasses.replace(cache, k=put(cache.k, k_BTKH), v=put(cache.v, v_BTKH))


def written_end(positions_BT: jax.Array) -> jax.Array:
  """end_B: one past the last real (< EMPTY_POSITION) position of each row."""
  real_BT = jnp.where(positions_BT < EMPTY_POSITION, positions_BT, -1)
  return jnp.max(real_BT, axis=1) + 1


def ring_positions(end_B: jax.Array, ring: int) -> jax.Array:
  """pos_BR: the position ring slot s holds, the latest p < end_B with p = s mod R.

  Slots no position reached yet (p < 0) are at EMPTY_POSITION.
  """
  last_B1 = end_B[:, None] - 1
  pos_BR = last_B1 - (last_B1 - jnp.arange(ring, dtype=jnp.int32)[None]) % ring
  return jnp.where(pos_BR >= 0, pos_BR, EMPTY_POSITION)


def write_and_read(cache: KVCache, layer: int, k_BTKH: jax.Array, v_BTKH: jax.Array,
                   positions_BT: jax.Array):
  """Write T new keys/values of `layer`; return the keys attention reads with them.

  Args:
    cache: the cache.
    layer: the layer.
    k_BTKH: new keys (after RoPE).
    v_BTKH: new values.
    positions_BT: their positions (padding at EMPTY_POSITION).

  Returns:
    (cache, k_BSKH, v_BSKH, k_pos_BS): the cache with the new entries written, and every key
    the T queries may see, with its position (B of the positions may be 1). A ring layer
    given more than ring_slack + 1 tokens returns the ring as it was plus the T new keys
    (S = R + T; module docstring), otherwise the cache's slots after the write.
  """
  ring = cache.ring_size(layer)
  t = k_BTKH.shape[1]
  if not ring or t <= ring - cache.windows[layer] + 1:
    cache = write(cache, layer, k_BTKH, v_BTKH, positions_BT)
    end_B = written_end(positions_BT) if ring else None
    return (cache,) + read(cache, layer, end_B)
  k_old, v_old, pos_old = read(cache, layer, positions_BT[:, 0])
  k_new, v_new = k_BTKH, v_BTKH
  if cache.qformat is not None:  # what the cache would read back for the new tokens
    dtype = cache.k[layer].dtype
    k_new = dequantize(quantize(k_BTKH.astype(dtype), cache.qformat))
    v_new = dequantize(quantize(v_BTKH.astype(dtype), cache.qformat))
  cat = lambda old, new: jnp.concatenate([old, new.astype(old.dtype)], axis=1)
  keys = (cat(k_old, k_new), cat(v_old, v_new), cat(pos_old, positions_BT.astype(jnp.int32)))
  return (write(cache, layer, k_BTKH, v_BTKH, positions_BT),) + keys


def through_format(fmt: Optional[QFormat], k_BTKH: jax.Array, v_BTKH: jax.Array,
                   cache: Optional[KVCache] = None) -> tuple[jax.Array, jax.Array]:
  """New keys/values as a cache stored in `fmt` reads them back; straight-through gradients.

  This is how a model whose attention has a KV format (`Attention.kv_fmt`, set by QAT) makes
  its full forward compute what serving with that cache computes: `fake_quant` is
  `dequantize(quantize(x))` bit for bit in the forward and the identity inside the clip range
  in the backward. A cache of that format quantizes on `write` itself, so then k and v pass
  unchanged; a float cache stores the fake-quantized values (what the quantized cache would
  read back); a cache of another quantized format is an error (K/V would be rounded twice).

  Args:
    fmt: the KV format (from `check_format`), or None (k and v returned unchanged).
    k_BTKH: new keys (after RoPE).
    v_BTKH: new values.
    cache: the cache they are written to next, or None (a full forward).

  Returns:
    (k_BTKH, v_BTKH) in their own dtypes, quantized through the cache's storage dtype.
  """
  if fmt is None:
    return k_BTKH, v_BTKH
  dtype = k_BTKH.dtype
  if cache is not None:
    if cache.qformat is not None:
      if not same_format(cache.qformat, fmt):
        raise ValueError(f'KV cache: the model stores K/V as {check_format(fmt).name} '
                         f'(Attention.kv_fmt), but the cache holds {cache.format}; build the '
                         f'cache with init_cache(..., fmt=qjax.nn.kv_format(model)), or change '
                         "the model's format with qjax.nn.with_kv_format(model, fmt).")
      return k_BTKH, v_BTKH
    dtype = cache.k[0].dtype
  fq = lambda x: fake_quant(x.astype(dtype), fmt).astype(x.dtype)
  return fq(k_BTKH), fq(v_BTKH)


def read(cache: KVCache, layer: int,
         end_B: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(k_BSKH, v_BSKH, positions) of `layer`: slot s holds position s in every row (1S).

  Every row is read whole: a row's slots at or past its own `length[b] + T` sit at positions
  later than its queries (`next_positions`), so the causal mask on those hides them. A ring
  layer's slots hold `ring_positions(end_B, R)` (BR), end_B = one past each row's last
  written position (default `cache.length`: the cache between steps).
  """
  k, v = cache.k[layer], cache.v[layer]
  ring = cache.ring_size(layer)
  if ring:
    pos = ring_positions(cache.length if end_B is None else end_B, ring)
  else:
    pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None]
  if isinstance(k, QArray):
    k, v = dequantize(k), dequantize(v)
  return k, v, pos


def next_positions(cache: KVCache, num_new: int) -> jax.Array:
  """Positions of the next `num_new` tokens of each row: `length[b] + 0..T-1`, shape (B, T)."""
  return cache.length[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def forward(model, tokens_BT: jax.Array, cache: KVCache, num_new_B: Union[int, jax.Array], *,
            num_real: Union[None, int, jax.Array] = None) -> tuple[jax.Array, KVCache]:
  """Run `model`'s layers over the cache under the caller's jit: (x_BTD of the last layer,
  cache), the returned cache's length advanced by `num_new_B` per row.

  The one cache forward: `Transformer.__call__`, the generation steps (`qjax.nn.generate`)
  and the speculative round (`qjax.infer.spec_round`) run it (`qjax.infer.paged.forward` is
  the paged cache's). Row b's T tokens are written at positions `length[b] + 0..T-1`; those
  past its num_new sit past its new length, hidden by the causal mask until rewritten. With
  `num_real`, the tokens after the first num_real of every row are padding (a call padded to
  its bucket): at EMPTY_POSITION, later than every query and never written to a ring. A row
  that writes nothing (num_new 0: a finished row that still runs, shapes being fixed) and
  whose T slots would pass max_len writes them at the last T slots instead, over its own
  cached positions: such a row is not read again. A row that writes and would pass max_len
  gets NaN (`poison_overflow`). `model.logits` turns x into logits.
  """
  t = tokens_BT.shape[1]
  length_B = cache.length
  num_new_B = jnp.asarray(num_new_B, jnp.int32)
  parked_B = (num_new_B == 0) & (length_B + t > cache.max_len)
  cache = dataclasses.replace(cache, length=jnp.where(parked_B, cache.max_len - t, length_B))
  positions_BT = next_positions(cache, t)
  if num_real is not None:
    real_1T = jnp.arange(t, dtype=jnp.int32)[None] < num_real
    positions_BT = jnp.where(real_1T, positions_BT, EMPTY_POSITION)
  x_BTD = poison_overflow(cache, t, model.embed_tokens(tokens_BT))
  x_BTD, cache = model.run_layers(x_BTD, positions_BT, cache)
  return x_BTD, dataclasses.replace(cache, length=length_B + num_new_B)


def advance(cache: KVCache, num_new: Union[int, jax.Array]) -> KVCache:
  """The cache after a step that wrote `num_new` positions (an int, or one per row) to it."""
  return dataclasses.replace(cache, length=cache.length + jnp.asarray(num_new, jnp.int32))


def nbytes(cache: KVCache) -> int:
  """Bytes the device holds for the cache."""
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(cache))
