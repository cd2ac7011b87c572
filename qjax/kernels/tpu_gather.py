"""A Pallas TPU (Mosaic) kernel that gathers rows of a table: the embedding lookup on a TPU.

`rows_MD = table_VD[ids_M]`, one grid step per id: the step's block is the whole TPU tile of
rows holding the id's row (8 rows of 32-bit values, 16 of 16-bit, 32 of 8-bit, 64 of 4-bit:
the tile the table is stored in), the id scalar-prefetched into SMEM picks the block, and the
row is selected in VMEM. Values are returned as f32 (every int8 / int4 / fp8 code and every
bf16 value is one), so a quantized table's codes are dequantized by the caller.

Why a kernel for a lookup (on a compile-only TPU v5e, Llama-3.2-1B's tied 128256 x 2048
table, docs/quantized_matmul.md): XLA gathers one row as a dynamic slice fused into each of
its consumers, and lays an int8 / int4 table out in 8-row tiles for them while the quantized
head's kernel reads the table in its natural tiles: the compiler then wrote a relayout copy of
the whole table every step (267 MB of temp at batch 1), and its cost analysis counted each
such fusion as a read of the whole table. This kernel reads the table in the layout the head
reads, moves one tile per id, and states that cost. On CPU it runs in interpret mode.
This module imports nothing from qjax but the target.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qjax import target as qjax_target


def row_tile(dtype) -> int:
  """Rows in one TPU memory tile of `dtype` (a (rows, 128) tile of 32-bit words)."""
  bits = 4 if jnp.dtype(dtype) == jnp.dtype(jnp.int4) else 8 * jnp.dtype(dtype).itemsize
  return 8 * 32 // bits


def _kernel(ids_ref, t_ref, o_ref, *, rt: int):
  r = ids_ref[pl.program_id(0)] % rt
  blk = t_ref[...].astype(jnp.float32)
  pick = jax.lax.broadcasted_iota(jnp.int32, blk.shape, 0) == r
  o_ref[...] = jnp.sum(jnp.where(pick, blk, 0.0), axis=0, keepdims=True)[None]


def gather_rows(table_VD, ids_M, *, interpret: Optional[bool] = None):
  """`table_VD[ids_M]` as f32, one TPU tile of rows read per id.

  Args:
    table_VD: the table (any dtype whose values are exact in f32: float, int8, int4, fp8).
    ids_M: int32 row ids, 1-D (ids outside [0, V) are clipped to the range, as jnp.take's
      'clip' mode; the callers pass token ids).
    interpret: run the Pallas interpreter (default: when the target is not a TPU).

  Returns:
    (M, D) float32.
  """
  if table_VD.ndim != 2 or ids_M.ndim != 1:
    raise ValueError(f'tpu_gather: expected a (V, D) table and (M,) ids, got {table_VD.shape} '
                     f'and {ids_M.shape}.')
  if interpret is None:
    interpret = qjax_target.current().platform != 'tpu'
  return _gather_rows(table_VD, ids_M.astype(jnp.int32), bool(interpret))


# A pallas_call has no derivative of its own; a gather's is the scatter-add of the rows'
# cotangents into the table (a training step embeds through this on a TPU).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_rows(table_VD, ids_M, interpret: bool):
  return _gather(table_VD, ids_M, interpret=interpret)


def _gather_rows_fwd(table_VD, ids_M, interpret: bool):
  return _gather(table_VD, ids_M, interpret=interpret), (table_VD, ids_M)


def _gather_rows_bwd(interpret: bool, residuals, ct_MD):
  del interpret
  table_VD, ids_M = residuals
  if not jnp.issubdtype(table_VD.dtype, jnp.floating):
    return None, None  # codes: nothing to differentiate
  ids = jnp.clip(ids_M, 0, table_VD.shape[0] - 1)
  d_table = jnp.zeros(table_VD.shape, jnp.float32).at[ids].add(ct_MD.astype(jnp.float32))
  return d_table.astype(table_VD.dtype), None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@functools.partial(jax.jit, static_argnames=('interpret',))
def _gather(table_VD, ids_M, *, interpret: bool):
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  v, d = table_VD.shape
  m = ids_M.shape[0]
  rt = min(row_tile(table_VD.dtype), v)
  ids = jnp.clip(ids_M, 0, v - 1)
  bits = 4 if jnp.dtype(table_VD.dtype) == jnp.dtype(jnp.int4) else (
      8 * jnp.dtype(table_VD.dtype).itemsize)
  cost = pl.CostEstimate(flops=0, transcendentals=0,
                         bytes_accessed=m * rt * d * bits // 8 + m * d * 4 + m * 4)
  out = pl.pallas_call(
      functools.partial(_kernel, rt=rt),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(m,),
          in_specs=[pl.BlockSpec((rt, d), lambda i, ids: (ids[i] // rt, 0))],
          out_specs=pl.BlockSpec((1, 1, d), lambda i, ids: (i, 0, 0))),
      out_shape=jax.ShapeDtypeStruct((m, 1, d), jnp.float32),
      interpret=interpret, cost_estimate=cost)(ids, table_VD)
  return out.reshape(m, d)
