"""`describe`: the path a `qeinsum` call would take, from shapes alone (for records)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from qjax.core.paths.call import Call
from qjax.core.paths.choose import Choice, choose


def act_kind(act_fmt, w_qtype, request: str) -> Optional[str]:
  """The activation kind a call multiplies: None (weight-only), 'int' or the weight's fp8
  kind (fp8 activations take the weight's kind)."""
  if act_fmt is None and request not in ('int8', 'fp8'):
    return None
  if request == 'int8' or (act_fmt is not None and not act_fmt.is_float and request != 'fp8'):
    return 'int'
  return w_qtype.kind if w_qtype.is_float else 'e4m3'


def describe(spec: str, x_shape, w, *, act_fmt=None, path: str = 'auto', x_dtype=jnp.bfloat16,
             target=None) -> Choice:
  """The Choice of `qeinsum(spec, x, w, act_fmt=act_fmt, path=path)` for x of `x_shape`.

  Args:
    spec: the einsum spec, activations first.
    x_shape: the activations' shape (only rows matter: tokens times batch).
    w: the QArray weight (concrete or abstract: only shapes are read).
    act_fmt: the activation format, or None.
    path: the requested path.
    x_dtype: the activations' dtype.
    target: the Target (default: `qjax.target.current()`).

  Returns:
    A Choice (path and reason).
  """
  x = jax.ShapeDtypeStruct(tuple(x_shape), x_dtype)
  return choose(Call.of(spec, x, w, act_kind(act_fmt, w.qtype, path)), path, target)
