"""Orbax save/restore of an NNX model's state (float, quantized or fake-quantized)."""

from __future__ import annotations

import os
from typing import Callable

import orbax.checkpoint as ocp
from flax import nnx


def save_state(directory: str, model: nnx.Module) -> str:
  """Write `nnx.state(model)` with Orbax under `directory/state` (synchronously).

  Raises:
    ValueError: `directory` exists and is not a directory (Orbax would fail in a background
      thread and leave the process hanging).
  """
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f'save_state: {directory!r} exists and is a file; pass a directory path '
                     '(new, or a previous output) or remove the file.')
  path = os.path.join(os.path.abspath(directory), 'state')
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, nnx.state(model), force=True)
  ckpt.wait_until_finished()
  return path


def restore_state(directory: str, build: Callable[[], nnx.Module]) -> nnx.Module:
  """Restore a model saved by `save_state`.

  Args:
    directory: what `save_state` was given.
    build: a function constructing a model of the same structure (it is only traced with
      `nnx.eval_shape`, so no weights are computed), e.g. `lambda: quantize_model(...)[0]`.

  Returns:
    The restored model.

  Raises:
    ValueError: the directory does not exist or holds a different architecture.
  """
  path = os.path.join(os.path.abspath(directory), 'state')
  if not os.path.isdir(path):
    raise ValueError(f'no saved model state at {path!r}; pass a directory written by '
                     'save_state (e.g. a quantize.py output or a training checkpoint).')
  graphdef, abstract = nnx.split(nnx.eval_shape(build))
  try:
    state = ocp.StandardCheckpointer().restore(path, abstract)
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'the checkpoint at {path!r} does not match the requested architecture '
                     f'(shapes or parameter names differ): {str(e)[:300]}. Use the config the '
                     'checkpoint was written with.') from e
  return nnx.merge(graphdef, state)
