"""Where QArray codes are stored per backend: the one place that chooses 'packed' or 'native'.

Two storage layouts of the same codes (`qarray.STORAGE_LAYOUTS`):

* 'packed': 2/3/4-bit codes bit-packed into uint8 by `qjax.core.packing`. What qjax's XLA:CPU
  paths read (the tiled path and the CPU kernel unpack bit fields in cache), and the
  checkpoint format: any layout saves and loads as packed.
* 'native': one code per element of a dtype XLA knows: `jnp.int4` for 2-4-bit codes, int8 for
  5-8 bits, fp8 as fp8. XLA:GPU and XLA:TPU store s4 two per byte and fuse an `s4`/`s8`/`f8`
  -> bf16 `convert` into the matmul's operand load (the GPU Triton GEMM fusion takes native
  narrow integer operands, not uint8 words with shift and mask arithmetic), so the weight
  reaches the dot without a float copy (`qjax.core.native_path`).

`default_layout()` is native on GPU and TPU and packed on CPU (the target's platform,
`qjax.target`); the environment variable
`QJAX_QARRAY_LAYOUT=packed|native` overrides it for the process. The conversion is done once,
by `quantize_model(layout=...)` or `relayout` after a checkpoint loads, never per step. 5-8
bit and fp8 codes are the same bytes in both layouts; only their `QType.layout` (which path
`path='auto'` takes) differs.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.core.qarray import STORAGE_LAYOUTS, QArray, QType

ENV_VAR = 'QJAX_QARRAY_LAYOUT'
NATIVE_BACKENDS = ('gpu', 'cuda', 'rocm', 'tpu')


def default_layout(backend: Optional[str] = None) -> str:
  """'native' on GPU/TPU, 'packed' on CPU (and unknown backends), unless `QJAX_QARRAY_LAYOUT`
  names one. `backend` defaults to the target's (`qjax.target`).

  Raises:
    ValueError: the environment variable names no layout.
  """
  env = os.environ.get(ENV_VAR, '').strip()
  if env:
    if env not in STORAGE_LAYOUTS:
      raise ValueError(f'{ENV_VAR}={env!r} is not a QArray layout; set it to one of '
                       f'{STORAGE_LAYOUTS} or unset it (default: native on GPU/TPU, packed on '
                       'CPU).')
    return env
  backend = backend or qjax_target.current().backend
  return 'native' if backend in NATIVE_BACKENDS else 'packed'


def check_layout(layout: Optional[str], what: str) -> str:
  """`layout`, or the default for None; an unknown name raises naming the choices."""
  if layout is None:
    return default_layout()
  if layout not in STORAGE_LAYOUTS:
    raise ValueError(f'{what}: layout={layout!r} is unknown; use one of {STORAGE_LAYOUTS} or '
                     'None (the backend default: native on GPU/TPU, packed on CPU).')
  return layout


def to_layout(q: QArray, layout: str) -> QArray:
  """`q` with its codes stored in `layout` (the same codes, scales and zero points)."""
  if not isinstance(q, QArray):
    shape = f' of shape {tuple(q.shape)}' if hasattr(q, 'shape') else ''
    raise ValueError(f'to_layout: got {type(q).__name__}{shape}, not a QArray; a layout is '
                     'how quantized codes are stored, so quantize first (qjax.core.quantize(x, '
                     'fmt)), or use relayout(tree), which leaves float leaves as they are.')
  layout = check_layout(layout, 'to_layout')
  if q.qtype.layout == layout:
    return q
  qtype = q.qtype.with_layout(layout)
  codes = q.codes()  # int8 / fp8, the tensor's own shape
  if qtype.packed:
    from qjax.core import packing  # pylint: disable=import-outside-toplevel
    data = packing.pack(codes, qtype.bits)
  else:
    data = codes.astype(qtype.storage_dtype)
  return QArray(data, q.scale, q.zero_point, qtype, q.last_dim, q.dtype_name)


def relayout(tree: Any, layout: Optional[str] = None) -> Any:
  """Every QArray in `tree` (a pytree, e.g. `nnx.state(model)`) stored in `layout` (default:
  `default_layout()`); other leaves unchanged."""
  layout = check_layout(layout, 'relayout')
  return jax.tree.map(lambda a: to_layout(a, layout) if isinstance(a, QArray) else a, tree,
                      is_leaf=lambda a: isinstance(a, QArray))


def layout_facts(backend: Optional[str] = None) -> dict:
  """The layout decision for the record: backend, device kind, default layout and why."""
  target = qjax_target.current()
  env = os.environ.get(ENV_VAR, '').strip()
  if backend is None or backend == target.backend:
    backend, kind = target.backend, target.device_kind
  else:
    try:
      kind = jax.devices(backend)[0].device_kind
    except RuntimeError:
      kind = None
  return {'backend': backend, 'device_kind': kind, 'layout': default_layout(backend),
          'source': f'{ENV_VAR}={env}' if env else 'backend default (qjax.core.layouts)',
          'int4_code_dtype': jnp.dtype(QType('int', 4, 'native').storage_dtype).name}
