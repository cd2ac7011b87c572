"""Paged decode attention on the kernel: where it runs (`attention_form`, the one place that
decides) and the call (`attend`) that hands a `PagedKVCache` layer's pools to
`qjax.kernels.paged_attention` as they are stored (codes and scales, never a float copy).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax

from qjax import target as qjax_target
from qjax.core import QArray

# Values of QJAX_PAGED_ATTENTION (`attention_form`).
PAGED_MODES = ('auto', 'scan', 'kernel', 'interpret')


@dataclasses.dataclass(frozen=True)
class PagedForm:
  """How paged attention runs: 'kernel', 'interpret' (the kernel in Pallas interpret mode) or
  'scan' (gather + online softmax in XLA); the kernel's schedule; why."""

  name: str
  backend: Optional[str]
  reason: str


def attention_form(pool, t: int, on: Optional[str] = None,
                   devices: Optional[int] = None) -> PagedForm:
  """The form paged attention of T queries per row over `pool` runs, decided here only.

  The kernel (`qjax.kernels.paged_attention`) runs one query per row (decode) on GPU
  (Triton schedule) and TPU (Mosaic schedule); the scan runs prefill chunks, CPU, and pools
  the kernel does not read (scales shared along H, zero points, 2/3-bit codes; for Triton,
  page sizes and head dims that are not powers of two). `QJAX_PAGED_ATTENTION` overrides the
  choice for the process: 'scan', 'kernel' (on any backend) or 'interpret' (the kernel in
  Pallas interpret mode, for tests on CPU); unset or 'auto' decides by platform. With several
  devices 'auto' keeps the scan: a `pallas_call` is not partitioned, so pools sharded over a
  mesh (`shard_pools`) would be gathered onto every device.

  Args:
    pool: a layer's key pool (num_pages, P, K, H), an array or a QArray.
    t: queries per row.
    on: the platform (the target's, `qjax.target.current()`, when None).
    devices: devices the program spans (the target's when None).
  """
  mode = os.environ.get('QJAX_PAGED_ATTENTION', 'auto')
  if mode not in PAGED_MODES:
    raise ValueError(f'QJAX_PAGED_ATTENTION={mode!r} is unknown; use one of {PAGED_MODES}.')
  target = qjax_target.current()
  on = on or target.platform
  backend = 'mosaic' if on == 'tpu' else 'triton'
  if mode == 'scan':
    return PagedForm('scan', None, 'QJAX_PAGED_ATTENTION=scan')
  if t != 1:
    return PagedForm('scan', None, f'{t} queries per row: the kernel runs decode (1)')
  if isinstance(pool, QArray):
    qt = pool.qtype
    if pool.zero_point is not None or pool.scale.shape[-1] != 1:
      return PagedForm('scan', None, f'{pool.layout_name}: the kernel takes one scale per '
                       'token and head, no zero point')
    if not (qt.is_float or qt.bits in (4, 8)):
      return PagedForm('scan', None, f'{qt.name} codes: the kernel reads int8, int4, fp8')
  _, p, _, hs = pool.data.shape if isinstance(pool, QArray) else pool.shape
  if backend == 'triton' and (p & (p - 1) or hs & (hs - 1)):
    return PagedForm('scan', None, f'page size {p} / {hs} stored values per head: Triton '
                     'blocks are powers of two')
  if mode == 'interpret':
    return PagedForm('interpret', backend, 'QJAX_PAGED_ATTENTION=interpret')
  if mode == 'kernel':
    return PagedForm('kernel', backend, 'QJAX_PAGED_ATTENTION=kernel')
  if on in ('nvidia', 'tpu'):
    from qjax.kernels import paged_attention as pa  # pylint: disable=g-import-not-at-top
    devices = devices or target.device_count
    if devices > 1:
      return PagedForm('scan', None, f'{devices} devices: pools may be sharded, '
                       'and the kernel runs on one device (QJAX_PAGED_ATTENTION=kernel forces '
                       'it)')
    if not pa.backend_available(backend):
      return PagedForm('scan', None, f'jax {jax.__version__} has no Pallas {backend} backend')
    return PagedForm('kernel', backend, f'{on}: Pallas paged attention ({backend})')
  return PagedForm('scan', None, f'{on}: gather + online softmax in XLA')


def attend(form: PagedForm, pool_k, pool_v, q_BTNH: jax.Array, positions_BT: jax.Array,
           table: jax.Array, last_B: jax.Array, *, ring: bool, window: Optional[int],
           logit_softcap: Optional[float]) -> jax.Array:
  """out_BTNH (T = 1) of the kernel over one layer's pools (`PagedKVCache._attend_rows`)."""
  from qjax.kernels import paged_attention as pa  # pylint: disable=g-import-not-at-top
  data = lambda x: x.data if isinstance(x, QArray) else x
  scales = lambda x: x.scale if isinstance(x, QArray) else None
  out_BNH = pa.paged_attention(
      q_BTNH[:, 0], data(pool_k), data(pool_v), table, positions_BT[:, 0], last_B,
      k_scales=scales(pool_k), v_scales=scales(pool_v),
      int4=isinstance(pool_k, QArray) and pool_k.qtype.packed, ring=ring, window=window,
      logit_softcap=logit_softcap, backend=form.backend, interpret=form.name == 'interpret')
  return out_BNH[:, None]
