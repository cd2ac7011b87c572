"""LoRA math on arrays: adapter shapes for any projection spec, the low-rank product, the
merged weight, and the product of a frozen quantized weight whose gradient flows to the input.

A projection `einsum(spec, x, w)` splits the weight's letters into contracted ones C (summed
with x) and kept ones K (in the output). Its adapter is A[C..., r] and B[r, K...]
(Hu et al. 2021): the layer computes

    y = einsum(spec, x, w) + (alpha / r) * einsum(einsum(x, A), B),

i.e. w + (alpha / r) * A @ B in the weight's own layout (`merged_weight`). With B = 0 at
init the adapted layer computes exactly the base layer.

`frozen_qeinsum` is `qeinsum` with a custom VJP: the forward takes the layer's own path
(tiled, kernel, ...); the backward gives only the input's cotangent, dx = dy . w^T, from a
dequantized copy of w made inside the backward (one layer at a time, never kept), so the
quantized base is neither differentiated nor stored as float residuals.
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp
import numpy as np

from qjax.core import QArray, dequantize, qeinsum
from qjax.core.qdot import parse_spec


def split_letters(spec: str) -> tuple[str, str, str, str, str]:
  """(xs, ws, out, contracted C, kept K) of a projection spec, C and K in weight order."""
  xs, ws, out = parse_spec(spec)
  contracted = ''.join(c for c in ws if c in xs and c not in out)
  kept = ''.join(c for c in ws if c in out)
  if len(contracted) + len(kept) != len(ws):
    raise ValueError(f'LoRA: spec {spec!r} has weight letters that are neither contracted nor '
                     'kept (batch axes shared by x, w and out); an adapter needs a plain '
                     'projection.')
  return xs, ws, out, contracted, kept


def _rank_letter(spec: str) -> str:
  return next(c for c in string.ascii_lowercase if c not in spec)


def adapter_shapes(spec: str, weight_shape: tuple[int, ...], rank: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shapes of A (contracted axes, r) and B (r, kept axes) for a weight of `weight_shape`."""
  _, ws, _, contracted, kept = split_letters(spec)
  size = dict(zip(ws, weight_shape))
  return (tuple(size[c] for c in contracted) + (rank,),
          (rank,) + tuple(size[c] for c in kept))


def max_rank(spec: str, weight_shape: tuple[int, ...]) -> int:
  """The largest useful rank: min(fan-in, fan-out) of the projection."""
  _, ws, _, contracted, kept = split_letters(spec)
  size = dict(zip(ws, weight_shape))
  return min(int(np.prod([size[c] for c in contracted])), int(np.prod([size[c] for c in kept])))


def lora_delta(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale * einsum(einsum(x, A), B): the adapter's addition to the layer's output, x's dtype."""
  xs, _, out, contracted, kept = split_letters(spec)
  r = _rank_letter(spec)
  rows = ''.join(c for c in xs if c not in contracted)
  h = jnp.einsum(f'{xs},{contracted}{r}->{rows}{r}', x, a.astype(x.dtype))
  y = jnp.einsum(f'{rows}{r},{r}{kept}->{out}', h, b.astype(x.dtype))
  return y * jnp.asarray(scale, x.dtype)


def adapter_product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """A @ B laid out as the weight (letters of `spec`'s weight, in order), float32."""
  _, ws, _, contracted, kept = split_letters(spec)
  r = _rank_letter(spec)
  return jnp.einsum(f'{contracted}{r},{r}{kept}->{ws}', a.astype(jnp.float32),
                    b.astype(jnp.float32))


def merged_weight(spec: str, w: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                  dtype=jnp.float32) -> jax.Array:
  """w + scale * A @ B in `dtype` (w a float array; dequantize a QArray first)."""
  return (w.astype(jnp.float32) + scale * adapter_product(spec, a, b)).astype(dtype)


def _zero_cotangent(leaf):
  if jnp.issubdtype(leaf.dtype, jnp.inexact):
    return jnp.zeros_like(leaf)
  return np.zeros(leaf.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _frozen(spec, path, out_dtype, treedef, x, *leaves):
  return qeinsum(spec, x, jax.tree.unflatten(treedef, leaves), path=path, out_dtype=out_dtype)


def _frozen_fwd(spec, path, out_dtype, treedef, x, *leaves):
  y = _frozen(spec, path, out_dtype, treedef, x, *leaves)
  # The input is kept only for its dtype and shape (an adapter keeps it anyway).
  return y, (x, leaves)


def _frozen_bwd(spec, path, out_dtype, treedef, res, dy_out):
  del path, out_dtype
  x, leaves = res
  xs, ws, out = parse_spec(spec)
  w = dequantize(jax.tree.unflatten(treedef, leaves), x.dtype)  # transient, this layer only
  dx = jnp.einsum(f'{out},{ws}->{xs}', dy_out.astype(x.dtype), w)
  return (dx, *(_zero_cotangent(l) for l in leaves))


_frozen.defvjp(_frozen_fwd, _frozen_bwd)


def frozen_qeinsum(spec: str, x: jax.Array, w: QArray, *, path: str = 'auto',
                   out_dtype=None) -> jax.Array:
  """`qeinsum(spec, x, w, path=path)` whose gradient reaches x only (w is frozen).

  Args:
    spec: the projection's spec (activations first).
    x: float activations.
    w: the quantized weight (weight-only: no activation format).
    path: the forward's qeinsum path.
    out_dtype: result dtype (default x's).

  Returns:
    The product; its VJP is dy . w^T with w dequantized inside the backward.
  """
  if not isinstance(w, QArray):
    raise ValueError(f'frozen_qeinsum: w is {type(w).__name__}, not a QArray; a float frozen '
                     'weight needs no custom gradient (use jnp.einsum).')
  leaves, treedef = jax.tree.flatten(w)
  return _frozen(spec, path, jnp.dtype(out_dtype or x.dtype), treedef, x, *leaves)
