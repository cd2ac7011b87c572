"""Calibration plumbing shared by the PTQ integrations: token sets, weight views, statistics.

* `calibration_batches` / `token_facts`: the calibration token set, checked and hashed.
* `EinsumView`: an Einsum weight as the `w_DF` matrix the `*_core` math takes. D (rows) are
  the contracted elements, F (columns) the output elements. Rows are ordered group by group,
  so that a group of the policy's format (which spans every contracted axis but the last and
  `group_size` consecutive elements of the last, e.g. the same H-slice of every head of an
  'NHD' o_proj) is a contiguous run of rows; `to_qarray` maps a 2-D result back to exactly
  the QArray layout `quantize_model` stores.
* `collect_stats`: runs a forward function (jitted) over batches with a tap on the Einsums
  (`qjax.nn.layers.tap_inputs`, no model code edited) and streams, per layer input, the
  Hessian 2 X^T X / n, mean |x|, max |x| and the LLM.int8() 8-bit fraction. Memory is
  O(rows^2) per layer, whatever the number of batches.

Statistics are indexed by *natural* rows: the contracted axes in weight order, flattened
(e.g. (N, H) of o_proj); `EinsumView.row_perm` reorders them to the view's rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.algorithms.awq_core import absmean_update
from qjax.algorithms.gptq_core import hessian_update
from qjax.core import QArray, QFormat, broadcast_scale, first_of_tiles, from_codes, scale_shape
from qjax.core.formats import normalize_axis
from qjax.nn import einsum_layers
from qjax.nn.layers import Einsum, parse_spec, tap_inputs

STATS = ('hessian', 'absmean', 'absmax', 'int8_frac')


# ---- the calibration token set ----------------------------------------------------------
def calibration_batches(tokens, vocab_size: int, max_len: int, batch_size: int) -> list:
  """Check a [n, T] calibration token array and split it into batches of sequences."""
  t = np.asarray(tokens)
  if t.ndim != 2 or t.size == 0 or not np.issubdtype(t.dtype, np.integer):
    raise ValueError(f'calibration tokens: expected a non-empty [n, T] integer array, got '
                     f'dtype {t.dtype} shape {t.shape}; pass token ids, e.g. windows of the '
                     'training text.')
  if t.min() < 0 or t.max() >= vocab_size:
    raise ValueError(f'calibration tokens: ids span [{t.min()}, {t.max()}] but the model has '
                     f'vocab_size={vocab_size}; tokenize with the model\'s tokenizer.')
  if t.shape[1] > max_len:
    raise ValueError(f'calibration tokens: sequences of {t.shape[1]} tokens exceed the '
                     f'model\'s max_len={max_len}; cut them to <= {max_len}.')
  if int(batch_size) < 1:
    raise ValueError(f'calibration batch_size={batch_size} must be >= 1.')
  t = t.astype(np.int32)
  return [jnp.asarray(t[i:i + batch_size]) for i in range(0, t.shape[0], batch_size)]


def token_facts(tokens) -> dict:
  """What the conversion record says about the calibration tokens (hash of int32 LE ids)."""
  t = np.ascontiguousarray(np.asarray(tokens), dtype='<i4')
  return {'token_sha256': hashlib.sha256(t.tobytes()).hexdigest(),
          'num_sequences': int(t.shape[0]), 'seq_len': int(t.shape[1]),
          'tokens': int(t.size)}


# ---- Einsum weight <-> w_DF ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EinsumView:
  """An Einsum weight viewed as w_DF (see the module docstring).

  Attributes:
    spec: the layer's einsum spec.
    shape: the weight's shape.
    contracted: contracted weight axes, in weight order (groups run along the last).
    outputs: the other weight axes.
    group: rows per group along the last contracted axis (its length when ungrouped, or when
      groups span it).
    span: indices of the last contracted axis per group: 1, or for groups longer than that
      axis (o_proj's N*H grouped by 128 with H = 64: 2) the group over the flattened
      contraction, whose rows are already contiguous in natural order.
  """

  spec: str
  shape: tuple[int, ...]
  contracted: tuple[int, ...]
  outputs: tuple[int, ...]
  group: int
  span: int = 1

  @classmethod
  def of(cls, layer: Einsum, fmt: Optional[QFormat] = None) -> 'EinsumView':
    shape = tuple(layer.weight_shape)
    c = tuple(layer.contracted_axes)
    g = fmt.group_size if fmt is not None and fmt.group_size else shape[c[-1]]
    span = g // shape[c[-1]] if g > shape[c[-1]] else 1
    return cls(layer.spec, shape, c, tuple(a for a in range(len(shape)) if a not in c),
               g // span, span)

  @property
  def rows(self) -> int:
    return math.prod(self.shape[a] for a in self.contracted)

  @property
  def cols(self) -> int:
    return math.prod(self.shape[a] for a in self.outputs)

  @property
  def contracted_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.contracted)

  @property
  def output_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.outputs)

  def row_shape(self) -> list[int]:
    """Shape that broadcasts a natural-row vector (e.g. scales s_D) against the weight."""
    return [n if a in self.contracted else 1 for a, n in enumerate(self.shape)]

  def col_shape(self) -> list[int]:
    """Shape that broadcasts an output-element vector against the weight."""
    return [n if a in self.outputs else 1 for a, n in enumerate(self.shape)]

  def _split(self):
    """Split shape (last contracted axis -> groups, group) and the 2-D axis order."""
    ga, n = self.contracted[-1], len(self.shape)
    split = self.shape[:ga] + (self.shape[ga] // self.group, self.group) + self.shape[ga + 1:]
    pos = lambda a: a if a < ga else a + 1  # noqa: E731
    order = [ga] + [pos(a) for a in self.contracted[:-1]] + [ga + 1] + [
        pos(a) for a in self.outputs]
    assert len(order) == n + 1
    return split, order

  def to_2d(self, w):
    """The weight as w_DF (rows group by group)."""
    split, order = self._split()
    return jnp.transpose(jnp.reshape(w, split), order).reshape(self.rows, self.cols)

  def from_2d(self, w2):
    """Inverse of `to_2d`."""
    split, order = self._split()
    moved = jnp.reshape(w2, [split[a] for a in order])
    return jnp.transpose(moved, np.argsort(order)).reshape(self.shape)

  @functools.cached_property
  def row_perm(self) -> np.ndarray:
    """perm[r] = natural row (contracted axes flattened in weight order) of view row r."""
    cs = self.contracted_shape
    nat = np.arange(self.rows).reshape(cs[:-1] + (cs[-1] // self.group, self.group))
    m = len(cs)
    return nat.transpose([m - 1] + list(range(m - 1)) + [m]).reshape(-1)

  def x_rows(self, x):
    """Layer input x as (tokens, rows) in natural row order."""
    xs, ws, _ = parse_spec(self.spec)
    cl = [ws[a] for a in self.contracted]
    other = [i for i, c in enumerate(xs) if c not in cl]
    x = jnp.transpose(x, other + [xs.index(c) for c in cl])
    return x.reshape(-1, self.rows)

  def fmt2(self, fmt: QFormat) -> QFormat:
    """The w_DF format whose groups and channels are exactly those of `fmt` on the weight."""
    n = len(self.shape)
    ch = {normalize_axis(a, n, 'channel_axes') for a in fmt.channel_axes}
    if ch and ch != set(self.outputs):
      raise ValueError(f'{self.spec}: weight format {fmt.name} has channel axes {sorted(ch)}; '
                       f'the PTQ algorithms support one scale per output element (axes '
                       f'{list(self.outputs)}) or none (granularity "channel" or "tensor").')
    gs = None
    if fmt.group_size:
      if normalize_axis(fmt.group_axis, n, 'group_axis') != self.contracted[-1]:
        raise ValueError(f'{self.spec}: groups of {fmt.name} must run along the last '
                         f'contracted axis {self.contracted[-1]} (the policy puts them there).')
      gs = (self.group * self.span if self.span > 1 else
            self.rows // (self.shape[self.contracted[-1]] // self.group))
    return fmt.replace(channel_axes=(1,) if ch else (), group_axis=0, group_size=gs)

  def to_qarray(self, q2: QArray, fmt: QFormat) -> QArray:
    """The QArray `quantize(w, fmt)` would lay out, holding the codes and scales of `q2`."""
    sshape = scale_shape(self.shape, fmt)

    def relayout(a2):  # per-scale array: repeat over its tiles, move, keep one per tile
      if a2 is None:
        return None
      full = self.from_2d(broadcast_scale(a2, (self.rows, self.cols)))
      return first_of_tiles(full, sshape).astype(a2.dtype)

    return from_codes(self.from_2d(q2.codes()), relayout(q2.scale), relayout(q2.zero_point),
                      q2.qtype, q2.dtype)


# ---- streamed statistics of Einsum inputs -------------------------------------------------
@dataclasses.dataclass
class InputStats:
  """Running statistics of one layer's input, natural row order (module docstring).

  Attributes:
    count: tokens seen.
    hessian: 2 X^T X / count (rows, rows), if requested.
    absmean: mean |x| per row, if requested.
    absmax: max |x| per row (always kept: it is also the NaN/Inf check).
    int8_frac: per batch, the fraction of rows with max |x| <= threshold (LLM.int8()).
  """

  count: int = 0
  hessian: Optional[jax.Array] = None
  absmean: Optional[jax.Array] = None
  absmax: Optional[jax.Array] = None
  int8_frac: list = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _batch_stats(x, view: EinsumView, kinds: tuple[str, ...], threshold) -> dict:
  """One batch's statistics of a layer input (natural rows), in one compiled call."""
  xr = view.x_rows(x).astype(jnp.float32)
  amax = jnp.max(jnp.abs(xr), axis=0)
  b = {'count': xr.shape[0], 'absmax': amax}
  if 'hessian' in kinds:
    b['hessian'] = hessian_update(None, xr, 0)[0]
  if 'absmean' in kinds:
    b['absmean'] = absmean_update(None, xr, 0)[0]
  if 'int8_frac' in kinds:
    b['int8_frac'] = jnp.mean(amax <= threshold)
  return b


def _mean_merge(a, ca, b, cb):
  return b if a is None else a * (ca / (ca + cb)) + b * (cb / (ca + cb))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _capture(graphdef, state, batch, fwd):
  """(fwd(module, batch), {path: input} of every Einsum the forward calls), traced once."""
  module = nnx.merge(graphdef, state)
  names = {id(l): p for p, l in einsum_layers(module)}
  inputs = {}

  def tap(layer, x):
    if id(layer) in names:
      inputs.setdefault(names[id(layer)], x)

  with tap_inputs(tap):
    out = fwd(module, batch)
  return out, inputs


def forward(module: nnx.Module, fwd: Callable, batch):
  """`fwd(module, batch)` jitted (`fwd` a module-level function: it is a static argument)."""
  graphdef, state = nnx.split(module)
  return _capture(graphdef, state, batch, fwd)[0]


def collect_stats(module: nnx.Module, fwd: Callable, batches: Iterable, layers: Iterable[str],
                  kinds: Iterable[str] = ('hessian',),
                  threshold: Optional[float] = None) -> dict[str, InputStats]:
  """Stream statistics of the inputs of some Einsums of `module` over calibration batches.

  The forward runs jitted (one compile per module structure and batch shape) and returns the
  input of every Einsum it calls (the tap is `qjax.nn.layers.tap_inputs`); the statistics are
  folded in batch by batch, so memory is one batch of activations plus O(rows^2) per layer.

  Args:
    module: the module holding the layers (e.g. one transformer block).
    fwd: module-level function `fwd(module, batch)` running the forward that calls them.
    batches: inputs of `fwd`, one per call.
    layers: Einsum paths under `module` (e.g. 'attn/q_proj').
    kinds: any of 'hessian', 'absmean', 'absmax', 'int8_frac' (needs `threshold`).
    threshold: the LLM.int8() outlier threshold for 'int8_frac'.

  Returns:
    {path: InputStats}.

  Raises:
    ValueError: an input holds NaN/Inf (naming the layer, batch and row), or a layer is not
      called by `fwd`.
  """
  kinds, layers = set(kinds), list(layers)
  if kinds - set(STATS):
    raise ValueError(f'collect_stats: unknown kinds {sorted(kinds - set(STATS))}; use {STATS}.')
  all_layers = dict(einsum_layers(module))
  views = {n: EinsumView.of(all_layers[n]) for n in layers}
  stats = {n: InputStats() for n in layers}
  graphdef, state = nnx.split(module)
  for bi, batch in enumerate(batches):
    inputs = _capture(graphdef, state, batch, fwd)[1]
    for name in layers:
      if name not in inputs:
        raise ValueError(f'calibration: layer {name!r} is not called by {fwd.__name__}; '
                         f'called Einsums: {sorted(inputs)}.')
      b = _batch_stats(inputs[name], views[name], tuple(sorted(kinds)), threshold)
      if not np.isfinite(np.asarray(b['absmax'])).all():  # NaN and Inf propagate into it
        xr = np.asarray(views[name].x_rows(inputs[name]))
        bad = np.argwhere(~np.isfinite(xr))[0]
        raise ValueError(f'calibration: the input of {name!r} in batch {bi} holds NaN/Inf '
                         f'(token {bad[0]}, row {bad[1]}); the model overflowed or the '
                         'weights are corrupt. Calibrate in float32 on finite weights.')
      s, m = stats[name], int(b['count'])
      for k in ('hessian', 'absmean'):
        if k in b:
          setattr(s, k, _mean_merge(getattr(s, k), s.count, b[k], m))
      if 'int8_frac' in b:
        s.int8_frac.append(float(b['int8_frac']))
      s.absmax = b['absmax'] if s.absmax is None else jnp.maximum(s.absmax, b['absmax'])
      s.count += m
  return stats
