"""Where a partitioning layout plugs into the layers; every hook is a no-op by default.

Layers only name what they compute (einsum letters, logical axes); `qjax.sharding` installs
a `ShardHooks` subclass (`with use(hooks):`, inside the traced function) that adds sharding
constraints, runs projections under `jax.shard_map` with the layout's collectives, and
splits attention over heads or batch. `nn` never imports `qjax.sharding`.
"""

from __future__ import annotations

import contextlib
from typing import Callable


class ShardHooks:
  """The default: run everything as written (one device, or plain GSPMD propagation)."""

  def constrain(self, x, letters: str):
    """`x` with the layout's sharding for an activation named by einsum letters ('BTD')."""
    del letters
    return x

  def embed_rows(self, layer, x_BTD):
    """The embedding rows `layer` (an Embed) gathered for the tokens; a layout may pin them."""
    del layer
    return x_BTD

  def einsum(self, layer, x, w, compute: Callable):
    """`compute(x, w)` for Einsum `layer`; a layout may gather `w` or shard the product."""
    del layer
    return compute(x, w)

  def attention(self, core: Callable, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache):
    """`core(q, k, v, positions, cache) -> (out_BTNH, cache)`: cache write, read, attend."""
    return core(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache)


_STACK: list[ShardHooks] = [ShardHooks()]


def current() -> ShardHooks:
  """The innermost active hooks."""
  return _STACK[-1]


@contextlib.contextmanager
def use(hooks: ShardHooks):
  """Make `hooks` active while tracing inside the `with` block."""
  _STACK.append(hooks)
  try:
    yield hooks
  finally:
    _STACK.remove(hooks)
