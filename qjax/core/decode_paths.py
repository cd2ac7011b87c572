"""Decode-shape paths of `qeinsum` on CPU: the optional kernel, and the head tiled over V.

* `kernel_einsum`: M <= `MAX_KERNEL_ROWS` rows of activations times an int8 or packed int4
  weight (symmetric, per-channel or grouped scales) on `qjax.kernels`' jax.ffi kernel, which
  widens each 64-code slice in registers and never writes a float weight. Weight-only
  semantics, f32 accumulation: equal to `einsum(x, dequantize(w))` up to summation order.
  Two layouts: (contracted..., kept...) weights ('BTD,DF->BTF', 'BTNH,NHD->BTD', ...) and
  the tied head (V, D) ('BTD,VD->BTV'). Used by `path='auto'` on CPU when
  the target is the CPU and `qjax.kernels.available()` (`cpu_kernel()`); `path='kernel'`
  asks for it explicitly.
* `vblocked_einsum`: the head layout (weight (V, D), contracted axis last, which the row
  tiles of `qjax.core.tiled_path` cannot express) as a `lax.map` over blocks of V rows: each
  block is dequantized and multiplied, so the temporary is one block (~1/64 of a Gemma head),
  never the 671 MB float head that plain 'dequant' writes every call.
* `matrix_einsum`: a float weight stored (contracted..., kept...) ('BTNH,NHD->BTD', ...) as
  one 2-D dot, x2 (M, K) @ w2 (K, N), the weight reshaped for free and only the activations
  transposed. Given the multi-axis contraction itself, XLA:CPU's layout assignment sometimes
  transposed the *weight* to the activation's order instead: Gemma 3's o_proj ('BTNH,NHD')
  was copied to (H, N, D) on every decode step (its cost: docs/fast_decode.md).
* `float_einsum`: a bf16 (or other low-precision float) weight with f32 activations without
  a per-call f32 copy of the weight: the kernel at M = 1 (XLA's matrix-vector loop widens
  the weight), else bf16 x bf16 with f32 accumulation (XLA:CPU's fused kernel, faster than
  the kernel there; both measured in docs/cpu_kernel.md).
* `DecodeWeights`: what the decode loops (`qjax.nn.generate`) run when XLA:CPU has no kernel:
  an f32 copy of the model's bf16/f16 weights, made once per model and value (exact: every
  bf16 value is an f32 value). No XLA:CPU form of a bf16 weight was measured at f32 speed
  (docs/cpu_kernel.md), so without the kernel bf16 params decode as the f32 model does, at
  the cost of 2 extra bytes per bf16 weight byte, which `cpu_decode_forms()` reports.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from qjax import kernels
from qjax import target as qjax_target
from qjax.core import packing
from qjax.core import tiled_path as tiled
from qjax.core.qarray import QArray, dequantize

MAX_KERNEL_ROWS = 16   # decode shapes: beyond this the fused XLA tiles win (prefill)
_BLOCK_ELEMENTS = 2**19  # weight elements per V block of `vblocked_einsum` (2 MiB in f32)
_PREFILL_BLOCK_ELEMENTS = 2**20  # the same, when more than MAX_KERNEL_ROWS rows multiply it


def head_axes(xs: str, ws: str, out: str) -> bool:
  """Whether the spec is the head layout: w (N, K) with K contracted, N kept, no batch axes."""
  if len(ws) != 2 or len(set(xs)) != len(xs) or len(set(out)) != len(out):
    return False
  kept, contracted = ws
  if contracted not in xs or contracted in out or kept in xs or kept not in out:
    return False
  return all(c in out for c in xs if c != contracted) and len(out) == len(xs)


def _rows(xs, x, contracted: str):
  """x -> (M, K) f32 with K last; returns it and the row letters and shape."""
  x_only = tuple(c for c in xs if c not in contracted)
  x2 = jnp.transpose(x, [xs.index(c) for c in x_only + tuple(contracted)])
  m_shape = tuple(x.shape[xs.index(c)] for c in x_only)
  k = math.prod(x.shape[xs.index(c)] for c in contracted)
  return x2.reshape(math.prod(m_shape), k).astype(jnp.float32), x_only, m_shape


def _finish(y2, x_only, m_shape, kept_letters, kept_shape, out, out_dtype):
  y = y2.reshape(m_shape + tuple(kept_shape))
  letters = ''.join(x_only) + kept_letters
  return jnp.transpose(y, [letters.index(c) for c in out]).astype(out_dtype)


def _kernel_kind(w: QArray) -> Optional[str]:
  if w.zero_point is not None or w.qtype.is_float:
    return None
  return {8: 'int8', 4: 'int4'}.get(w.qtype.bits) if w.qtype.bits != 4 or w.qtype.packed else None


def cpu_decode_forms() -> dict:
  """What decode shapes (M <= MAX_KERNEL_ROWS rows) run on XLA:CPU in this process, and why.

  The record of the CPU side of `qeinsum`'s choice (conversion records carry it in their
  'runtime'): the kernel's state (`qjax.kernels.info()`: available, or why not) and, per
  weight kind, the form that runs. Without the kernel each is the fastest XLA:CPU form
  measured for that kind (docs/cpu_kernel.md has the table: the quantized kinds beat the f32
  model at decode, bf16 params may not); none keeps a float copy of a quantized weight.
  """
  info = kernels.info()
  if info['status'] == 'available':
    forms = {
        'int8/int4 weight-only': 'kernel (codes widened in registers, f32 activations); '
                                 'a one-row int8 head: V blocks (vblocked_einsum)',
        'W8A8/W4A8': 'kernel (int8 activations, integer dots)',
        'bf16': 'kernel at one row; XLA bf16 x bf16 -> f32 dot at 2+ rows',
    }
  else:
    forms = {
        'int8/int4 weight-only': 'XLA row tiles (tiled_path); the tied head as V blocks, packed '
                                 'fields concatenated into one dot per block (vblocked_einsum)',
        'W8A8/W4A8': 'XLA row tiles of int8 activations x codes (tiled_path); the head as V '
                     'blocks on the same int8 activations',
        'bf16': 'decode loops: an f32 copy of the bf16/f16 weights made once per model '
                '(DecodeWeights; 2 extra bytes per bf16 weight byte), f32 dots; a direct '
                'layer call: XLA bf16 x bf16 -> f32 dot (one row padded to two)',
    }
  return {'kernel': info, 'decode_forms': forms}


LOW_FLOATS = (jnp.bfloat16, jnp.float16)


def cpu_kernel() -> bool:
  """Whether programs traced now may call the CPU kernel: the target (`qjax.target`) is the
  CPU and the kernel is loaded. A CPU host tracing for a GPU or TPU never takes it."""
  return qjax_target.on_cpu() and kernels.available()


def widens_low_floats() -> bool:
  """Whether decode loops run low-precision float weights as an f32 copy: XLA:CPU, no kernel."""
  return qjax_target.on_cpu() and not kernels.available()


def _widen(a):
  return a.astype(jnp.float32) if getattr(a, 'dtype', None) in LOW_FLOATS else a


class DecodeWeights:
  """A model's state as its decode loops run it: its own, or with bf16/f16 leaves in f32.

  Without the CPU kernel, every XLA:CPU form of a bf16 weight times f32 activations at decode
  shapes measured slower than the f32 model (docs/cpu_kernel.md); with an f32 copy the step is the
  f32 model's. The copy is made once and kept while the state's low-precision arrays are the same
  objects: a new value assigned to a Variable (training, a reload) is seen at the next call and
  widened again. Elsewhere (a kernel, GPU, TPU) the state is returned as it is. Widening is exact,
  and the results are those of f32 activations times the exact bf16 weights, as on the kernel.
  """

  __slots__ = ('_has_low', '_sources', '_widened')

  def __init__(self, state):
    self._has_low = any(getattr(a, 'dtype', None) in LOW_FLOATS for a in jax.tree.leaves(state))
    self._sources: Optional[list] = None
    self._widened = None

  def __call__(self, state):
    """`state`, or its f32 copy (made now, or kept from a call with the same arrays)."""
    if not self._has_low or not widens_low_floats():
      return state
    low = [a for a in jax.tree.leaves(state) if getattr(a, 'dtype', None) in LOW_FLOATS]
    if self._sources is None or len(low) != len(self._sources) or any(
        a is not b for a, b in zip(low, self._sources)):
      self._widened, self._sources = jax.tree.map(_widen, state), low
    return self._widened


def kernel_refusal(xs: str, ws: str, out: str, x_shape, w: QArray,
                   max_rows: int = MAX_KERNEL_ROWS, act: Optional[str] = None,
                   explicit: bool = False) -> Optional[str]:
  """None where the CPU kernel's forms take this call (shapes and code type only; whether
  the kernel is loaded and the target a CPU is the chooser's question), else why not."""
  kind = _kernel_kind(w)
  if kind is None:
    return (f'{w.layout_name}: the kernel takes symmetric int8 and packed int4 codes')
  if head_axes(xs, ws, out):
    v, d = w.shape
    if kind == 'int4' and d % 2:
      return 'an odd contraction in the head layout: the kernel reads whole bytes'
    if act is not None and (d // w.scale.shape[1]) % (128 if kind == 'int4' else 64):
      return (f'int8 activations on a head need groups of {128 if kind == "int4" else 64} '
              'values')
    rows = math.prod(d_ for c, d_ in zip(xs, x_shape) if c != ws[1])
    if rows > max_rows:
      return f'{rows} rows > {max_rows} (decode shapes only)'
    if kind == 'int8' and act is None and rows == 1 and not explicit:
      # One row of an int8 head: the V blocks (`vblocked_einsum`) run faster than the kernel,
      # whose bottleneck there is widening int8 codes to f32 (docs/cpu_kernel.md).
      return 'one row of an int8 head runs faster in V blocks (docs/cpu_kernel.md)'
    return None
  plan = tiled.plan_tiles(xs, ws, out, x_shape, w, None)
  if plan is None:
    return f'spec {xs},{ws}->{out} is neither (contracted..., kept...) nor the head layout'
  if plan.m > max_rows:
    return f'{plan.m} rows > {max_rows} (decode shapes only)'
  if act is not None and (plan.k // plan.kq) % 4:
    return 'int8 activations need groups of a multiple of 4 rows'
  return None


def kernel_einsum(xs: str, ws: str, out: str, x: jax.Array, w: QArray, out_dtype,
                  max_rows: int = MAX_KERNEL_ROWS, act: Optional[str] = None,
                  explicit: bool = False) -> Optional[jax.Array]:
  """`qeinsum` on the CPU kernel, or None when the kernel or this spec / layout cannot.

  Args:
    xs, ws, out: the parsed spec (`parse_spec`).
    x: float activations.
    w: the quantized weight.
    out_dtype: result dtype.
    max_rows: use the kernel only up to this many activation rows.
    act: None (weight-only numerics) or 'int8': the activations are quantized per row and
      per weight group in the kernel and multiplied on integer (VNNI) dots, the numerics of
      `qeinsum`'s 'int8' path (`tiled_path.quantize_rows`); None is returned where the group
      length does not fit that kernel (a multiple of 4 rows in the (contracted..., kept...)
      layout, of 64 / 128 values for an int8 / int4 head).
    explicit: `path='kernel'` asked for it: run every form the kernel has, even where an XLA
      path measured faster (a one-row weight-only int8 head).

  Returns:
    The einsum result, or None (kernel unavailable, or `kernel_refusal` names why not).
  """
  if not cpu_kernel() or kernel_refusal(xs, ws, out, x.shape, w, max_rows, act, explicit):
    return None
  kind = _kernel_kind(w)
  if head_axes(xs, ws, out):
    return _kernel_head(xs, ws, out, x, w, kind, out_dtype, act)
  plan = tiled.plan_tiles(xs, ws, out, x.shape, w, None)
  a, k, kept_shape = plan.a, plan.k, plan.kept_shape
  x2, x_only, m_shape = _rows(xs, x, ws[:a])
  s = tiled.per_k(w.scale, w, plan)                      # (G, kept scale dims...)
  s = jnp.broadcast_to(s, s.shape[:1] + tuple(kept_shape))
  last = kept_shape[-1]
  if kind == 'int4':
    padded = 2 * packing.packed_length(last, 4)
    if padded != last:
      s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, padded - last)], constant_values=1.0)
  else:
    padded = last
  s = s.reshape(s.shape[0], -1)
  y2 = kernels.gemv(x2, w.data.reshape(k, -1), s, 'kn', kind, act=act)
  if padded != last:
    y2 = y2.reshape(y2.shape[0], -1, padded)[..., :last]
  return _finish(y2, x_only, m_shape, ws[a:], kept_shape, out, out_dtype)


def _kernel_head(xs, ws, out, x, w: QArray, kind, out_dtype, act):
  """The head layout (V, D) on the kernel's 'nk' form (`kernel_refusal` said it fits)."""
  v, _ = w.shape
  x2, x_only, m_shape = _rows(xs, x, ws[1])
  sv, _ = w.scale.shape
  s = w.scale.astype(jnp.float32)
  if sv != v:  # one scale for several rows: the kernel takes one scale row per weight row
    s = jnp.repeat(s, v // sv, axis=0)
  y2 = kernels.gemv(x2, w.data, s, 'nk', kind, act=act)
  return _finish(y2, x_only, m_shape, ws[0], (v,), out, out_dtype)


def _vblock_rows(rows: int, w: QArray) -> int:
  """V rows per block of `vblocked_einsum`."""
  v, d = w.shape
  tile_v = w.tile_shape[0]
  # Prefill (more rows than decode): blocks of 2**20 weights, fewer dot calls per head (faster
  # at 512 rows: docs/cpu_kernel.md); the temporary stays under 10% of an int4 head's bytes.
  elements = _BLOCK_ELEMENTS if rows <= MAX_KERNEL_ROWS else _PREFILL_BLOCK_ELEMENTS
  return max(tile_v, (elements // d) // tile_v * tile_v)


def vblocks_refusal(xs: str, ws: str, out: str, x_shape, w: QArray) -> Optional[str]:
  """None where `vblocked_einsum` takes this call, else why not."""
  if not head_axes(xs, ws, out):
    return 'not the head layout (weight (V, D), D contracted)'
  rows = math.prod(d for c, d in zip(xs, x_shape) if c != ws[1])
  if w.shape[0] // _vblock_rows(rows, w) < 2:
    # small enough that the block is the weight: 'dequant' is the same thing
    return f'a head of {w.shape[0]} rows is one block'
  return None


def vblocked_einsum(xs: str, ws: str, out: str, x: jax.Array, w: QArray,
                    out_dtype, act: Optional[str] = None) -> Optional[jax.Array]:
  """The head layout as a loop over blocks of V rows (module docstring), or None.

  act='int8': the activations are first quantized as `qeinsum`'s 'int8' path does (per row
  and weight group, `tiled_path.quantize_rows`) and multiplied back by their scales in f32,
  and the blocks multiply in f32: the int8 numerics up to f32 rounding, for prefill shapes of
  a W8A8 / W4A8 head (its whole-operand integer dot needed GiBs of temporaries).
  """
  if vblocks_refusal(xs, ws, out, x.shape, w):
    return None
  v, d = w.shape
  x2, x_only, m_shape = _rows(xs, x, ws[1])                        # (M, D) f32
  if act is not None:  # per row and group of the D scale columns
    g = w.scale.shape[1]
    xq, xscale = tiled.quantize_rows(x2.reshape(-1, g, d // g), (2,), 'int')
    x2 = (xq.astype(jnp.float32) * xscale).reshape(x2.shape)
  tile_v = w.tile_shape[0]
  vb = _vblock_rows(x2.shape[0], w)
  nb = v // vb
  # as the row tiles (`tiled_path.tile_dtype`); f32 for int8 activations (their values times
  # their scales are not bf16)
  cdt = jnp.float32 if act is not None else tiled.tile_dtype(x2.shape[0])
  xin = x2.astype(cdt)
  sv = w.scale.shape[0]

  def rows_of(arr, start, size):
    """A block of a scale-shaped leaf (its V axis is 1, or V / tile_v)."""
    if arr is None or sv == 1:
      return arr
    return lax.dynamic_slice_in_dim(arr, start // tile_v, size // tile_v, 0)

  qt, gs = w.qtype, w.tile_shape[1]
  per = packing.GROUPS[qt.bits][0] if qt.packed else 1
  by_fields = per > 1 and d % per == 0 and gs % per == 0
  if by_fields:
    # Packed codes: each block's bit fields (field j holds codes j, j + per, ...) are
    # dequantized and concatenated field after field, never interleaved back (the slow part
    # of unpacking on CPU), and x's columns are permuted once to that order, so each block is
    # one dot: one dot per field is several times slower, and the fields unpacked in int32
    # (not int8) are faster still (the Gemma head's timings: docs/cpu_kernel.md).
    xin = jnp.concatenate([xin[:, j::per] for j in range(per)], axis=1)

  def block(start, size):
    data = lax.dynamic_slice_in_dim(w.data, start, size, 0)
    s, z = rows_of(w.scale, start, size), rows_of(w.zero_point, start, size)
    if not by_fields:
      blk = w.rebuild([data, s, z])
      return jnp.dot(xin, dequantize(blk, cdt).T, preferred_element_type=jnp.float32)
    s = jnp.broadcast_to(s.astype(jnp.float32), (size, s.shape[1]))[:, :, None]
    if z is not None:
      z = jnp.broadcast_to(z.astype(jnp.float32), (size, z.shape[1]))[:, :, None]
    parts = []
    for c in _int32_fields(data, qt.bits):
      c = c[:, :d // per].astype(jnp.float32).reshape(size, -1, gs // per)
      parts.append(((c if z is None else c - z) * s).reshape(size, -1).astype(cdt))
    return jnp.dot(xin, jnp.concatenate(parts, axis=1).T, preferred_element_type=jnp.float32)

  # Each block's logits written in place into (M, V): stacking them (lax.map) and then
  # transposing to (M, V) copied the whole f32 output once more, which slowed the head at a
  # 512-token prefill (docs/cpu_kernel.md).
  y2 = lax.fori_loop(0, nb, lambda i, y: lax.dynamic_update_slice_in_dim(
      y, block(i * vb, vb), i * vb, 1), jnp.zeros((x2.shape[0], nb * vb), jnp.float32))
  if nb * vb < v:
    y2 = jnp.concatenate([y2, block(nb * vb, v - nb * vb)], axis=1)
  return _finish(y2, x_only, m_shape, ws[0], (v,), out, out_dtype)


def _int32_fields(packed: jax.Array, bits: int) -> list:
  """`packing.unpack_fields` with the shifts in int32 (XLA:CPU vectorises them; int8 shifts
  are slower in `vblocked_einsum`'s blocks: docs/cpu_kernel.md)."""
  per, nbytes = packing.GROUPS[bits]
  if nbytes != 1:
    return packing.unpack_fields(packed, bits)
  b = packed.astype(jnp.int32)
  return [lax.shift_right_arithmetic(lax.shift_left(b, 32 - bits * (j + 1)), 32 - bits)
          for j in range(per)]


def matrix_einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """`einsum(spec, x, w, preferred_element_type=out_dtype)` with a float weight, as a 2-D dot.

  Specs whose weight is (contracted..., kept...) (`tiled_path.canonical_axes`) reshape the
  weight to (K, N) (a bitcast of its storage) and transpose only the activations, so no
  per-call copy of the weight is possible (module docstring); other specs run `jnp.einsum`.

  Args:
    spec: two-operand einsum, activations first.
    x: activations.
    w: the weight, in x's dtype or another float dtype (as `jnp.einsum` promotes).
    out_dtype: `preferred_element_type` and result dtype (default: the promoted dtype).

  Returns:
    The einsum result.
  """
  xs, ws, out = tiled.parse_spec(spec)
  a = tiled.canonical_axes(xs, ws, out)
  if a is None:
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
  x_only = tuple(c for c in xs if c not in ws)
  x2 = jnp.transpose(x, [xs.index(c) for c in x_only + tuple(ws[:a])])
  m_shape = tuple(x.shape[xs.index(c)] for c in x_only)
  k = math.prod(w.shape[:a])
  dtype = jnp.promote_types(x.dtype, w.dtype)
  m = math.prod(m_shape)
  x2 = x2.reshape(m, k).astype(dtype)
  # XLA:GPU rewrites a one-row dot with a weight of up to a few million elements as a
  # multiply and a reduce it does not fuse: a product the weight's size is written and read
  # again (3x the weight's bytes). Two rows keep the GEMM, which reads the weight once.
  pad = m == 1 and qjax_target.platform() in ('nvidia', 'rocm')
  if pad:
    x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
  y2 = lax.dot_general(x2, w.reshape(k, -1).astype(dtype), (((1,), (0,)), ((), ())),
                       preferred_element_type=out_dtype)
  if pad:
    y2 = y2[:1]
  return _finish(y2, x_only, m_shape, ws[a:], w.shape[a:], out, y2.dtype)


def float_einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """`einsum(spec, x, w)` for a low-precision float weight (e.g. bf16), accumulated in f32.

  Never converts the whole weight per call (what `w.astype(x.dtype)` does, several times the
  f32 time at decode on XLA:CPU: docs/cpu_kernel.md): one row runs on the CPU kernel (f32
  activations, exact weights) when it is available and the spec is one of its layouts;
  otherwise activations are cast to the weight's dtype and multiplied with f32 accumulation
  (XLA:CPU's fused bf16 kernel; one row is padded to two, which that kernel needs).

  Args:
    spec: two-operand einsum, activations first.
    x: activations (any float dtype).
    w: the float weight.
    out_dtype: result dtype (default: x's dtype).

  Returns:
    The einsum result in `out_dtype`.
  """
  out_dtype = out_dtype or x.dtype
  xs, ws, out = tiled.parse_spec(spec)
  if w.dtype == jnp.bfloat16 and cpu_kernel():
    y = _float_kernel(xs, ws, out, x, w, out_dtype)
    if y is not None:
      return y
  xc = x.astype(w.dtype)
  x_only = [i for i, c in enumerate(xs) if c not in ws]
  pad = x_only and all(x.shape[i] == 1 for i in x_only)
  if pad:  # one row: XLA:CPU's plain dot widens the weight; two rows take the fused kernel
    xc = jnp.concatenate([xc, jnp.zeros_like(xc)], axis=x_only[0])
  y = matrix_einsum(spec, xc, w, jnp.float32)
  if pad:
    y = lax.slice_in_dim(y, 0, 1, axis=out.index(xs[x_only[0]]))
  return y.astype(out_dtype)


def _float_kernel(xs, ws, out, x, w, out_dtype, max_rows=1):
  """A bf16 weight on the kernel, in the 'kn' or head layout, or None."""
  if head_axes(xs, ws, out):
    x2, x_only, m_shape = _rows(xs, x, ws[1])
    if x2.shape[0] > max_rows:
      return None
    y2 = kernels.gemv(x2, w, None, 'nk', 'bf16')
    return _finish(y2, x_only, m_shape, ws[0], (w.shape[0],), out, out_dtype)
  a = tiled.canonical_axes(xs, ws, out)
  if a is None:
    return None
  x2, x_only, m_shape = _rows(xs, x, ws[:a])
  if x2.shape[0] > max_rows:
    return None
  y2 = kernels.gemv(x2, w.reshape(x2.shape[1], -1), None, 'kn', 'bf16')
  return _finish(y2, x_only, m_shape, ws[a:], w.shape[a:], out, out_dtype)
