"""`lookup`: rows of an embedding table (float or quantized), the form chosen by the target.

The tied embedding is both the lookup table and the head's weight. On a TPU target the rows
are gathered by `qjax.kernels.tpu_gather` (a tile of rows per id, read in the layout the
head's kernel reads the table in); elsewhere by indexing (XLA's gather). A quantized table's
rows are dequantized after the gather, as `dequantize(table[ids])` does: the same values.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.core import numerics
from qjax.core.qarray import QArray, dequantize
from qjax.kernels import tpu_gather

# Ids looked up with one slice of the scales each (decode steps); more go to XLA's gather.
_SLICED_IDS = 64


def form(table, target=None) -> tuple[str, str]:
  """('kernel' or 'index', why) for a lookup in `table` on `target` (default: the current)."""
  target = target or qjax_target.current()
  if target.platform != 'tpu':
    return 'index', f'{target.platform}: XLA gather'
  if target.device_count > 1:
    return 'index', f'{target.device_count} devices: XLA partitions its gather, not the kernel'
  if len(table.shape) != 2:
    return 'index', f'a table of rank {len(table.shape)}'
  if isinstance(table, QArray) and table.qtype.packed:
    return 'index', 'packed codes (the kernel reads codes as XLA stores them)'
  return 'kernel', 'TPU: tile-row gather kernel (the table stays in the head kernel\'s layout)'


def _indexed(table, ids, dtype):
  if isinstance(table, QArray):
    return dequantize(table[ids], dtype)
  return table[ids].astype(dtype)


def lookup(table, ids, dtype, target=None) -> jax.Array:
  """`table[ids]` in `dtype` (a QArray table dequantized), ids of any shape.

  Args:
    table: a (V, D) float array or QArray.
    ids: integer row ids.
    dtype: the rows' dtype.
    target: the Target (default: `qjax.target.current()`).

  Returns:
    ids.shape + (D,) rows in `dtype`.
  """
  target = target or qjax_target.current()
  if form(table, target)[0] != 'kernel':
    return _indexed(table, ids, dtype)

  def kernel(table, ids):
    flat = ids.reshape(-1)
    if not isinstance(table, QArray):
      return tpu_gather.gather_rows(table, flat).astype(dtype).reshape(ids.shape + (-1,))
    v, d = table.shape
    codes = tpu_gather.gather_rows(table.data, flat)                     # (N, D) f32
    scale, zp = (_rows(a, flat, v) for a in (table.scale, table.zero_point))
    g = scale.shape[-1]
    c = codes.reshape(-1, g, d // g)
    rows = numerics.from_codes(c, scale[..., None], None if zp is None else zp[..., None],
                               dtype)
    return rows.reshape(ids.shape + (d,))

  return jax.lax.platform_dependent(table, ids, tpu=kernel,
                                    default=lambda t, i: _indexed(t, i, dtype))


def _rows(a: Optional[jax.Array], ids, v: int) -> Optional[jax.Array]:
  """The scale-shaped leaf's rows for `ids` (one row for all when its V axis is 1)."""
  if a is None:
    return None
  if a.shape[0] == 1:
    return jnp.broadcast_to(a.astype(jnp.float32), (ids.shape[0], a.shape[1]))
  per = v // a.shape[0]  # rows of the table per scale row
  rows = ids // per
  if a.shape[1] == 1 or rows.shape[0] > _SLICED_IDS:
    # XLA's own gather: the kernel would need the (V, G) scales re-tiled to 128 lanes first (a
    # copy 128 / G times their size); the head's kernel reads them as stored.
    return a[rows].astype(jnp.float32)
  # The head's kernel reads grouped scales as (G, V), so XLA stores them V-minor; its gather wants
  # the gathered axis major and re-tiled the whole table for it, a copy every decode step (its
  # size for Gemma 3's g128 scales: docs/quantized_matmul.md). A column slice per id reads one
  # tile of the scales as stored.
  a_t = a.T
  cols = [jax.lax.dynamic_slice_in_dim(a_t, rows[i], 1, axis=1) for i in range(rows.shape[0])]
  return jnp.concatenate(cols, axis=1).T.astype(jnp.float32)
