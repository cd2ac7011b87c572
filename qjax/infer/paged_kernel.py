"""Paged attention on the kernels: where it runs (`attention_form`, the one place that
decides) and the calls that hand a `PagedKVCache` layer's pools to the kernels as they are
stored (codes and scales, never a float copy): `attend` for rows of T queries (the paged
kernel, `qjax.kernels.paged_attention`, for T = 1; the ragged one,
`qjax.kernels.ragged_paged`, for more) and `attend_packed` for a packed step's tokens (every
row, decodes and chunks, in one ragged call).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.core import QArray
from qjax.kernels import paged_attention as pa
from qjax.kernels import ragged_paged

# Values of QJAX_PAGED_ATTENTION (`attention_form`).
PAGED_MODES = ('auto', 'scan', 'kernel', 'interpret')


@dataclasses.dataclass(frozen=True)
class PagedForm:
  """How paged attention runs: 'kernel', 'interpret' (the kernel in Pallas interpret mode) or
  'scan' (gather + online softmax in XLA); which kernel ('paged': one query per row,
  `qjax.kernels.paged_attention`; 'ragged': any number per row, `qjax.kernels.ragged_paged`);
  the kernel's schedule; why."""

  name: str
  backend: Optional[str]
  reason: str
  kernel: Optional[str] = None


def _scan(reason: str) -> PagedForm:
  return PagedForm('scan', None, reason)


def attention_form(pool, t: int, on: Optional[str] = None,
                   devices: Optional[int] = None) -> PagedForm:
  """The form paged attention of T queries per row over `pool` runs, decided here only.

  | rows' queries | TPU, one device | NVIDIA GPU, one device | CPU, or several devices |
  |---|---|---|---|
  | one (decode) | paged kernel, Mosaic | paged kernel, Triton | scan |
  | several (a chunk, a mixed step) | ragged kernel, Mosaic | scan | scan |

  The paged kernel (`qjax.kernels.paged_attention`) keeps decode-only steps on TPU too: its
  split-K runs a long row's pages in parallel, and its query tile holds no empty query slots.
  The ragged kernel (`qjax.kernels.ragged_paged`) runs a step whose rows feed several queries
  (prompt chunks beside decodes, a speculative check) in one call per layer; it is Mosaic
  only, so a GPU keeps the scan for them. Both read the pools as stored; the scan runs pools
  they do not read (scales shared along H, zero points, 2/3-bit codes; for Triton, page sizes
  and head dims that are not powers of two). With several devices 'auto' keeps the scan: a
  `pallas_call` is not partitioned, so pools sharded over a mesh (`shard_pools`) would be
  gathered onto every device.

  `QJAX_PAGED_ATTENTION` overrides the choice for the process: 'scan'; 'kernel' (the table's
  kernel on any backend, the ragged one only where it runs: a TPU); 'interpret' (the kernels
  in Pallas interpret mode on any backend, the ragged one for several queries per row: how
  the tests run them on CPU); unset or 'auto' follows the table.

  Args:
    pool: a layer's key pool (num_pages, Y, K, H), an array or a QArray.
    t: queries per row (the most any row of the step feeds).
    on: the platform (the target's, `qjax.target.current()`, when None).
    devices: devices the program spans (the target's when None).
  """
  mode = os.environ.get('QJAX_PAGED_ATTENTION', 'auto')
  if mode not in PAGED_MODES:
    raise ValueError(f'QJAX_PAGED_ATTENTION={mode!r} is unknown; use one of {PAGED_MODES}.')
  if not isinstance(t, int) or t < 1:
    raise ValueError(f'attention_form: t={t!r} queries per row; use a positive integer.')
  target = qjax_target.current()
  on = on or target.platform
  if mode == 'scan':
    return _scan('QJAX_PAGED_ATTENTION=scan')
  if isinstance(pool, QArray):
    qt = pool.qtype
    if pool.zero_point is not None or pool.scale.shape[-1] != 1:
      return _scan(f'{pool.layout_name}: the kernels take one scale per token and head, no '
                   'zero point')
    if not (qt.is_float or qt.bits in (4, 8)):
      return _scan(f'{qt.name} codes: the kernels read int8, int4, fp8')
  _, p, _, hs = pool.data.shape if isinstance(pool, QArray) else pool.shape
  if t > 1:
    kernel, backend = 'ragged', 'mosaic'
    if on != 'tpu' and mode != 'interpret':
      return _scan(f'{t} queries per row on {on}: the ragged kernel is Mosaic (TPU) only, '
                   'and the paged kernel runs one query per row')
    why = f'{t} queries per row: the ragged kernel, every row in one call'
  else:
    kernel, backend = 'paged', 'mosaic' if on == 'tpu' else 'triton'
    if backend == 'triton' and (p & (p - 1) or hs & (hs - 1)):
      return _scan(f'page size {p} / {hs} stored values per head: Triton blocks are powers '
                   'of two')
    why = 'one query per row: the paged kernel (split-K over long rows)'
  if mode in ('interpret', 'kernel'):
    return PagedForm(mode, backend, f'QJAX_PAGED_ATTENTION={mode}; {why}', kernel)
  if on in ('nvidia', 'tpu'):
    devices = devices or target.device_count
    if devices > 1:
      return _scan(f'{devices} devices: pools may be sharded, and the kernel runs on one '
                   'device (QJAX_PAGED_ATTENTION=kernel forces it)')
    if not pa.backend_available(backend):
      return _scan(f'jax {jax.__version__} has no Pallas {backend} backend')
    return PagedForm('kernel', backend, f'{on}: Pallas {backend}; {why}', kernel)
  return _scan(f'{on}: gather + online softmax in XLA')


def _data(x):
  return x.data if isinstance(x, QArray) else x


def _scales(x):
  return x.scale if isinstance(x, QArray) else None


def attend(form: PagedForm, pool_k, pool_v, q_BTNH: jax.Array, positions_BT: jax.Array,
           table: jax.Array, last_B: jax.Array, *, ring: bool, window: Optional[int],
           logit_softcap: Optional[float]) -> jax.Array:
  """out_BTNH of `form`'s kernel over one layer's pools (`PagedKVCache._attend_rows`)."""
  int4 = isinstance(pool_k, QArray) and pool_k.qtype.packed
  common = dict(k_scales=_scales(pool_k), v_scales=_scales(pool_v), int4=int4, ring=ring,
                window=window, logit_softcap=logit_softcap, interpret=form.name == 'interpret')
  if form.kernel == 'ragged':
    return ragged_paged.ragged_paged_attention(q_BTNH, _data(pool_k), _data(pool_v), table,
                                               positions_BT, last_B, **common)
  if q_BTNH.shape[1] != 1:
    raise ValueError(f'paged_kernel.attend: the paged kernel runs one query per row, got '
                     f'{q_BTNH.shape[1]}; ask attention_form for the T of the call.')
  out_BNH = pa.paged_attention(q_BTNH[:, 0], _data(pool_k), _data(pool_v), table,
                               positions_BT[:, 0], last_B, backend=form.backend, **common)
  return out_BNH[:, None]


def attend_packed(form: PagedForm, pool_k, pool_v, q_M1NH: jax.Array, table: jax.Array,
                  length_B: jax.Array, num_new_B: jax.Array, seq_M: jax.Array,
                  slot_M: jax.Array, width: int, *, ring: bool, window: Optional[int],
                  logit_softcap: Optional[float]) -> jax.Array:
  """out_M1NH of a packed step's tokens (`PagedKVCache.attend` with `seq_of`) in one ragged
  kernel call: the rows' tokens laid out as (B, T = width) queries, row b's at positions
  length_B[b] + 0..num_new_B[b]-1 and the rest empty (-1), then gathered back per token
  (a padding token, slot `width`, reads another slot's output, which nothing uses).

  Args:
    form: a ragged form (`attention_form(pool_k, width)`).
    pool_k, pool_v: the layer's pools.
    q_M1NH: the M packed tokens' queries (scaled, after RoPE).
    table: int32 (B, E): each row's block or ring table.
    length_B: positions cached per row before the step.
    num_new_B: tokens each row feeds (at most `width`).
    seq_M, slot_M: each packed token's row and its place among the row's new tokens.
    width: the most tokens a row feeds (static).
    ring, window, logit_softcap: the layer's (`attend`).
  """
  if form.kernel != 'ragged':
    raise ValueError(f'paged_kernel.attend_packed: form {form} is not the ragged kernel.')
  n = q_M1NH.shape[0]
  q_MNH = jnp.concatenate([q_M1NH[:, 0], jnp.zeros_like(q_M1NH[:1, 0])])  # n: empty
  start_B = jnp.cumsum(num_new_B) - num_new_B  # row b's first token
  slot_T = jnp.arange(width, dtype=jnp.int32)
  new_BT = slot_T[None] < num_new_B[:, None]
  src_BT = jnp.where(new_BT, start_B[:, None] + slot_T[None], n)
  pos_BT = jnp.where(new_BT, length_B[:, None] + slot_T[None], -1)
  last_B = length_B + num_new_B - 1
  out_BTNH = attend(form, pool_k, pool_v, q_MNH[src_BT], pos_BT, table, last_B, ring=ring,
                    window=window, logit_softcap=logit_softcap)
  flat = out_BTNH.reshape((-1,) + out_BTNH.shape[2:])
  return jnp.take(flat, seq_M * width + slot_M, axis=0, mode='clip')[:, None]
