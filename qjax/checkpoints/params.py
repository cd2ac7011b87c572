"""Flat parameter dicts <-> qjax `Transformer`s: the one place imported weights meet the model.

Importers (GGUF, safetensors) translate a foreign checkpoint into a flat dict keyed by qjax
paths, already in qjax layouts, e.g.

    'embed/w'                     (V, D)
    'layers/0/attn/q_proj/w'      (D, N, H)      'layers/0/attn/o_proj/w'   (N, H, D)
    'layers/0/attn/k_proj/w'      (D, K, H)      'layers/0/mlp/down_proj/w' (F, D)
    'layers/0/pre_attn_norm/scale' (D,)          'lm_head/w'                (D, V) if untied

and `model_from_params` checks it against the model the config describes (every parameter
present, no extras, every shape right) before building the model without a random init.
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.core.numerics import check_finite
from qjax.nn import Transformer, TransformerConfig


def _key(path) -> str:
  return '/'.join(str(p) for p in path)


def _abstract(cfg: TransformerConfig):
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def param_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """{qjax path: shape} of every parameter of `Transformer(cfg)` (nothing is allocated)."""
  _, state = nnx.split(_abstract(cfg))
  return {_key(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}


def model_from_params(cfg: TransformerConfig, params: Mapping[str, np.ndarray], *,
                      source: str = 'checkpoint') -> Transformer:
  """Build `Transformer(cfg)` holding `params` (cast to `cfg.param_dtype`).

  Args:
    cfg: the architecture.
    params: {qjax path: array in the qjax layout}, see the module docstring.
    source: what the params came from, named in error messages.

  Returns:
    The model.

  Raises:
    ValueError: a parameter is missing, unexpected, has the wrong shape, or holds NaN/Inf.
  """
  graphdef, state = nnx.split(_abstract(cfg))
  flat = nnx.to_flat_state(state)
  expected = {_key(p) for p, _ in flat}
  missing = sorted(expected - set(params))
  extra = sorted(set(params) - expected)
  if missing or extra:
    raise ValueError(f'{source}: parameters do not match the model config: missing '
                     f'{missing[:6]}{"..." if len(missing) > 6 else ""}, unexpected '
                     f'{extra[:6]}{"..." if len(extra) > 6 else ""}. The checkpoint and the '
                     'config describe different architectures.')
  dtype = jnp.dtype(cfg.param_dtype)
  for path, var in flat:
    key = _key(path)
    want = tuple(var.get_value().shape)
    value = params[key]  # read once: a lazy mapping reads the file on every access
    got = tuple(np.shape(value))
    if got != want:
      raise ValueError(f'{source}: parameter {key!r} has shape {got}, the model config '
                       f'implies {want}; the checkpoint does not match its config.')
    # NaN/Inf weights would give NaN logits far from their cause: refuse them on load.
    check_finite(value, f'{source}: parameter {key!r}',
                 'the checkpoint is corrupted or was saved after a diverged run; use another '
                 'copy of it.')
    var.set_value(jnp.asarray(value, dtype))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def model_params(model: nnx.Module) -> dict[str, np.ndarray]:
  """{qjax path: numpy array} of a float model's parameters (the inverse of the above)."""
  return {_key(p): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
