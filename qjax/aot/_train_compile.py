"""Compile a QAT training step for a TPU slice: memory per chip, optimizer state included.

    step = sharding.compile_train_step('llama3_8b', 'v5e:2x4', layout='wg_x+multihead',
                                       mesh='2x4x1', batch=8, seq_len=2048)
    step.peak_bytes, step.state_bytes, costmodel.train_memory(...)

The model is built as shapes (float32 master weights, bfloat16 compute, every projection
fake-quantized to int8 per channel as `qjax.train.prepare_qat` does), its parameters and
Adam's two moments are sharded by the layout's rules, and one step (forward, next-token cross
entropy, backward, AdamW update; weights and optimizer state donated) is compiled by the TPU
compiler. A weight-gathered layout is data + model parallel: the batch split over the
gathered axes, weights stored split over every chip and gathered over the data axes for use
(fully sharded data parallel), features split over the other axes. Fake-quantized products
take GSPMD's global semantics (`LayoutHooks`), so the compiler places their collectives.

Depth is extrapolated from one and two layers as in `_compile`, temporaries included: a
training step keeps every layer's activations for the backward pass, so they grow with depth.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from qjax import costmodel
from qjax import target as qjax_target
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, apply_fake_quant, shard_hooks
from qjax.aot import _layout_compile as _compile
from qjax.aot import _slices
from qjax.sharding import _specs
from qjax.sharding._hooks import LayoutHooks
from qjax.sharding._rules import layout_rules


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """What the TPU compiler predicts for one training step, per chip, at the full depth.

  Attributes:
    model, slice, chip, mesh, layout: what was compiled.
    batch, seq_len: sequences per step and tokens per sequence.
    n_layers, compiled_layers: the depth and the depths compiled.
    argument_bytes, output_bytes, alias_bytes, temp_bytes: `memory_analysis()`.
    param_bytes, opt_state_bytes: the weights' and Adam's moments' shards (their shardings).
    hbm_bytes: one chip's HBM.
    compile_s: seconds spent compiling here.
  """

  model: str
  slice: str
  chip: str
  mesh: str
  layout: str
  batch: int
  seq_len: int
  n_layers: int
  compiled_layers: tuple
  argument_bytes: float
  output_bytes: float
  alias_bytes: float
  temp_bytes: float
  param_bytes: float
  opt_state_bytes: float
  hbm_bytes: float
  compile_s: float

  @property
  def peak_bytes(self) -> float:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _compile_once(cfg, layout, mesh, *, batch: int, seq_len: int) -> dict:
  rules = layout_rules(layout)
  policy = QuantPolicy((QuantRule('.*', int_format(8)),))
  tx = optax.adamw(1e-4)
  chips = dataclasses.replace(qjax_target.of_devices(list(mesh.devices.flat), 'a TPU slice'),
                              compile_only=True)
  with qjax_target.use(chips):
    model = nnx.eval_shape(lambda: apply_fake_quant(Transformer(cfg, rngs=nnx.Rngs(0)),
                                                    policy)[0])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  replicated = NamedSharding(mesh, PartitionSpec())
  param_s = _specs.state_shardings(params, rules, mesh)
  rest_s = jax.tree.map(lambda _: replicated, rest)
  opt_state = jax.eval_shape(tx.init, params)
  opt_s = optax.tree_utils.tree_map_params(tx, lambda _, s: s, opt_state, param_s,
                                           transform_non_params=lambda _: replicated)
  batch_axes = rules.axes('batch')
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32,
                                sharding=NamedSharding(mesh, PartitionSpec(batch_axes or None)))
  hooks = LayoutHooks(rules, mesh)

  def step(params, rest, opt_state, tokens_BT1):
    def loss_fn(params):
      m = nnx.merge(graphdef, params, rest)
      with shard_hooks.use(hooks):
        # XLA's gather for the split table (see `_compile`): the TPU row-gather kernel is a
        # Mosaic call GSPMD cannot partition.
        here = qjax_target.current()
        with qjax_target.use(dataclasses.replace(here, platform='cpu', device_kind='cpu')):
          x_BTD = m.embed_tokens(tokens_BT1[:, :-1])
        positions_BT = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32),
                                        (tokens_BT1.shape[0], seq_len))
        x_BTD, _ = m.run_layers(x_BTD, positions_BT)
        logits_BTV = m.logits(x_BTD)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits_BTV, tokens_BT1[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  t0 = time.perf_counter()
  with qjax_target.use(chips), jax.default_device(mesh.devices.flat[0]):
    compiled = jax.jit(step, donate_argnums=(0, 2)).lower(
        _abstract(params, param_s), _abstract(rest, rest_s), _abstract(opt_state, opt_s),
        tokens).compile()
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  return {'argument_bytes': mem.argument_size_in_bytes, 'output_bytes': mem.output_size_in_bytes,
          'alias_bytes': mem.alias_size_in_bytes, 'temp_bytes': mem.temp_size_in_bytes,
          'param_bytes': _specs.bytes_per_device(params, param_s),
          'opt_state_bytes': _specs.bytes_per_device(opt_state, opt_s), 'compile_s': seconds}


def compile_train_step(model, slice_name: str, *, layout: str = 'wg_x+multihead',
                       mesh='', batch: int, seq_len: int,
                       depths: Optional[Sequence[int]] = (1, 2)) -> TrainStep:
  """Compile one QAT training step of `model` for a slice (module docstring).

  Args:
    model: a costmodel shape or preset name ('llama3_8b').
    slice_name: the TPU slice ('v5e:2x4', 'v5p:2x2x1').
    layout: a layout name; a weight-gathered one is data (gathered axes) + model parallel.
    mesh: the logical mesh ('' = the torus).
    batch: sequences per step (split over the layout's batch axes).
    seq_len: tokens per sequence.
    depths: two depths to compile and extrapolate from, or None for the full depth.

  Returns:
    A `TrainStep`.
  """
  shape = costmodel.model_from_spec(model)
  s = _slices.parse_slice(slice_name)
  jmesh = _slices.slice_mesh(s.name, mesh)
  cm_mesh = costmodel.as_mesh(tuple(jmesh.shape[a] for a in jmesh.axis_names))
  if depths is None or max(depths) >= shape.n_layers:
    depths = (shape.n_layers,)
  elif len(depths) != 2 or depths[0] == depths[1]:
    raise ValueError(f'depths={tuple(depths)!r}: give two depths to extrapolate from (e.g. '
                     f'(1, 2)), or None to compile all {shape.n_layers} layers.')
  runs = []
  for d in depths:
    cfg = dataclasses.replace(_compile.model_config(shape, d, seq_len), param_dtype='float32')
    runs.append(_compile_once(cfg, layout, jmesh, batch=batch, seq_len=seq_len))
  if len(runs) == 1:
    fig = {k: v for k, v in runs[0].items() if k != 'compile_s'}
  else:
    (a, b), (da, db) = runs[:2], depths[:2]
    fig = {k: a[k] + (shape.n_layers - da) * (b[k] - a[k]) / (db - da) for k in a
           if k != 'compile_s'}
  return TrainStep(model=shape.name, slice=s.name, chip=s.chip, mesh=str(cm_mesh),
                   layout=str(layout), batch=batch, seq_len=seq_len, n_layers=shape.n_layers,
                   compiled_layers=tuple(depths), hbm_bytes=costmodel.get_chip(s.chip).hbm_bytes,
                   compile_s=sum(r['compile_s'] for r in runs), **fig)
