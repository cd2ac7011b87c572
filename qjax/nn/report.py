"""Accounting: what each layer became (`QuantReport`), parameter counts and weight bytes.

Bytes are what the device holds: a float weight counts `size * itemsize`, a quantized one
`qjax.core.nbytes` (packed codes + scales + zero points).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from qjax.core import QArray, nbytes, paths
from qjax.core.tiled_path import parse_spec
from qjax.nn.layers import Einsum, QWeight

# The shapes a record states each layer's path at: a decode step (one token per row) and a
# prefill (a prompt of PREFILL_TOKENS), at batch 1 unless a caller says otherwise.
PREFILL_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """One Einsum's outcome under a policy.

  Attributes:
    path: module path, e.g. 'layers/3/attn/q_proj'.
    weight: the weight format's name, or 'float'.
    act: the activation format's name, or 'float'.
    reason: which rule decided, e.g. "rule 0 '.*attn.*'", "exempt by rule 1 'embed'", or
      'no rule matched'.
    shape: the weight's shape.
    bytes_before: device bytes of the float weight.
    bytes_after: device bytes after the policy (equal to before for fake quantization).
  """

  path: str
  weight: str
  act: str
  reason: str
  shape: tuple[int, ...]
  bytes_before: int
  bytes_after: int

  @property
  def quantized(self) -> bool:
    return self.weight != 'float'


@dataclasses.dataclass(frozen=True)
class QuantReport:
  """What `quantize_model` / `apply_fake_quant` did, layer by layer.

  Attributes:
    layers: one LayerReport per Einsum, in model order.
    unused_rules: rules that matched no layer (usually a typo in a pattern).
    mode: 'quantize' (real codes) or 'fake_quant' (QAT, weights stay float).
  """

  layers: tuple[LayerReport, ...]
  unused_rules: tuple[Any, ...]
  mode: str = 'quantize'

  def __getitem__(self, path: str) -> LayerReport:
    for layer in self.layers:
      if layer.path == path:
        return layer
    raise KeyError(f'QuantReport: no layer {path!r}; layers are '
                   f'{[l.path for l in self.layers]}.')

  @property
  def bytes_before(self) -> int:
    return sum(l.bytes_before for l in self.layers)

  @property
  def bytes_after(self) -> int:
    return sum(l.bytes_after for l in self.layers)

  def quantized_bytes(self) -> tuple[int, int]:
    """(bytes before, bytes after) over the quantized layers only."""
    ls = [l for l in self.layers if l.quantized]
    return sum(l.bytes_before for l in ls), sum(l.bytes_after for l in ls)

  def __str__(self) -> str:
    rows = [('path', 'weight', 'act', 'before', 'after', 'reason')]
    rows += [(l.path, l.weight, l.act, str(l.bytes_before), str(l.bytes_after), l.reason)
             for l in self.layers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f'total: {self.bytes_before} -> {self.bytes_after} bytes ({self.mode})')
    lines += [f'warning: rule matched no layer: {r}' for r in self.unused_rules]
    return '\n'.join(lines)


def einsum_layers(model: nnx.Module) -> list[tuple[str, Einsum]]:
  """(path, Einsum) for every projection, paths like 'layers/3/attn/q_proj'."""
  return [('/'.join(str(p) for p in path), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, Einsum)]


def format_name(layer: Einsum) -> str:
  """A quantized layer's format name with axes counted from the front, as the policy report
  shows it (the `qformat` recipe its QWeight keeps; the QArray's layout if it has none)."""
  q = layer.w.get_value()
  fmt = layer.w.get_metadata().get('qformat')
  if fmt is None:
    return q.layout_name
  nd = q.ndim
  return fmt.replace(channel_axes=tuple(a % nd for a in fmt.channel_axes),
                     group_axis=fmt.group_axis % nd).name


def _array_bytes(tree) -> int:
  return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def weight_bytes(model: nnx.Module) -> dict[str, int]:
  """Bytes the device holds for the model's weights.

  Returns:
    {'float': all nnx.Param bytes (norms, unquantized projections, embeddings),
     'quantized': all QWeight bytes (codes + scales + zero points), 'total': the sum}.
  """
  fl = _array_bytes(nnx.state(model, nnx.Param))
  qs = nnx.state(model, QWeight)
  q = sum(nbytes(a) for a in jax.tree.leaves(qs, is_leaf=lambda x: isinstance(x, QArray)))
  return {'float': fl, 'quantized': q, 'total': fl + q}


def param_count(model: nnx.Module) -> int:
  """Number of weights (a quantized tensor counts its logical elements, not its bytes)."""
  fl = sum(int(a.size) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
  qs = nnx.state(model, QWeight)
  q = sum(a.size for a in jax.tree.leaves(qs, is_leaf=lambda x: isinstance(x, QArray)))
  return fl + q


def layer_paths(model: nnx.Module, *, batch: int = 1, prefill_tokens: int = PREFILL_TOKENS,
                target=None) -> dict[str, dict]:
  """The qeinsum path and reason of every quantized layer at decode and prefill shapes.

  What `qeinsum` would run for each layer (its spec, weight, activation format and requested
  path; `qjax.core.paths.describe`) on `target` (default: `qjax.target.current()`), with
  activations of `batch` rows of one token (decode) and of `prefill_tokens` tokens (prefill).

  Returns:
    {layer path: {'decode': {'path', 'reason'}, 'prefill': {'path', 'reason'}}}; float
    layers are left out.
  """
  out = {}
  for path, layer in einsum_layers(model):
    w = layer.w.get_value()
    if not isinstance(w, QArray):
      continue
    xs, ws, _ = parse_spec(layer.spec)
    entry = {}
    for name, tokens in (('decode', 1), ('prefill', prefill_tokens)):
      shape = [batch if c == 'B' else tokens if c == 'T' else
               w.shape[ws.index(c)] if c in ws else 1 for c in xs]
      # LLM.int8() layers multiply their int8 part on the 'int8' path
      request = 'int8' if layer.quant.outlier_threshold is not None else layer.quant.path
      entry[name] = paths.describe(layer.spec, shape, w, act_fmt=layer.quant.act_fmt,
                                   path=request, target=target).to_dict()
    out[path] = entry
  return out


def model_report(model: nnx.Module) -> str:
  """A table of every projection (shape, logical axes, format, bytes) and the totals."""
  rows = [('path', 'shape', 'axes', 'format', 'bytes')]
  for path, layer in einsum_layers(model):
    w = layer.w.get_value()
    if isinstance(w, QArray):
      act = layer.quant.act_fmt
      fmt = format_name(layer) + (f' x act {act.name}' if act else '')
      b = nbytes(w)
    else:
      fake = layer.quant.fake_fmt
      fmt = 'float' if fake is None else f'fake {fake.name}'
      b = int(w.size) * w.dtype.itemsize
    rows.append((path, 'x'.join(map(str, layer.weight_shape)), ','.join(layer.axes), fmt,
                 str(b)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  wb = weight_bytes(model)
  lines.append(f'params: {param_count(model):,}  weight bytes: float {wb["float"]:,} + '
               f'quantized {wb["quantized"]:,} = {wb["total"]:,}')
  return '\n'.join(lines)
