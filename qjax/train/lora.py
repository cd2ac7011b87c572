"""LoRA / QLoRA adapters as a policy: regex rules choose the projections that get an adapter.

An `AdapterPolicy` is an ordered tuple of `AdapterRule`s matched like `QuantPolicy`'s
(`re.fullmatch` over Einsum paths, 'layers/3/attn/q_proj', first match wins, a report of
the rules that matched nothing). `apply_adapters` wraps each matched Einsum in a
`LoRAEinsum` holding the base layer (`.base`) and the adapter A, B (`nnx.LoRAParam`, B = 0
at init, so the adapted model computes exactly the base model); every other *quantized*
Einsum is wrapped too, without an adapter, so that its product has the frozen-weight
gradient. The base may be float, quantized (any qjax format, packed int4 included: the
forward is the layer's own `qeinsum` path, the backward `lora_core.frozen_qeinsum`'s
dequantize-inside-the-backward, so no float copy of a quantized weight persists) or
fake-quantized (QAT formats on float weights).

Only adapters train: `make_lora_optimizer` builds `nnx.Optimizer(..., wrt=nnx.LoRAParam)`
and `lora_step` differentiates `nnx.DiffState(0, nnx.LoRAParam)`; base weights (nnx.Param,
QWeight) get no gradient and no optimizer state. `remat=True` recomputes each block in the
backward (`nnx.remat` per block, walking the model's public phases).

    policy = AdapterPolicy((AdapterRule(r'layers/\\d+/attn/(q|v)_proj', rank=8, alpha=16),))
    model, report = apply_adapters(qmodel, policy, rngs=nnx.Rngs(0))
    opt = make_lora_optimizer(model, make_optimizer(1e-3, steps, warmup))
    for batch_BT1 in batches:
      loss = lora_step(model, opt, batch_BT1)
    merged = merge_adapters(model)     # a float model: base (dequantized) + adapters
    # re-quantize it with qjax.algorithms.apply_method, or save the adapters (lora_io)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qjax.core import QArray, dequantize
from qjax.core.learned import pact_clip
from qjax.nn import einsum_layers, shard_hooks
from qjax.nn.layers import Einsum, Embed, notify_taps, parse_spec
from qjax.nn.policy import match_rules, report_unused_rules
from qjax.train import lora_core

INITS = ('kaiming', 'gaussian')


@dataclasses.dataclass(frozen=True)
class AdapterRule:
  """Give the Einsums whose path fully matches `pattern` a LoRA adapter.

  Attributes:
    pattern: regex over Einsum paths (re.fullmatch), e.g. r'layers/\\d+/attn/(q|v)_proj'.
    rank: r, the adapter's inner dimension (>= 1, at most min(fan-in, fan-out)).
    alpha: the adapter's output is scaled by alpha / rank.
    dropout: dropout rate on the adapter's input (training only; 0 = none).
    init: how A starts ('kaiming': uniform +-1/sqrt(fan-in), as PEFT; 'gaussian': normal with
      std 1/rank); B is always 0.
    exempt: no adapter on matching layers (and later rules do not match them).
  """

  pattern: str
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  init: str = 'kaiming'
  exempt: bool = False

  def __post_init__(self):
    try:
      re.compile(self.pattern)
    except re.error as e:
      raise ValueError(f'AdapterRule: pattern {self.pattern!r} is not a valid regex ({e}).'
                       ) from None
    if self.exempt:
      return
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f'AdapterRule({self.pattern!r}): rank={self.rank!r} must be an int >= 1 '
                       '(e.g. 8).')
    if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f'AdapterRule({self.pattern!r}): alpha={self.alpha!r} must be a finite '
                       'number > 0 (e.g. 2 * rank).')
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'AdapterRule({self.pattern!r}): dropout={self.dropout!r} must lie in '
                       '[0, 1).')
    if self.init not in INITS:
      raise ValueError(f'AdapterRule({self.pattern!r}): init={self.init!r} is unknown; use one '
                       f'of {INITS}.')

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def matches(self, path: str) -> bool:
    return re.fullmatch(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class AdapterPolicy:
  """Ordered adapter rules (first match wins).

  Attributes:
    rules: the rules.
    strict: raise (instead of warn) when a rule matches no layer (default: raise).
  """

  rules: tuple[AdapterRule, ...]
  strict: bool = True

  def __post_init__(self):
    object.__setattr__(self, 'rules', tuple(self.rules))
    if not self.rules:
      raise ValueError('AdapterPolicy: no rules; give at least one AdapterRule.')

  def match(self, path: str) -> tuple[Optional[int], Optional[AdapterRule]]:
    """(index, rule) of the first rule matching `path`, or (None, None)."""
    return match_rules(self.rules, [path])[0][0]

  def to_dict(self) -> dict:
    return {'rules': [dataclasses.asdict(r) for r in self.rules], 'strict': self.strict}

  @classmethod
  def from_dict(cls, d: dict) -> 'AdapterPolicy':
    return cls(tuple(AdapterRule(**r) for r in d['rules']), strict=d.get('strict', True))


@dataclasses.dataclass(frozen=True)
class AdapterReport:
  """What `apply_adapters` did: {path: (rank, alpha) or None (frozen only)}, unused rules."""

  adapted: dict
  frozen: tuple[str, ...]
  unused_rules: tuple[AdapterRule, ...]
  trainable_params: int

  def __str__(self) -> str:
    lines = [f'{p}: rank {r} alpha {a:g}' for p, (r, a) in self.adapted.items()]
    lines.append(f'{len(self.adapted)} adapters, {self.trainable_params:,} trainable params; '
                 f'{len(self.frozen)} other quantized layers frozen')
    return '\n'.join(lines)


class LoRAEinsum(nnx.Module):
  """A frozen base `Einsum` plus an optional adapter: base(x) + (alpha / r) * (x A) B.

  Attributes:
    base: the wrapped Einsum (float, quantized or fake-quantized), never trained.
    lora_a, lora_b: `nnx.LoRAParam`s A[C..., r], B[r, K...] (`lora_core`), or None (a
      quantized layer wrapped only for its frozen-weight gradient).
    rank, scale: r and alpha / r (0 and 0.0 without an adapter).
    dropout: `nnx.Dropout` on the adapter's input, or None.
  """

  def __init__(self, base: Einsum, rule: Optional[AdapterRule], path: str, *,
               rngs: nnx.Rngs):
    w = base.w.get_value()
    quant = base.quant
    if isinstance(w, QArray) and (quant.act_fmt is not None or
                                  quant.outlier_threshold is not None):
      act = 'LLM.int8()' if quant.outlier_threshold is not None else quant.act_fmt.name
      raise ValueError(f'apply_adapters: layer {path!r} quantizes its activations ({act}), '
                       'whose rounding passes no gradient to the layers below; adapters need '
                       'a weight-only (or float) base: quantize with quant.act=none.')
    self.base = base
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.dropout = nnx.data(None)
    self.rank, self.scale = 0, 0.0
    if rule is None:
      return
    if isinstance(base, Embed):
      raise ValueError(f'apply_adapters: rule {rule.pattern!r} matches the embedding {path!r} '
                       '(the input lookup and the tied head); adapters go on projections: '
                       'exempt it (AdapterRule("embed", exempt=True)) or narrow the pattern.')
    shape = tuple(w.shape)
    try:
      top = lora_core.max_rank(base.spec, shape)
    except ValueError as e:
      raise ValueError(f'apply_adapters: layer {path!r}: {e}') from None
    if rule.rank > top:
      raise ValueError(f'apply_adapters: rank={rule.rank} of rule {rule.pattern!r} is larger '
                       f'than layer {path!r} allows: its weight {shape} (spec {base.spec!r}) '
                       f'has min(fan-in, fan-out) = {top}; use rank <= {top}.')
    a_shape, b_shape = lora_core.adapter_shapes(base.spec, shape, rule.rank)
    fan_in = math.prod(a_shape[:-1])
    key = rngs.params()
    if rule.init == 'kaiming':
      bound = fan_in ** -0.5
      a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    else:
      a = jax.random.normal(key, a_shape, jnp.float32) / rule.rank
    self.lora_a = nnx.LoRAParam(a)
    self.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32))
    self.rank, self.scale = rule.rank, float(rule.scale)
    if rule.dropout:
      self.dropout = nnx.Dropout(rule.dropout, rngs=rngs)

  # The base layer's interface, for callers that read it (specs, reports, the tied head).
  @property
  def spec(self) -> str:
    return self.base.spec

  @property
  def quantized(self) -> bool:
    return self.base.quantized

  def lookup(self, tokens_BT: jax.Array, dtype) -> jax.Array:
    """The tied embedding's rows (a wrapped quantized `Embed`)."""
    return self.base.lookup(tokens_BT, dtype)

  def _product(self, x: jax.Array, w, out_dtype=None) -> jax.Array:
    base = self.base
    if not isinstance(w, QArray):
      return base.apply(x, w, out_dtype)
    if base.quant.input_scale:
      xs, cl = parse_spec(base.spec)[0], base.contracted_letters
      s = jnp.transpose(base.in_scale[...], [cl.index(c) for c in xs if c in cl])
      x = x / s.reshape([x.shape[i] if c in cl else 1 for i, c in enumerate(xs)]).astype(x.dtype)
    return lora_core.frozen_qeinsum(base.spec, x, w, path=base.quant.path, out_dtype=out_dtype)

  def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
    base = self.base
    if base.quant.pact:
      x = pact_clip(x, base.act_clip[...])
    notify_taps(base, x)
    y = shard_hooks.current().einsum(base, x, base.w.get_value(),
                                     functools.partial(self._product, out_dtype=out_dtype))
    if self.lora_a is None:
      return y
    xa = x if self.dropout is None else self.dropout(x)
    return y + lora_core.lora_delta(base.spec, xa, self.lora_a[...], self.lora_b[...],
                                    self.scale).astype(y.dtype)


def _set_path(model: nnx.Module, path: str, value) -> None:
  *parents, last = path.split('/')
  node = model
  for p in parents:
    node = node[int(p)] if p.isdigit() else getattr(node, p)
  if last.isdigit():
    node[int(last)] = value
  else:
    setattr(node, last, value)


def adapter_layers(model: nnx.Module) -> list[tuple[str, LoRAEinsum]]:
  """(path, LoRAEinsum) for every wrapped layer, paths as the base layer had them."""
  return [('/'.join(str(p) for p in path), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, LoRAEinsum)]


def trainable_params(model: nnx.Module) -> int:
  """Number of adapter parameters (what `make_lora_optimizer` trains)."""
  return sum(int(a.size) for a in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def apply_adapters(model: nnx.Module, policy: AdapterPolicy, *, rngs: nnx.Rngs):
  """Wrap `model`'s Einsums per `policy`, in place (the base arrays are shared, not copied).

  Args:
    model: a Transformer: float, quantized (`quantize_model`, `apply_method`) or
      fake-quantized (`apply_fake_quant`, `prepare_qat`).
    policy: the adapter rules.
    rngs: for A's init and the adapters' dropout.

  Returns:
    (model, AdapterReport).

  Raises:
    ValueError: a rule matching no layer (strict policies; otherwise a warning), a rank
      larger than a layer's min(fan-in, fan-out), an adapter on the embedding, a base layer
      that quantizes activations, a model that already has adapters.
  """
  if adapter_layers(model):
    raise ValueError('apply_adapters: the model already has adapters; merge them '
                     '(merge_adapters) or start from the base model.')
  layers = einsum_layers(model)
  adapted, frozen = {}, []
  matches, unused = match_rules(policy.rules, [p for p, _ in layers])
  plan = []
  for (path, layer), (_, rule) in zip(layers, matches):
    if rule is not None and rule.exempt:
      rule = None
    if rule is None and not layer.quantized:
      continue
    plan.append((path, layer, rule))
  report_unused_rules(unused, [p for p, _ in layers], mode='apply_adapters',
                      strict=policy.strict, shown=4,
                      fix='Fix the patterns, or AdapterPolicy(strict=False).')
  if not any(rule is not None for _, _, rule in plan):
    raise ValueError('apply_adapters: the policy gives no layer an adapter (every match is '
                     'exempt); nothing would train.')
  wrapped = [(path, LoRAEinsum(layer, rule, path, rngs=rngs)) for path, layer, rule in plan]
  for path, wrapper in wrapped:  # only after every wrapper was built: errors leave no trace
    _set_path(model, path, wrapper)
    if wrapper.lora_a is None:
      frozen.append(path)
    else:
      adapted[path] = (wrapper.rank, wrapper.scale * wrapper.rank)
  return model, AdapterReport(adapted, tuple(frozen), unused, trainable_params(model))


def remove_adapters(model: nnx.Module) -> nnx.Module:
  """Unwrap every LoRAEinsum in place (the base layers come back, adapters are dropped)."""
  for path, wrapper in adapter_layers(model):
    _set_path(model, path, wrapper.base)
  return model


def merge_adapters(model: nnx.Module, dtype=None, dequantize_all: bool = True) -> nnx.Module:
  """A float copy of `model` with every adapter merged into its base weight.

  Merged layers get a float weight w + (alpha / r) A B (a quantized base is dequantized
  first, a fake-quantized one is fake-quantized and loses its training fields: the merged
  weight is a new float weight, to re-quantize with any qjax method). This is the export step: the
  float copy is its output, and `model` is left untouched.

  Args:
    model: a model from `apply_adapters`.
    dtype: the merged weights' dtype (default: the model's param dtype).
    dequantize_all: also dequantize the quantized layers without an adapter, so the result
      is a float model that `quantize_model` / `apply_method` accept (else they stay
      quantized).

  Returns:
    The merged model (plain Einsums at the original paths).
  """
  if not adapter_layers(model):
    raise ValueError('merge_adapters: the model has no adapters (apply_adapters first).')
  merged = nnx.clone(model)
  dtype = jnp.dtype(dtype or merged.config.param_dtype)
  for path, wrapper in adapter_layers(merged):
    base = wrapper.base
    w = base.w.get_value()
    if wrapper.lora_a is not None or dequantize_all:
      # The weight the forward sees: dequantized codes, or the fake-quantized float weight.
      wf = dequantize(w, jnp.float32) if isinstance(w, QArray) else base.fake_weight(w)
      if wrapper.lora_a is not None:
        wf = lora_core.merged_weight(base.spec, wf, wrapper.lora_a[...], wrapper.lora_b[...],
                                     wrapper.scale, dtype)
      base.w = nnx.Param(wf.astype(dtype), out_sharding=base.axes, eager_sharding=False)
      base.set_quant(base.quant.replace(act_fmt=None, path='auto', fake_fmt=None,
                                        learn_scale=False, fake_act_fmt=None))
    _set_path(merged, path, base)
  return merged


def make_lora_optimizer(model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Optimizer:
  """An optimizer over the adapters only (`wrt=nnx.LoRAParam`): the base has no state."""
  if not trainable_params(model):
    raise ValueError('make_lora_optimizer: the model has no adapters (apply_adapters first).')
  return nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)


def hidden(model: nnx.Module, tokens_BT: jax.Array, remat: bool = False) -> jax.Array:
  """The last block's output x_BTD (the input of `model.logits`); with `remat`, each block is
  recomputed in the backward (`nnx.remat` per block)."""
  b, t = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  x_BTD = model.embed_tokens(tokens_BT)
  if not remat:
    return model.run_layers(x_BTD, positions_BT)[0]
  block_fn = nnx.remat(lambda block, x, pos: block(x, pos, None)[0])
  for block in model.layers:
    x_BTD = block_fn(block, x_BTD, positions_BT)
  return x_BTD


def forward(model: nnx.Module, tokens_BT: jax.Array, remat: bool = False) -> jax.Array:
  """Full causal logits; with `remat`, each block is recomputed in the backward."""
  if not remat:
    return model(tokens_BT)
  return model.logits(hidden(model, tokens_BT, remat))


def lora_loss(model: nnx.Module, batch_BT1: jax.Array, remat: bool = False) -> jax.Array:
  """Next-token cross entropy of a [B, T + 1] batch."""
  logits_BTV = forward(model, batch_BT1[:, :-1], remat)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch_BT1[:, 1:]).mean()


@functools.partial(nnx.jit, static_argnames=('remat',))
def lora_step(model: nnx.Module, optimizer: nnx.Optimizer, batch_BT1: jax.Array,
              remat: bool = False) -> jax.Array:
  """One optimizer step of the adapters on `lora_loss`; returns the loss."""
  loss, grads = nnx.value_and_grad(lora_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
      model, batch_BT1, remat)
  optimizer.update(model, grads)
  return loss
