"""Per-layer sensitivity, a sensitivity-driven fallback policy, and mixed precision under a
byte budget.

Sensitivity of layer l in format f: the mean KL(float || model) of next-token distributions
on fixed tokens when only layer l holds its weights rounded to f (quantize -> dequantize into
the float model, so one compiled forward serves every layer and format; the values are the
ones `quantize_model` stores). The float model is modified in place and restored, so no
second float copy of a large model is made.

* `fallback`: start with every layer in the base format, then move the most sensitive layers
  to a higher precision one at a time until the measured whole-model KL is at most the
  threshold; report the trigger rate (share of layers, parameters and bytes that fell back).
* `mixed_precision`: choose one format per layer from a set minimising the predicted loss
  sum_l sens[l][f_l] subject to sum_l bytes[l][f_l] <= budget (a multiple-choice knapsack,
  solved by dynamic programming over the budget; the budget is a hard limit).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.core import QFormat, dequantize, int_format, quantize
from qjax.eval.memory import qformat_bytes
from qjax.nn import QuantPolicy, QuantRule, einsum_layers, resolve_format

# The format menu of mixed precision (seed: int8, int4 with groups of 128 or 32, int3).
FORMATS = {
    'int8': int_format(8),
    'int4-g128': int_format(4, group_size=128),
    'int4-g32': int_format(4, group_size=32),
    'int3-g128': int_format(3, group_size=128),
}


def candidates(model: nnx.Module, formats: Mapping[str, QFormat],
               paths: Optional[Sequence[str]] = None) -> dict:
  """{path: {name: resolved QFormat}} of the formats each Einsum can take (a group size that
  does not divide a layer's contraction axis leaves that format out for that layer)."""
  layers = dict(einsum_layers(model))
  out = {}
  for path in (paths or list(layers)):
    if path not in layers:
      raise ValueError(f'sensitivity: no layer {path!r}; layer paths are {list(layers)[:4]}...')
    ok = {}
    for name, tmpl in formats.items():
      try:
        ok[name] = resolve_format(QuantRule(re.escape(path), tmpl), layers[path], path)
      except ValueError:
        continue
    out[path] = ok
  return out


@functools.partial(jax.jit, static_argnums=1)
def _round_trip(w, fmt):
  return dequantize(quantize(w, fmt), w.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _kl(graphdef, state, tokens_BT, ref_logp_BTV):
  logp = jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens_BT).astype(jnp.float32), -1)
  return jnp.mean(jnp.sum(jnp.exp(ref_logp_BTV) * (ref_logp_BTV - logp), -1))


@functools.partial(jax.jit, static_argnums=0)
def _logp(graphdef, state, tokens_BT):
  return jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens_BT).astype(jnp.float32), -1)


class _Rounder:
  """Rounds layers of a float model in place and restores them (`restore`, or on exit)."""

  def __init__(self, model):
    self.model, self.layers, self.saved = model, dict(einsum_layers(model)), {}

  def set(self, path: str, fmt: Optional[QFormat]) -> None:
    layer = self.layers[path]
    if path not in self.saved:
      self.saved[path] = layer.w.get_value()
    w = self.saved[path]
    layer.w.set_value(w if fmt is None else _round_trip(w, fmt))

  def restore(self) -> None:
    for path, w in self.saved.items():
      self.layers[path].w.set_value(w)
    self.saved = {}


@contextlib.contextmanager
def _rounding(model):
  r = _Rounder(model)
  try:
    yield r
  finally:
    r.restore()


def _check_float(model):
  q = [p for p, l in einsum_layers(model) if l.quantized]
  if q:
    raise ValueError(f'sensitivity: layers {q[:3]} are already quantized; pass the float model.')


def reference_logp(model: nnx.Module, tokens_BT) -> jax.Array:
  """The float model's next-token log-probabilities on `tokens_BT` (the KL reference)."""
  graphdef, state = nnx.split(model)
  return _logp(graphdef, state, jnp.asarray(tokens_BT))


def model_kl(model, tokens_BT, ref_logp) -> float:
  graphdef, state = nnx.split(model)
  return float(_kl(graphdef, state, jnp.asarray(tokens_BT), ref_logp))


def layer_sensitivity(model: nnx.Module, tokens_BT, formats: Mapping[str, QFormat] = None,
                      paths: Optional[Sequence[str]] = None, log=None) -> dict:
  """Per-layer sensitivity: KL when only that layer is rounded to each format.

  Args:
    model: the float model (modified in place during the call, restored after).
    tokens_BT: fixed evaluation tokens.
    formats: {name: weight QFormat template} (default `FORMATS`).
    paths: layers to measure (default every Einsum).
    log: optional progress printer.

  Returns:
    {'kl': {path: {format: KL nats}}, 'params': {path: n}, 'tokens': B * T}.
  """
  _check_float(model)
  formats = FORMATS if formats is None else formats
  tokens_BT = jnp.asarray(tokens_BT)
  ref = reference_logp(model, tokens_BT)
  cand = candidates(model, formats, paths)
  out = {}
  with _rounding(model) as r:
    for i, (path, fmts) in enumerate(cand.items()):
      out[path] = {}
      for name, fmt in fmts.items():
        r.set(path, fmt)
        out[path][name] = model_kl(model, tokens_BT, ref)
      r.set(path, None)
      if log:
        log(f'sensitivity [{i + 1}/{len(cand)}] {path}: '
            + ', '.join(f'{k} {v:.3g}' for k, v in out[path].items()))
  params = {p: int(math.prod(l.weight_shape)) for p, l in einsum_layers(model) if p in out}
  return {'kl': out, 'params': params, 'tokens': int(tokens_BT.size)}


def layer_bytes(model: nnx.Module, formats: Mapping[str, QFormat] = None) -> dict:
  """{path: {format: stored bytes}} (codes + scales + zero points) of every candidate format,
  plus 'float' (the parameter dtype)."""
  formats = FORMATS if formats is None else formats
  out = {}
  for path, fmts in candidates(model, formats).items():
    layer = dict(einsum_layers(model))[path]
    w = layer.w.get_value()
    out[path] = {n: qformat_bytes(layer.weight_shape, f)['total'] for n, f in fmts.items()}
    out[path]['float'] = int(w.size) * w.dtype.itemsize
  return out


def policy_from_assignment(assignment: Mapping[str, Optional[str]],
                           formats: Mapping[str, QFormat] = None) -> QuantPolicy:
  """A QuantPolicy with one rule per layer: {path: format name, or None / 'float' (exempt)}."""
  formats = FORMATS if formats is None else formats
  rules = []
  for path, name in assignment.items():
    if name in (None, 'float'):
      rules.append(QuantRule(re.escape(path), exempt=True))
    elif name not in formats:
      raise ValueError(f'policy_from_assignment: layer {path!r} has format {name!r}, not in '
                       f'{sorted(formats)}.')
    else:
      rules.append(QuantRule(re.escape(path), formats[name]))
  return QuantPolicy(tuple(rules), strict=True)


def trigger_rate(assignment: Mapping[str, str], fell_back: Sequence[str], params: Mapping,
                 nbytes: Mapping[str, Mapping[str, int]]) -> dict:
  """Share of layers, parameters and stored bytes that fell back to the higher format."""
  fell = set(fell_back)
  n_par = sum(params[p] for p in assignment)
  stored = {p: nbytes[p][assignment[p] or 'float'] for p in assignment}
  return {'layers': len(fell) / len(assignment), 'params': sum(params[p] for p in fell) / n_par,
          'bytes': sum(stored[p] for p in fell) / sum(stored.values()),
          'fell_back': sorted(fell)}


def fallback(model: nnx.Module, tokens_BT, *, base: str, high: str, threshold: float,
             sensitivity: Optional[dict] = None, formats: Mapping[str, QFormat] = None,
             log=None) -> dict:
  """The fallback policy: base format everywhere, the most sensitive layers at `high`.

  Layers are moved from `base` to `high` (a format name, or 'float') in order of decreasing
  sensitivity in `base`, one at a time, until the whole-model KL on `tokens_BT` is at most
  `threshold`.

  Args:
    model: the float model (modified in place during the call, restored after).
    tokens_BT: the tokens the KL is measured on (those of `sensitivity`).
    base, high: format names in `formats` ('float' allowed for high).
    threshold: the target KL(float || quantized), nats per token.
    sensitivity: `layer_sensitivity` output with `base` measured (computed if None).
    formats: the format menu (default `FORMATS`).

  Returns:
    {'assignment' {path: format}, 'policy', 'kl' (final), 'reached', 'threshold',
     'trajectory' [(layers fallen back, KL)], 'trigger_rate' (layers / params / bytes)}.
  """
  formats = FORMATS if formats is None else formats
  for name in (base, high):
    if name != 'float' and name not in formats:
      raise ValueError(f'fallback: format {name!r} is not in {sorted(formats)} (or "float").')
  if not threshold > 0:
    raise ValueError(f'fallback: threshold={threshold!r} must be a KL > 0 (nats per token).')
  _check_float(model)
  if sensitivity is None:
    sensitivity = layer_sensitivity(model, tokens_BT, {base: formats[base]})
  cand = candidates(model, formats)
  eligible = [p for p in cand if base in cand[p] and (high == 'float' or high in cand[p])]
  if not eligible:
    raise ValueError(f'fallback: no layer can take both {base!r} and {high!r}.')
  order = sorted(eligible, key=lambda p: -sensitivity['kl'][p][base])
  tokens_BT = jnp.asarray(tokens_BT)
  ref = reference_logp(model, tokens_BT)
  assignment = {p: base for p in eligible}
  trajectory = []
  with _rounding(model) as r:
    for p in eligible:
      r.set(p, cand[p][base])
    kl = model_kl(model, tokens_BT, ref)
    trajectory.append((0, kl))
    for k, p in enumerate(order, start=1):
      if kl <= threshold:
        break
      r.set(p, None if high == 'float' else cand[p][high])
      assignment[p] = high
      kl = model_kl(model, tokens_BT, ref)
      trajectory.append((k, kl))
      if log:
        log(f'fallback: {p} -> {high}, KL {kl:.4g} (threshold {threshold:g})')
  fell = [p for p in eligible if assignment[p] == high]
  nbytes = layer_bytes(model, formats)
  return {'assignment': assignment, 'policy': policy_from_assignment(assignment, formats),
          'kl': kl, 'reached': kl <= threshold, 'threshold': threshold, 'base': base,
          'high': high, 'trajectory': trajectory,
          'trigger_rate': trigger_rate(assignment, fell, sensitivity['params'], nbytes)}


def mixed_precision(sensitivity: Mapping[str, Mapping[str, float]],
                    nbytes: Mapping[str, Mapping[str, int]], budget: int,
                    allowed: Optional[Sequence[str]] = None, bins: int = 20_000) -> dict:
  """Per-layer formats minimising the predicted loss within a byte budget.

  The predicted loss is the sum of the chosen formats' per-layer sensitivities (KL adds to
  first order for small, independent perturbations). Solved as a multiple-choice knapsack by
  dynamic programming over the budget cut into `bins` units, each layer's bytes rounded *up*
  to whole units (so the result never exceeds the budget; the rounding gives up at most
  n_layers units, about 0.6% of the budget for 127 layers; a budget under `bins` bytes is
  solved exactly, one unit per byte); leftover bytes are then spent
  greedily on the best remaining loss reduction per byte that still fits.

  Args:
    sensitivity: {path: {format: KL}} (`layer_sensitivity(...)['kl']`).
    nbytes: {path: {format: bytes}} (`layer_bytes`); only formats in both maps are used.
    budget: bytes available for these layers.
    allowed: the format names to choose from (default: every format with a sensitivity).
    bins: budget resolution of the dynamic program.

  Returns:
    {'assignment' {path: format}, 'bytes', 'budget', 'predicted_kl'}.

  Raises:
    ValueError: the budget is below the smallest formats' total (names it).
  """
  opts = {}
  for p, s in sensitivity.items():
    names = [f for f in s if f in nbytes[p] and (allowed is None or f in allowed)]
    if not names:
      raise ValueError(f'mixed_precision: layer {p!r} has no allowed format with both a '
                       f'sensitivity and a size; it has {sorted(s)}.')
    opts[p] = sorted(names, key=lambda f: (nbytes[p][f], sensitivity[p][f]))
  smallest = sum(nbytes[p][o[0]] for p, o in opts.items())
  if smallest > budget:
    raise ValueError(f'mixed_precision: budget {budget} bytes is below the smallest formats\' '
                     f'total {smallest} bytes; raise the budget or add a smaller format.')
  paths = list(opts)
  bins = max(1, min(bins, int(budget)))  # a small budget is solved byte by byte, exactly
  unit = budget / bins
  dp = np.zeros(bins + 1)  # dp[c]: least loss of the layers so far within c units
  picks = np.zeros((len(paths), bins + 1), np.int8)
  for i, p in enumerate(paths):
    new = np.full(bins + 1, np.inf)
    for j, f in enumerate(opts[p]):
      w = math.ceil(nbytes[p][f] / unit - 1e-9)
      if w > bins:
        continue
      cand = np.full(bins + 1, np.inf)
      cand[w:] = dp[:bins + 1 - w] + sensitivity[p][f]
      better = cand < new
      new[better], picks[i][better] = cand[better], j
    dp = new
  choice = {}
  c = int(np.argmin(dp)) if np.isfinite(dp).any() else None
  if c is None or not np.isfinite(dp[c]):  # rounding left no room: start from the smallest
    choice = {p: o[0] for p, o in opts.items()}
  else:
    for i in range(len(paths) - 1, -1, -1):
      p = paths[i]
      f = opts[p][picks[i][c]]
      choice[p] = f
      c -= math.ceil(nbytes[p][f] / unit - 1e-9)
  used = sum(nbytes[p][f] for p, f in choice.items())
  while True:  # spend what the rounding left
    best = None
    for p, f in choice.items():
      for g in opts[p]:
        extra = nbytes[p][g] - nbytes[p][f]
        gain = sensitivity[p][f] - sensitivity[p][g]
        if gain > 0 and used + extra <= budget:
          ratio = gain / extra if extra > 0 else math.inf
          if best is None or ratio > best[0]:
            best = (ratio, p, g, extra)
    if best is None:
      break
    _, p, g, extra = best
    choice[p], used = g, used + extra
  loss = lambda a: float(sum(sensitivity[p][f] for p, f in a.items()))  # noqa: E731
  return {'assignment': choice, 'bytes': int(used), 'budget': int(budget),
          'predicted_kl': loss(choice)}


def assignment_bytes(assignment: Mapping[str, str], nbytes) -> int:
  return int(sum(nbytes[p][f or 'float'] for p, f in assignment.items()))


def uniform_assignment(model, fmt_name: str, formats=None) -> dict:
  """{path: fmt_name} for every layer that can take it ('float' for the others)."""
  cand = candidates(model, FORMATS if formats is None else formats)
  return {p: fmt_name if fmt_name in c else 'float' for p, c in cand.items()}


def summarize(sens: dict) -> list[dict]:
  """Rows (path, params, KL per format) sorted by the largest KL, for the report."""
  rows = [{'path': p, 'params': sens['params'][p], **{f'kl_{k}': v for k, v in s.items()}}
          for p, s in sens['kl'].items()]
  return sorted(rows, key=lambda r: -max(v for k, v in r.items() if k.startswith('kl_')))
