"""A model as its decode loops run it: split once, its graphdef hashed once, its lengths known.

Per-step host work of a decode loop is kept off the critical path, where it would cost a
share of every step (on an accelerator, most of it; measurements: docs/fast_decode.md):

* The model is split (`nnx.split`, a walk over every graph node) once per model, not per
  token: the split's state holds the model's own Variables, so new values assigned to them
  reach the next step; a change of structure (a replaced Variable or submodule, a new static
  attribute such as a KV format) is seen by a cheaper walk over the module attributes, and
  the model is split again.
* On XLA:CPU without the kernel, bf16/f16 weights run as an f32 copy made once per model
  (`qjax.core.decode_paths.DecodeWeights`): no XLA:CPU form of a bf16 weight decodes at f32
  speed.
* The graphdef is a static jit argument; jit hashes static arguments on every call (a walk
  over the whole graphdef), so it is passed in a wrapper that hashes once (`StaticGraphdef`).
* The overflow check needs every row's length on the host. A cache returned by the decode
  steps carries its lengths on the host too (`host_lengths`), so the next step checks
  without waiting for the device, and steps queue back to back.

The two tables here (`SPLITS`, and the host lengths) are keyed by `id()` and cleared by weak
references when the model or the length array dies: global state, kept because the decode
functions take a model, not a handle, and must not re-split it per call.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Optional

import numpy as np
from flax import nnx

from qjax.core.decode_paths import DecodeWeights


class StaticGraphdef:
  """A graphdef as a jit static argument whose hash is computed once.

  Equality is identity first (the common case: the same split reused), then the graphdefs'
  own equality, so two splits of models of one structure share a compilation.
  """

  __slots__ = ('graphdef', '_hash')

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, StaticGraphdef) and self._hash == other._hash
                             and self.graphdef == other.graphdef)


def merge(static, state):
  """`nnx.merge` of a `StaticGraphdef` (or a bare graphdef) and a state; in-jit."""
  return nnx.merge(getattr(static, 'graphdef', static), state)


def _structure(node, out: list) -> list:
  """Every module, Variable and static attribute under `node`, in a fixed order."""
  out.append(node)
  for value in vars(node).values():
    if isinstance(value, nnx.Pytree):  # modules, nnx.List / nnx.Dict
      _structure(value, out)
    else:
      out.append(value)
  return out


@dataclasses.dataclass
class _Split:
  static: StaticGraphdef
  state: Any
  structure: list
  weights: DecodeWeights

  def current(self, model) -> bool:
    now = _structure(model, [])[1:]
    return len(now) == len(self.structure) and all(
        a is b for a, b in zip(now, self.structure))


SPLITS: dict[int, tuple[weakref.ref, _Split]] = {}


def _forget(table: dict, key: int, _ref) -> None:
  """Weakref callback: drop `key` from `table`.

  The table is bound here, not looked up as a module global: at interpreter shutdown the
  module's globals are set to None before the last models and arrays die, and a callback
  that then read the table printed "Exception ignored ... 'NoneType' object has no
  attribute 'pop'".
  """
  table.pop(key, None)


def split_for_decode(model: nnx.Module) -> tuple[StaticGraphdef, Any]:
  """(graphdef wrapper, decode state) of `model`, split again only when its structure
  changed; the state is `DecodeWeights` of the split (bf16 widened once on XLA:CPU without
  the kernel, else the model's own state)."""
  key = id(model)
  hit = SPLITS.get(key)
  if hit is not None and hit[0]() is model and hit[1].current(model):
    return hit[1].static, hit[1].weights(hit[1].state)
  graphdef, state = nnx.split(model)
  # Not the model itself ([1:]): the entry must not keep it alive (it is dropped with it).
  entry = _Split(StaticGraphdef(graphdef), state, _structure(model, [])[1:],
                 DecodeWeights(state))
  SPLITS[key] = (weakref.ref(model, functools.partial(_forget, SPLITS, key)), entry)
  return entry.static, entry.weights(entry.state)


# id(cache.length) -> (weakref to that array, its values on the host): caches the decode
# steps returned, so that the next step checks overflow without reading the device.
_HOST_LENGTHS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def host_lengths(cache) -> Optional[np.ndarray]:
  """The host copy of `cache.length` a decode step recorded, or None."""
  hit = _HOST_LENGTHS.get(id(cache.length))
  if hit is not None and hit[0]() is cache.length:
    return hit[1]
  return None


def remember_lengths(cache, lengths: np.ndarray) -> None:
  """Record `lengths` as the host copy of `cache.length`."""
  arr = cache.length
  key = id(arr)
  try:
    ref = weakref.ref(arr, functools.partial(_forget, _HOST_LENGTHS, key))
  except TypeError:  # not weak-referenceable: the next step reads the device
    return
  _HOST_LENGTHS[key] = (ref, lengths)
