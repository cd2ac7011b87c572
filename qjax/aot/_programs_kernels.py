"""qjax's Pallas kernels as (function, abstract arguments), each called as the library calls it.

* splash: `kernels.splash.splash_attention`, causal or local, grouped heads (TPU, Mosaic).
* paged_attention: `kernels.paged_attention.paged_attention` over float, int8, fp8 or packed
  int4 pools (Mosaic on TPU, Triton on NVIDIA GPUs).
* ragged_paged_attention: `kernels.ragged_paged.ragged_paged_attention`, a serving step's rows
  of one and several queries over their pages in one call (Mosaic, TPU only).
* pallas_qmm: `kernels.pallas_qmm.qmm`, int8 or packed int4 codes, per channel or in groups
  (Mosaic on TPU, Triton on NVIDIA GPUs).
* mosaic_rejected: a negative control, a kernel that lowers for TPU but that Mosaic refuses
  (an (8, 130) -> (130, 8) f32 shape cast its vector layout inference has no rule for): what a
  compile check must report as not compiled, with the compiler's message.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax.aot._programs import Program
from qjax.aot import _targets
from qjax.kernels import paged_attention as pa
from qjax.kernels import pallas_qmm, ragged_paged, splash

_S = jax.ShapeDtypeStruct
KV_STORAGE = ('bf16', 'int8', 'fp8', 'int4')


def paged_backend(target: str) -> str:
  """The paged kernel's schedule on `target`: 'mosaic' on TPU, 'triton' on NVIDIA."""
  return 'mosaic' if _targets.spec_of(target).platform == 'tpu' else 'triton'


def splash_attention(*, batch: int = 1, length: int = 256, heads: tuple = (4, 2),
                     head_dim: int = 128, window: Optional[int] = None) -> Program:
  """Splash attention of a (batch, length) prompt with (query, kv) `heads`, bf16."""
  n, k = heads
  q = _S((batch, length, n, head_dim), jnp.bfloat16)
  kv = _S((batch, length, k, head_dim), jnp.bfloat16)
  run = lambda q, k, v: splash.splash_attention(q, k, v, window=window)
  name = f'splash T={length} N={n} K={k} H={head_dim}' + (f' window={window}' if window else '')
  return Program(name, run, (q, kv, kv), tokens=length)


def _pool(kv: str, pages: int, page_size: int, k: int, head_dim: int):
  """A page pool stored as `kv` and its per-token scales (None for bf16), abstract."""
  stored = {'bf16': (jnp.bfloat16, head_dim), 'int8': (jnp.int8, head_dim),
            'fp8': (jnp.float8_e4m3fn, head_dim), 'int4': (jnp.uint8, head_dim // 2)}[kv]
  pool = _S((pages, page_size, k, stored[1]), stored[0])
  return pool, None if kv == 'bf16' else _S((pages, page_size, k, 1), jnp.float32)


def paged_attention(target: str, kv: str = 'int8', *, batch: int = 8, pages_per_row: int = 16,
                    page_size: int = 16, heads: tuple = (4, 2), head_dim: int = 128,
                    window: Optional[int] = None, ring: bool = False) -> Program:
  """One decode query per row over `pages_per_row` pages of a pool stored as `kv`
  ('bf16', 'int8', 'fp8' or packed 'int4' codes with a scale per token and head); with
  `ring`, the pages are a ring holding each row's newest positions (a sliding-window layer)."""
  if kv not in KV_STORAGE:
    raise ValueError(f'qjax.aot: paged kv {kv!r} is unknown; use one of {KV_STORAGE}.')
  n, k = heads
  pool, scales = _pool(kv, batch * pages_per_row + 1, page_size, k, head_dim)
  backend = paged_backend(target)
  ints = lambda *shape: _S(shape, jnp.int32)

  def run(q_BNH, k_pages, v_pages, table, q_pos_B, last_B, k_scales=None, v_scales=None):
    return pa.paged_attention(q_BNH, k_pages, v_pages, table, q_pos_B, last_B,
                              k_scales=k_scales, v_scales=v_scales, int4=kv == 'int4',
                              ring=ring, window=window, backend=backend)

  args = (_S((batch, n, head_dim), jnp.bfloat16), pool, pool, ints(batch, pages_per_row),
          ints(batch), ints(batch))
  if scales is not None:
    args += (scales, scales)
  shape = f'B={batch} S={pages_per_row * page_size} N={n} K={k} H={head_dim}'
  extra = (f' window={window}' if window else '') + (' ring' if ring else '')
  return Program(f'paged_attention {backend} kv={kv} {shape}{extra}', run, args)


def ragged_paged_attention(kv: str = 'int8', *, batch: int = 8, queries: int = 32,
                           pages_per_row: int = 16, page_size: int = 16, heads: tuple = (4, 2),
                           head_dim: int = 128) -> Program:
  """A mixed serving step in one call: `batch` rows of up to `queries` queries (a chunk's
  worth) over `pages_per_row` pages of a pool stored as `kv`, as `paged_attention` stores it."""
  if kv not in KV_STORAGE:
    raise ValueError(f'qjax.aot: paged kv {kv!r} is unknown; use one of {KV_STORAGE}.')
  n, k = heads
  pool, scales = _pool(kv, batch * pages_per_row + 1, page_size, k, head_dim)
  ints = lambda *shape: _S(shape, jnp.int32)

  def run(q_BTNH, k_pages, v_pages, table, q_pos_BT, last_B, k_scales=None, v_scales=None):
    return ragged_paged.ragged_paged_attention(
        q_BTNH, k_pages, v_pages, table, q_pos_BT, last_B, k_scales=k_scales,
        v_scales=v_scales, int4=kv == 'int4')

  args = (_S((batch, queries, n, head_dim), jnp.bfloat16), pool, pool,
          ints(batch, pages_per_row), ints(batch, queries), ints(batch))
  if scales is not None:
    args += (scales, scales)
  shape = f'B={batch} T={queries} S={pages_per_row * page_size} N={n} K={k} H={head_dim}'
  return Program(f'ragged_paged_attention kv={kv} {shape}', run, args, tokens=batch * queries)


def qmm(bits: int, group: Optional[int], *, rows: int = 8, k: int = 512,
        n: int = 512) -> Program:
  """`pallas_qmm.qmm` of (rows, k) bf16 activations and a (k, n) weight of `bits` codes,
  per channel (`group` None) or in groups of `group` rows along k."""
  g = 1 if group is None else k // group
  codes = _S((k, n), jnp.int8) if bits == 8 else _S((k, n // 2), jnp.uint8)
  run = lambda x, w, s: pallas_qmm.qmm(x, w, s, bits=bits)
  label = 'per channel' if group is None else f'g{group}'
  return Program(f'pallas_qmm int{bits} {label} M={rows}', run,
                 (_S((rows, k), jnp.bfloat16), codes, _S((g, n), jnp.float32)))


def _shape_cast(x_ref, o_ref):
  o_ref[...] = x_ref[...].reshape(o_ref.shape)


def mosaic_rejected() -> Program:
  """A Pallas kernel that lowers for TPU but that Mosaic rejects at compile time (its
  vector layout inference has no (8, 130) -> (130, 8) f32 shape cast, in libtpu 0.0.42 and
  0.0.52 alike; 0.0.52 takes (8, 128) -> (64, 16)): a negative control."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  run = lambda x: pl.pallas_call(_shape_cast, out_shape=_S((130, 8), jnp.float32))(x)
  return Program('mosaic_rejected (8, 130) -> (130, 8) shape cast', run,
                 (_S((8, 130), jnp.float32),))
