"""Quantization policies: regex rules over module paths -> formats on `Einsum` layers.

A `QuantPolicy` is an ordered tuple of `QuantRule`s; for each Einsum (paths as listed in
`Transformer`'s docstring: 'embed', 'layers/3/attn/q_proj', 'lm_head', ...) the first rule
whose `pattern` *fully* matches the path (`re.fullmatch`) decides; no match keeps it float.

A rule's weight `QFormat` is a template: bits, kind, symmetry, `group_size`, `pow2_scale`,
`scale_dtype` and calibration come from it, and the layer supplies the axes, because only
the layer knows which of its weight axes are contracted:

* `group_axis` = the weight's last contracted axis (D of 'DF', H of 'NHD');
* `granularity='channel'` (default): one scale per index of every non-contracted axis
  (per output channel; with `group_size`, per output channel and group);
* `granularity='tensor'`: no channel axes (one scale, or one per group along the
  contracted axis with `group_size`).

So the template's own `channel_axes` must stay () (ValueError otherwise: set granularity).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Mapping, Optional, Union

import jax
from flax import nnx

from qjax.core import QFormat, check_finite, choose_path, nbytes, quantize
from qjax.core import layouts
from qjax.core.numerics import check_scales, scale_shape
from qjax.core.qarray import RangeArg
from qjax.core.qdot import PATHS
from qjax.nn.layers import Einsum, QWeight, parse_spec
from qjax.nn.report import LayerReport, QuantReport, einsum_layers

GRANULARITIES = ('channel', 'tensor')


@dataclasses.dataclass(frozen=True)
class QuantRule:
  """Quantize the Einsums whose path fully matches `pattern`.

  Attributes:
    pattern: regex over module paths, matched with `re.fullmatch` (e.g. r'layers/\\d+/mlp/.*').
    weight: weight format template (see the module docstring), required unless exempt.
    act: activation format for W8A8 / fp8 x fp8 (its kind is used: activations are
      quantized dynamically per token), or None for weight-only.
    exempt: keep matching layers float (and stop later rules from matching them).
    granularity: 'channel' or 'tensor' (module docstring).
  """

  pattern: str
  weight: Optional[QFormat] = None
  act: Optional[QFormat] = None
  exempt: bool = False
  granularity: str = 'channel'

  def __post_init__(self):
    if not isinstance(self.pattern, str):
      raise ValueError(f'QuantRule: pattern={self.pattern!r} must be a regex string over module '
                       "paths, e.g. QuantRule('.*', int_format(8)) or "
                       "QuantRule(r'layers/\\d+/mlp/.*', int_format(4, group_size=128)).")
    for name in ('weight', 'act'):
      fmt = getattr(self, name)
      if fmt is not None and not isinstance(fmt, QFormat):
        hint = _format_hint(fmt)
        raise ValueError(f'QuantRule({self.pattern!r}): {name}={fmt!r} is a '
                         f'{type(fmt).__name__}, not a QFormat; pass {name}={hint}.')
    try:
      re.compile(self.pattern)
    except re.error as e:
      raise ValueError(f'QuantRule: pattern {self.pattern!r} is not a valid regex ({e}).') from None
    if self.exempt:
      if self.weight is not None or self.act is not None:
        raise ValueError(f'QuantRule({self.pattern!r}): exempt=True keeps layers float; drop '
                         'weight/act, or set exempt=False.')
      return
    if self.weight is None:
      raise ValueError(f'QuantRule({self.pattern!r}): weight=None; give a weight QFormat, or '
                       'exempt=True to keep the layers float (activation-only quantization '
                       'is not supported).')
    if self.weight.channel_axes:
      raise ValueError(f'QuantRule({self.pattern!r}): the weight template sets channel_axes='
                       f'{self.weight.channel_axes}, but each layer picks its own axes; drop '
                       "channel_axes and use granularity='channel' or 'tensor'.")
    if self.act is not None and (self.act.bits != 8 or not self.act.symmetric):
      # qeinsum reads only the activation format's kind and always quantizes activations to
      # 8-bit symmetric codes: anything else would run int8 while the record said otherwise.
      raise ValueError(f'QuantRule({self.pattern!r}): activation format {self.act.name} is not '
                       'implemented: activations are quantized dynamically to symmetric 8-bit '
                       'codes only (int8 or fp8). Use act=int_format(8) (W8A8), '
                       "act=fp8_format('e4m3'), or act=None for weight-only (e.g. W4A16).")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f'QuantRule({self.pattern!r}): granularity={self.granularity!r} is '
                       f'unknown; use one of {GRANULARITIES}.')

  def matches(self, path: str) -> bool:
    return re.fullmatch(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
  """Ordered rules (first match wins).

  Attributes:
    rules: the rules.
    strict: raise (instead of warn) when a rule matches no layer.
    path: qeinsum compute path for every quantized layer ('auto', 'dequant', 'int8', 'fp8',
      'native', 'pallas'; `qjax.core.qdot`).
  """

  rules: tuple[QuantRule, ...]
  strict: bool = False
  path: str = 'auto'

  def __post_init__(self):
    if isinstance(self.rules, QuantRule):
      raise ValueError('QuantPolicy: rules is one QuantRule; pass a tuple of them: '
                       'QuantPolicy((rule,)).')
    if isinstance(self.rules, str):
      raise ValueError(f'QuantPolicy: rules={self.rules!r} is a string; pass a tuple of '
                       f"QuantRule, e.g. QuantPolicy((QuantRule({self.rules!r}, "
                       'int_format(8)),)).')
    object.__setattr__(self, 'rules', tuple(self.rules))
    for i, rule in enumerate(self.rules):
      if not isinstance(rule, QuantRule):
        example = (f'QuantRule({rule!r}, int_format(8))' if isinstance(rule, str) else
                   "QuantRule('.*', int_format(8))")
        raise ValueError(f'QuantPolicy: rules[{i}]={rule!r} is a {type(rule).__name__}, not a '
                         f'QuantRule; write {example}.')
    if self.path not in PATHS:
      raise ValueError(f'QuantPolicy: path={self.path!r} is unknown; use one of {PATHS}.')

  def match(self, path: str) -> tuple[Optional[int], Optional[QuantRule]]:
    """(index, rule) of the first rule matching `path`, or (None, None)."""
    return match_rules(self.rules, [path])[0][0]


def _format_hint(value) -> str:
  """The QFormat call a format name like 'int4' or 'fp8_e4m3' stands for (for messages)."""
  m = re.fullmatch(r'int(\d)(?:[-_]?g(\d+))?', str(value).lower())
  if m:
    group = f', group_size={m.group(2)}' if m.group(2) else ''
    return f'int_format({m.group(1)}{group})'
  m = re.fullmatch(r'fp8[-_]?(e4m3|e5m2)', str(value).lower())
  if m:
    return f"fp8_format('{m.group(1)}')"
  return 'int_format(8) (or int_format(4, group_size=128), fp8_format())'


def resolve_format(rule: QuantRule, layer: Einsum, path: str, compute: str = 'auto') -> QFormat:
  """The rule's template with axes filled in for `layer` (module docstring)."""
  shape = layer.weight_shape
  contracted = layer.contracted_axes
  if not contracted:
    raise ValueError(f'quantize: layer {path!r} (spec {layer.spec!r}) contracts no weight '
                     'axis; exempt it.')
  group_axis = contracted[-1]
  channel = () if rule.granularity == 'tensor' else tuple(
      i for i in range(len(shape)) if i not in contracted)
  g = rule.weight.group_size
  fmt = rule.weight.replace(channel_axes=channel, group_axis=group_axis)
  if g is not None and shape[group_axis] % g:
    _check_flat_groups(fmt, layer, path, rule.pattern)
  try:
    if compute == 'auto':
      choose_path(fmt, rule.act)
    elif compute in ('int8', 'fp8') and (compute == 'int8') == fmt.is_float:
      raise ValueError(f"path={compute!r} cannot multiply {fmt.name} weights; use 'dequant' "
                       f"or '{'fp8' if fmt.is_float else 'int8'}'.")
    elif compute in ('native', 'pallas') and rule.act is not None:
      raise ValueError(f'path={compute!r} is weight-only, but the rule quantizes activations '
                       f"({rule.act.name}); use path='auto' or drop act.")
  except ValueError as e:
    raise ValueError(f'quantize: layer {path!r}: {e}') from None
  return fmt


def _check_flat_groups(fmt: QFormat, layer: Einsum, path: str, pattern: str) -> None:
  """Groups longer than the last contracted axis run along the flattened contraction (o_proj's
  N*H): allowed when each group is whole rows of contracted axes (`numerics.scale_shape`)."""
  shape, contracted = layer.weight_shape, layer.contracted_axes
  letters = parse_spec(layer.spec)[1]
  flat = ''.join(letters[i] for i in contracted)
  try:
    sshape = scale_shape(shape, fmt)
    cut = [i for i, (d, k) in enumerate(zip(shape, sshape))
           if i != fmt.group_axis and i not in fmt.channel_axes and k > 1]
    ok = all(i in contracted for i in cut)
  except ValueError:
    ok = False
  if not ok:
    ga = fmt.group_axis
    raise ValueError(f'quantize: group_size={fmt.group_size} of rule {pattern!r} does not '
                     f'divide layer {path!r}: its contraction axis {letters[ga]} has '
                     f'{shape[ga]} elements (weight shape {shape}), and groups of the '
                     f'flattened contraction {flat} must be whole rows of {letters[ga]}. Use a '
                     f'group size dividing {shape[ga]} or a multiple of it that divides the '
                     'axes before it, or a rule for this layer without groups.')


def match_rules(rules, paths) -> tuple[list, tuple]:
  """The regex-rule walk `QuantPolicy` and `qjax.train.lora.AdapterPolicy` share.

  Args:
    rules: ordered rules with `.pattern` and `.matches(path)` (re.fullmatch).
    paths: module paths, e.g. ['embed', 'layers/0/attn/q_proj', ...].

  Returns:
    ([(index, rule) of the first rule matching each path, or (None, None)], the rules that
    matched no path, in order). An exempt rule counts as matched (it stops later rules).
  """
  rules = tuple(rules)
  matches, used = [], set()
  for path in paths:
    hit = next(((i, r) for i, r in enumerate(rules) if r.matches(path)), (None, None))
    if hit[0] is not None:
      used.add(hit[0])
    matches.append(hit)
  return matches, tuple(r for i, r in enumerate(rules) if i not in used)


def report_unused_rules(unused, paths, *, mode: str, strict: bool, fix: str,
                        shown: int = 3) -> None:
  """Raise (strict) or warn when rules matched no layer, naming the patterns and the paths."""
  if not unused:
    return
  msg = (f'{mode}: {len(unused)} rule(s) matched no layer: '
         f'{[r.pattern for r in unused]}; layer paths look like '
         f'{list(paths)[:shown]} (patterns use re.fullmatch).')
  if strict:
    raise ValueError(msg + ' ' + fix)
  warnings.warn(msg, stacklevel=2)


def _plan(model: nnx.Module, policy: QuantPolicy, mode: str):
  """Per Einsum (path, layer, fmt or None, act or None, reason), and the unused rules."""
  layers = einsum_layers(model)
  matches, unused = match_rules(policy.rules, [p for p, _ in layers])
  plan = []
  for (path, layer), (i, rule) in zip(layers, matches):
    if layer.quantized:
      raise ValueError(f'{mode}: layer {path!r} is already quantized; start from the float '
                       'model.')
    if rule is None:
      plan.append((path, layer, None, None, 'no rule matched'))
      continue
    if rule.exempt:
      plan.append((path, layer, None, None, f'exempt by rule {i} {rule.pattern!r}'))
      continue
    fmt = resolve_format(rule, layer, path, policy.path)
    plan.append((path, layer, fmt, rule.act, f'rule {i} {rule.pattern!r}'))
  report_unused_rules(unused, [p for p, *_ in plan], mode=mode, strict=policy.strict,
                      fix='Fix the patterns or pass strict=False.')
  return plan, unused


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_jit(w, fmt, method):
  return quantize(w, fmt, method)


def _quantize_weight(w, fmt: QFormat, cal, path: str):
  """`quantize`, jitted (one compile per shape and format, instead of op by op)."""
  check_finite(w, f'quantize_model: the weight of layer {path!r}',
               'fix the checkpoint or exempt the layer.')
  if isinstance(cal, tuple):  # a precomputed range: arrays, not a static method name
    return quantize(w, fmt, cal)
  q = _quantize_jit(w, fmt, cal)
  # Under jit the scales are not checked: check them here, once per layer.
  check_scales(q.scale, fmt, f'quantize_model: the weight of layer {path!r}')
  return q


def _float_bytes(layer: Einsum) -> int:
  w = layer.w.get_value()
  return int(w.size) * w.dtype.itemsize


def quantize_model(model: nnx.Module, policy: QuantPolicy,
                   calibration: Union[None, str, Mapping[str, RangeArg]] = None,
                   layout: Optional[str] = None):
  """A quantized copy of `model`; the float model is left untouched and usable.

  Each matched Einsum's weight becomes a `QWeight` holding a `QArray` (real, packed codes),
  and its description (`EinsumQuant`) gets `act_fmt=rule.act, path=policy.path`: its forward
  becomes `qeinsum(spec, x, qarray, act_fmt=rule.act, path=policy.path)`.
  `nnx.state(qmodel)` holds the QArrays' arrays, so Orbax saves and restores them.

  Args:
    model: a float model (e.g. `Transformer`).
    policy: the rules.
    calibration: how weight ranges are chosen: None (each format's `calibration`), a method
      name for every layer ('absmax', 'mse', ...), or {path: method or precomputed (lo, hi)
      in the grouped view} for some layers.
    layout: how the codes are stored: 'packed' (bit-packed uint8, what the CPU paths read),
      'native' (jnp.int4 / int8 / fp8, what XLA:GPU/TPU convert inside the matmul) or None
      (`qjax.core.layouts.default_layout()`: native on GPU/TPU, packed on CPU). Converted
      here, once.

  Returns:
    (qmodel, QuantReport).
  """
  layout = layouts.check_layout(layout, 'quantize_model')
  plan, unused = _plan(model, policy, 'quantize_model')
  if isinstance(calibration, Mapping):
    unknown = set(calibration) - {p for p, *_ in plan}
    if unknown:
      raise ValueError(f'quantize_model: calibration names unknown layers {sorted(unknown)}; '
                       f'layer paths are {[p for p, *_ in plan]}.')
  qmodel = nnx.clone(model)
  qlayers = dict(einsum_layers(qmodel))
  reports = []
  for path, layer, fmt, act, reason in plan:
    before = _float_bytes(layer)
    if fmt is None:
      reports.append(LayerReport(path, 'float', 'float', reason, layer.weight_shape, before,
                                 before))
      continue
    cal = calibration.get(path) if isinstance(calibration, Mapping) else calibration
    q = layouts.to_layout(_quantize_weight(layer.w.get_value(), fmt, cal, path), layout)
    target = qlayers[path]
    target.w = QWeight(q, logical_axes=layer.axes, qformat=fmt)
    # Training-only fields go with the float weight; a PACT clip or input scale stays.
    target.set_quant(target.quant.replace(act_fmt=act, path=policy.path, fake_fmt=None,
                                          learn_scale=False, fake_act_fmt=None))
    reports.append(LayerReport(path, fmt.name, act.name if act else 'float', reason,
                               layer.weight_shape, before, nbytes(q)))
  return qmodel, QuantReport(tuple(reports), unused, 'quantize')


def relayout_model(model: nnx.Module, layout: Optional[str] = None) -> nnx.Module:
  """`model` with every quantized Einsum weight stored in `layout` (in place; returned).

  For a model built another way than `quantize_model(layout=...)`: a PTQ method's output, or
  a checkpoint loaded in the packed layout and served on a GPU/TPU. None: the backend's
  default (`qjax.core.layouts.default_layout`).
  """
  layout = layouts.check_layout(layout, 'relayout_model')
  for _, layer in einsum_layers(model):
    if layer.quantized:
      layer.w.set_value(layouts.to_layout(layer.w.get_value(), layout))
  return model


def apply_fake_quant(model: nnx.Module, policy: QuantPolicy):
  """A copy of `model` whose matched Einsums fake-quantize their float weights (QAT).

  Each matched Einsum's description gets `fake_fmt` (the resolved format): the forward pass
  sees exactly the weights `quantize_model` would store (straight-through gradients via
  `qjax.core.fake_quant`); weights stay `nnx.Param` and train. Activation formats are
  recorded in the report but not simulated here.

  Returns:
    (model copy, QuantReport with bytes_after = bytes_before: the device still holds floats).
  """
  plan, unused = _plan(model, policy, 'apply_fake_quant')
  fmodel = nnx.clone(model)
  flayers = dict(einsum_layers(fmodel))
  reports = []
  for path, layer, fmt, act, reason in plan:
    b = _float_bytes(layer)
    flayers[path].set_quant(flayers[path].quant.replace(fake_fmt=fmt, learn_scale=False,
                                                        fake_act_fmt=None))
    reports.append(LayerReport(path, fmt.name if fmt else 'float',
                               act.name if act else 'float', reason, layer.weight_shape, b, b))
  return fmodel, QuantReport(tuple(reports), unused, 'fake_quant')
