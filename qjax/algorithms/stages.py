"""Stages of a Transformer block, and folding AWQ / SmoothQuant scales into their producers.

A *stage* is the set of Einsums reading one array (q/k/v; o_proj; gate/up; down_proj; the
untied LM head). Per-input-channel scales s of a stage are migrated as `x W = (x / s)(s W)`:
the stage's weight rows are multiplied by s and 1/s goes into the producer of x: the RMSNorm
weight, else the previous linear layer's output channels (v_proj for o_proj, with s shared
by the query heads of one kv head; up_proj for down_proj; for a quantized producer its
per-channel QArray scales are divided), else an explicit multiply (the consumer's
description gets `input_scale`, its `in_scale` variable holds s).
`apply_method` drives this per stage; `fold_scales` does it to a float model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qjax.algorithms.calibrate import EinsumView
from qjax.core import QArray
from qjax.nn import Transformer
from qjax.nn.layers import Einsum


@dataclasses.dataclass(frozen=True)
class Stage:
  """Einsums reading one array, and where a per-input-channel scale of it can be folded."""
  layers: tuple[str, ...]  # paths under the block
  fold: str  # 'norm' or 'linear'
  into: str  # the RMSNorm / previous Einsum under the block
  heads_tie: bool = False  # rows are (N, H) and the producer's outputs (K, H)
  into_bias: str = ''  # the producer's output bias, if the model has one (Qwen2's v_bias)


BLOCK_STAGES = (Stage(('attn/q_proj', 'attn/k_proj', 'attn/v_proj'), 'norm', 'pre_attn_norm'),
                Stage(('attn/o_proj',), 'linear', 'attn/v_proj', heads_tie=True,
                      into_bias='attn/v_bias'),
                Stage(('mlp/gate_proj', 'mlp/up_proj'), 'norm', 'pre_mlp_norm'),
                Stage(('mlp/down_proj',), 'linear', 'mlp/up_proj'))
HEAD_STAGE = Stage(('lm_head',), 'norm', 'final_norm')


# ---- model paths ----------------------------------------------------------------------------
def module_at(root, path: str):
  """The module at a '/'-joined path ('layers/3/attn/o_proj'; digits index lists)."""
  node = root
  for part in filter(None, path.split('/')):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node


@dataclasses.dataclass
class WalkState:
  """What `apply_method`'s walk carries: both models, formats, options, and the record."""
  model: Transformer
  qmodel: Transformer
  fmts: dict  # path -> (QFormat, act QFormat or None), from quantize_model
  opts: dict
  layers: dict = dataclasses.field(default_factory=dict)  # per-layer record entries
  stages: list = dataclasses.field(default_factory=list)  # per-stage record entries
  structure: dict = dataclasses.field(default_factory=dict)  # path -> how it was changed
  notes: list = dataclasses.field(default_factory=list)

  def float_weight(self, path: str):
    """The layer's current float weight: original if quantized by the policy, else qmodel's."""
    return module_at(self.model if path in self.fmts else self.qmodel, path).w.get_value()


# ---- folding 1/s into the producer of a stage's input -------------------------------------
def plan_fold(ctx: WalkState, stage: Stage, prefix: str):
  """('norm' | 'linear' | 'explicit', producer path or None, tie ids or None)."""
  into = prefix + stage.into
  if stage.fold == 'norm':
    return 'norm', into, None
  prev = module_at(ctx.qmodel, into)
  w = prev.w.get_value()
  per_channel = not isinstance(w, QArray) or all(
      t == 1 for a, t in enumerate(w.tile_shape) if a not in prev.contracted_axes)
  # LLM.int8()'s float weight copy would escape the division, and a producer with an input
  # scale of its own is left as it is: fold explicitly instead.
  plain = not prev.quant.input_scale and prev.quant.outlier_threshold is None
  if not ctx.opts['fold_linear'] or not per_channel or not plain:
    return 'explicit', None, None
  if not stage.heads_tie:
    return 'linear', into, None
  cfg = ctx.model.config
  n, h = np.meshgrid(np.arange(cfg.num_heads), np.arange(cfg.head_dim), indexing='ij')
  return 'linear', into, ((n // cfg.group_size) * cfg.head_dim + h).reshape(-1)


def _divide_outputs(layer: Einsum, s_out) -> None:
  """Divide the layer's output channels by s (its float weight or its QArray scales)."""
  view, w = EinsumView.of(layer), layer.w.get_value()
  s = jnp.reshape(s_out, view.col_shape())
  if isinstance(w, QArray):
    layer.w.set_value(w.scaled_by(s, divide=True))
  else:
    layer.w.set_value((w / s).astype(w.dtype))


def migrate(ctx: WalkState, stage: Stage, prefix: str, todo: list, s_nat, plan) -> str:
  """Scale the float consumers' rows by s and fold 1/s into the producer; describe it."""
  kind, into, tie = plan
  for p in (prefix + q for q in stage.layers):
    if p not in todo:  # a consumer kept float by the policy: keep its product exact
      layer = module_at(ctx.qmodel, p)
      w = layer.w.get_value()
      layer.w.set_value((w * s_nat.reshape(EinsumView.of(layer).row_shape())).astype(w.dtype))
  if kind == 'norm':
    norm = module_at(ctx.qmodel, into)
    v = norm.scale.get_value()
    v32 = v.astype(jnp.float32)
    norm.scale.set_value(((1.0 + v32) / s_nat - 1.0 if norm.plus_one else v32 / s_nat)
                         .astype(v.dtype))
    return f'norm weight {into}'
  if kind == 'linear':
    prev = module_at(ctx.qmodel, into)
    s_out = s_nat if tie is None else jax.ops.segment_max(s_nat, jnp.asarray(tie),
                                                          num_segments=int(tie.max()) + 1)
    _divide_outputs(prev, s_out)
    bias = getattr(module_at(ctx.qmodel, prefix + stage.into_bias.rpartition('/')[0]),
                   stage.into_bias.rpartition('/')[2], None) if stage.into_bias else None
    if bias is not None:  # y = x W + b: both halves of the producer's output carry 1/s
      b = bias.get_value()
      bias.set_value((b / jnp.reshape(s_out, b.shape)).astype(b.dtype))
    how = 'QArray per-channel scales' if prev.quantized else 'float weight'
    shared = '' if tie is None else f', s shared by the {ctx.model.config.group_size} ' \
                                    'query head(s) of each kv head'
    return f'previous linear {into} (output channels, {how}{shared})'
  (p,) = (prefix + q for q in stage.layers)
  layer = module_at(ctx.qmodel, p)
  layer.set_quant(layer.quant.replace(input_scale=True), in_scale=s_nat.reshape(
      layer.contracted_shape))
  ctx.structure[p] = 'explicit_scale'
  return f'explicit multiply x / s in {p} (EinsumQuant.input_scale)'


def stage_keys(model: Transformer) -> dict[str, tuple[Stage, str]]:
  """{path of a stage's first Einsum: (stage, block prefix)} for every stage of `model`."""
  keys = {f'layers/{i}/{st.layers[0]}': (st, f'layers/{i}/')
          for i in range(model.config.num_layers) for st in BLOCK_STAGES}
  if model.lm_head is not None:
    keys['lm_head'] = (HEAD_STAGE, '')
  return keys


def fold_scales(model: Transformer, scales: dict, fold_linear: bool = True) -> dict[str, str]:
  """Migrate per-input-channel scales into a float model, in place, as AWQ / SmoothQuant do.

  For each stage (keyed by its first Einsum, see `stage_keys`): the rows of every Einsum
  reading the stage's input are multiplied by s, and 1/s goes into the producer of that input
  (`apply_method` does the same, with the stage's weights quantized). In exact arithmetic
  the model's function is unchanged.

  Args:
    model: a float Transformer (modified in place).
    scales: {stage key: s over the contracted elements, natural order}; for o_proj folded
      into v_proj, s must be equal across the query heads of one kv head.
    fold_linear: fold o_proj / down_proj scales into v_proj / up_proj (else explicit).

  Returns:
    {stage key: where 1/s went}.
  """
  keys = stage_keys(model)
  ctx = WalkState(model, model, {}, {'fold_linear': fold_linear})
  done = {}
  for key, s in scales.items():
    if key not in keys:
      raise ValueError(f'fold_scales: {key!r} is not a stage; stages are {sorted(keys)}.')
    stage, prefix = keys[key]
    plan = plan_fold(ctx, stage, prefix)
    s = jnp.asarray(s, jnp.float32).reshape(-1)
    if plan[2] is not None and not np.allclose(
        np.asarray(s), np.asarray(jax.ops.segment_max(s, plan[2], int(plan[2].max()) + 1))[
            plan[2]]):
      raise ValueError(f'fold_scales: s of {key!r} differs between query heads sharing a kv '
                       'head, so v_proj cannot absorb it; tie it or pass fold_linear=False.')
    done[key] = migrate(ctx, stage, prefix, [], s, plan)
  return done
