"""Compile a layout's prefill or decode step for a TPU slice and read what the compiler says.

    step = sharding.compile_step('palm_540b', '2d_ws+mq_batch', 'v4:4x4x4', phase='decode',
                                 batch=64, context=2112, weights='int8', kv='int8')
    step.peak_bytes, step.fits, step.comm_bytes, step.flops, step.bytes_accessed

The model is built as shapes only (`nnx.eval_shape`, quantized as the formats say), its state
and KV cache are given the layout's shardings over a compile-only mesh of the slice
(`_slices`), and the step (embed, every block, the last position's logits, the cache
advanced) is lowered under `LayoutHooks` and compiled by the TPU compiler. Nothing runs and
no weight exists: every figure is the compiler's prediction for one chip.

A deep model takes long to compile, so `depths=(1, 2)` compiles one and two layers and
extrapolates linearly to the model's depth, f(L) = f(1) + (L - 1) (f(2) - f(1)), the
arguments, outputs, collectives, flops and bytes, which grow by one layer's worth per layer;
the temporaries are the deeper compile's (one layer's are reused by the next). `depths=None`
compiles the whole depth.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from qjax import costmodel
from qjax import target as qjax_target
from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, init_cache,
                     kvcache, quantize_model, shard_hooks, with_kv_format)
from qjax.sharding import _hlo
from qjax.aot import _hbm
from qjax.aot import _slices
from qjax.sharding import _specs
from qjax.sharding._hooks import LayoutHooks
from qjax.sharding._rules import layout_rules

WEIGHT_FORMATS = ('bf16', 'int8')
KV_FORMATS = ('bf16', 'int8')
# qjax kind names -> costmodel's.
_KIND = {'all-gather': 'all_gather', 'reduce-scatter': 'reduce_scatter',
         'all-reduce': 'all_reduce', 'all-to-all': 'all_to_all'}


def model_config(model, n_layers: Optional[int] = None, max_len: int = 2048,
                 dtype: str = 'bfloat16') -> TransformerConfig:
  """The qjax `TransformerConfig` of a costmodel shape (a preset name or `ModelShape`).

  qjax's Transformer is a serial pre-norm block with a gated MLP, so a parallel-block shape
  (PaLM) is built serial: compare it with the shape's serial variant
  (`serial_shape`).

  Raises:
    ValueError: a shape without a gated MLP (qjax's MLP is gated), or a totals-only shape.
  """
  shape = costmodel.model_from_spec(model)
  if isinstance(shape, costmodel.TotalsShape) or not shape.glu:
    raise ValueError(f'model {shape.name}: compiling needs a gated-MLP shape (layers, widths, '
                     'heads); a totals-only or non-gated shape has no qjax Transformer.')
  return TransformerConfig(
      vocab_size=shape.vocab, d_model=shape.d_model, num_layers=n_layers or shape.n_layers,
      num_heads=shape.n_heads, num_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
      d_ff=shape.d_ff, max_len=max_len, tie_embeddings=shape.tied_embeddings, dtype=dtype,
      param_dtype=dtype, attention_impl='auto')


def serial_shape(model) -> costmodel.ModelShape:
  """The shape as qjax's Transformer runs it: a serial block (module docstring)."""
  shape = costmodel.model_from_spec(model)
  return dataclasses.replace(shape, parallel_block=False)


def compiled_shape(model, mesh, layout, batch: int) -> costmodel.ModelShape:
  """The shape compiled for `layout` on `mesh`: serial (`serial_shape`), query heads padded
  where they do not divide the chips they are split over (Pope et al. padded PaLM 540B's 48
  to 64): the layout's head axes (`costmodel.shard_plan`) and, for layouts that store
  weights E_x F_zy, the z*y the head dim of every projection is stored over; the vocabulary
  padded to a multiple of the chips, which the logits are split over (PaLM's 256,128 on 256
  chips: 256,256).

  Raises:
    ValueError: the layout cannot shard the model on the mesh (the reason named), e.g. kv
      heads that do not divide their group.
  """
  mesh, lay = costmodel.as_mesh(mesh), costmodel.as_layout(layout)
  lay = costmodel.Layout(lay.ffn, lay.attn, pad_heads=True)
  shape = costmodel.shard_plan(serial_shape(model), mesh, lay, batch).model
  if lay.ffn != '1d_ws':
    zy = mesh.y * mesh.z
    if lay.attn == 'multihead' and shape.n_kv_heads % zy:
      raise ValueError(f'Layout {lay.ffn}+{lay.attn} stores kv heads over z*y={zy}, but '
                       f'{shape.name} has {shape.n_kv_heads}; use a mesh whose z*y divides '
                       f'{shape.n_kv_heads}, or a multiquery attention layout.')
    if shape.n_heads % zy:
      shape = shape.padded(zy)
  if shape.vocab % mesh.n:  # the logits are split over every chip
    shape = dataclasses.replace(shape, vocab=-(-shape.vocab // mesh.n) * mesh.n)
  return shape


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """What the TPU compiler predicts for one step of one layout on one slice, per chip.

  Byte and flop figures are per chip, at the model's full depth (extrapolated from
  `compiled_layers` when that is not the full depth).

  Attributes:
    model, slice, chip, mesh, layout, phase: what was compiled ('palm_540b', 'v4:4x4x4',
      'tpu_v4', '4x4x4', '2d_ws+mq_batch', 'decode').
    batch, tokens, context: sequences, new tokens per sequence, cache slots.
    weights, kv: the formats.
    n_layers: the model's depth; compiled_layers: the depths compiled.
    argument_bytes, output_bytes, alias_bytes, temp_bytes: `memory_analysis()`.
    weight_bytes, kv_bytes: the state's and the cache's shards (from their shardings).
    comm_bytes: {kind: bytes one chip sends per step} from the compiled HLO (`_hlo`).
    comm_s: those collectives' time on the costmodel chip's interconnect (all links).
    flops, bytes_accessed: XLA's cost analysis.
    hbm_traffic: the bytes one chip reads from and writes to HBM (`qjax.aot.hbm_traffic`:
      each transfer once, where bytes_accessed counts a VMEM prefetch several times).
    hbm_bytes: one chip's HBM.
    compile_s: seconds spent compiling here (all depths).
    collectives: the collectives of the deepest compile ((kind, axes, D, K, count) tuples).
    temp_by_depth: the temp of each compiled depth.
  """

  model: str
  slice: str
  chip: str
  mesh: str
  layout: str
  phase: str
  batch: int
  tokens: int
  context: int
  weights: str
  kv: str
  n_layers: int
  compiled_layers: tuple
  argument_bytes: float
  output_bytes: float
  alias_bytes: float
  temp_bytes: float
  weight_bytes: float
  kv_bytes: float
  comm_bytes: dict
  comm_s: float
  flops: float
  bytes_accessed: float
  hbm_traffic: float
  hbm_bytes: float
  compile_s: float
  collectives: tuple = ()
  temp_by_depth: tuple = ()

  @property
  def peak_bytes(self) -> float:
    """What one chip holds while the step runs: arguments + outputs - aliased + temp."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def activation_bytes(self) -> float:
    """Beyond the weights and the cache: the peak less the state and cache shards."""
    return self.peak_bytes - self.weight_bytes - self.kv_bytes

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def total_comm_bytes(self) -> float:
    return sum(self.comm_bytes.values())

  def roofline_s(self, compute_bits: float = 16) -> float:
    """The compiler's step time: max(HBM traffic / HBM bandwidth, flops / peak) +
    collectives, the single-chip reports' roofline (`qjax.aot.roofline`) on a slice."""
    chip = costmodel.get_chip(self.chip)
    return max(self.hbm_traffic / chip.hbm_bw,
               self.flops / chip.peak_flops(compute_bits)) + self.comm_s


def _policy(weights: str) -> Optional[QuantPolicy]:
  if weights not in WEIGHT_FORMATS:
    raise ValueError(f'weights={weights!r}: use one of {WEIGHT_FORMATS} (int8: per-channel '
                     'symmetric codes, the paper\'s serving format).')
  return None if weights == 'bf16' else QuantPolicy((QuantRule('.*', int_format(8)),))


def _kv_fmt(kv: str) -> Optional[str]:
  if kv not in KV_FORMATS:
    raise ValueError(f'kv={kv!r}: use one of {KV_FORMATS} (int8: a scale per token and head).')
  return None if kv == 'bf16' else 'int8'


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _step_fn(graphdef, hooks):
  def step(state, tokens_BT, cache):
    model = nnx.merge(graphdef, state)
    t = tokens_BT.shape[1]
    with shard_hooks.use(hooks):
      positions_BT = kvcache.next_positions(cache, t)
      # XLA's gather for the rows of the split table: the TPU row-gather kernel is a Mosaic
      # call, which GSPMD cannot partition ("wrap the call in a shard_map").
      here = qjax_target.current()
      with qjax_target.use(dataclasses.replace(here, platform='cpu', device_kind='cpu')):
        x_BTD = model.embed_tokens(tokens_BT)
      x_BTD, cache = model.run_layers(x_BTD, positions_BT, cache)
      logits_BV = model.logits(x_BTD[:, -1:])[:, 0]  # serving reads the last position only
    return logits_BV, kvcache.advance(cache, t)
  return step


def _compile_once(cfg, layout, mesh, *, phase, batch, tokens, context, weights, kv,
                  compiler_options=None):
  """One compile at `cfg`'s depth: a dict of raw per-chip figures."""
  rules = layout_rules(layout)
  policy, kv_fmt = _policy(weights), _kv_fmt(kv)

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if policy is not None:
      model = quantize_model(model, policy, layout='native')[0]
    return model if kv_fmt is None else with_kv_format(model, kv_fmt)

  chips = dataclasses.replace(qjax_target.of_devices(list(mesh.devices.flat), 'a TPU slice'),
                              compile_only=True)
  with qjax_target.use(chips):  # the TPU's storage and paths
    graphdef, state = nnx.split(nnx.eval_shape(build))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context, fmt=kv_fmt))
  with qjax_target.use(chips):
    state_s = _specs.state_shardings(state, rules, mesh)
    cache_s = _specs.cache_shardings(cache, rules, mesh)
    tokens_s = jax.ShapeDtypeStruct((batch, tokens), jnp.int32,
                                    sharding=NamedSharding(mesh, PartitionSpec()))
    step = _step_fn(graphdef, LayoutHooks(rules, mesh))
    t0 = time.perf_counter()
    with jax.default_device(mesh.devices.flat[0]):
      compiled = jax.jit(step, donate_argnums=(2,)).lower(
          _abstract(state, state_s), tokens_s, _abstract(cache, cache_s)).compile(compiler_options)
    seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  text = compiled.as_text()
  found = _hlo.collectives(text, mesh)
  return {'argument_bytes': mem.argument_size_in_bytes, 'output_bytes': mem.output_size_in_bytes,
          'alias_bytes': mem.alias_size_in_bytes, 'temp_bytes': mem.temp_size_in_bytes,
          'weight_bytes': _specs.bytes_per_device(state, state_s),
          'kv_bytes': _specs.bytes_per_device(cache, cache_s),
          'flops': float(cost.get('flops', 0.0)),
          'bytes_accessed': float(cost.get('bytes accessed', 0.0)),
          'hbm_traffic': float(_hbm.hbm_traffic(text)['hbm']),
          'comm_bytes': _hlo.sent_bytes(found), 'found': found, 'compile_s': seconds}


def _comm_seconds(found, chip, mesh) -> float:
  """The compiled collectives' time under the costmodel's 'all_links' interconnect."""
  cm = costmodel.as_mesh(tuple(mesh.shape[a] for a in mesh.axis_names))
  total = 0.0
  for c in found:
    if c.kind == 'collective-permute':
      total += c.sent_bytes / chip.ici_bw
    elif c.axes:
      total += c.count * costmodel.collective_seconds(
          costmodel.Collective(_KIND[c.kind], c.nbytes, c.axes, c.op_name), chip, cm)
  return total


def _extrapolate(a: float, b: float, da: int, db: int, depth: int) -> float:
  return a + (depth - da) * (b - a) / (db - da)


def compile_step(model, layout, slice_name: str, *, phase: str, batch: int, context: int,
                 prompt: Optional[int] = None, mesh='', weights: str = 'int8',
                 kv: str = 'int8', depths: Optional[Sequence[int]] = (1, 2),
                 compiler_options: Optional[dict] = None) -> CompiledStep:
  """Compile one step of `layout` for a slice and return the compiler's per-chip figures.

  Args:
    model: a costmodel shape or preset name ('palm_540b', 'llama3_8b').
    layout: a layout name ('2d_ws+mq_batch').
    slice_name: a TPU slice ('v4:4x4x4', 'v5e:2x4', or 'v5e-8').
    phase: 'prefill' (`prompt` new tokens per sequence into an empty cache) or 'decode'
      (one new token per sequence).
    batch: sequences.
    context: cache slots per sequence.
    prompt: prefill tokens per sequence (default `context`).
    mesh: the logical mesh over the slice ('' = the torus; see `_slices.slice_mesh`).
    weights: 'int8' (per-channel codes) or 'bf16'.
    kv: 'int8' (a scale per token and head) or 'bf16'.
    depths: two depths to compile and extrapolate from, or None for the full depth.
    compiler_options: XLA options for the compile (None: the compiler's defaults).

  Returns:
    A `CompiledStep`.

  Raises:
    ValueError: a bad phase, format or slice, or a layout the mesh cannot shard (the
      layout's own error, naming the dimension and the fix).
  """
  if phase not in costmodel.PHASES:
    raise ValueError(f'phase={phase!r}: use one of {costmodel.PHASES}.')
  s = _slices.parse_slice(slice_name)
  jmesh = _slices.slice_mesh(s.name, mesh)
  cm_mesh = costmodel.as_mesh(tuple(jmesh.shape[a] for a in jmesh.axis_names))
  lay = costmodel.as_layout(layout)
  lay = costmodel.Layout(lay.ffn, lay.attn, pad_heads=True)
  shape = compiled_shape(model, cm_mesh, lay, batch)
  tokens = (prompt or context) if phase == 'prefill' else 1
  chip = costmodel.get_chip(s.chip)
  if depths is None or max(depths) >= shape.n_layers:
    depths = (shape.n_layers,)
  elif len(depths) != 2 or depths[0] == depths[1]:
    raise ValueError(f'depths={tuple(depths)!r}: give two depths to extrapolate from (e.g. '
                     f'(1, 2)), or None to compile all {shape.n_layers} layers.')
  runs = [_compile_once(model_config(shape, d, max(context, 1)), layout, jmesh, phase=phase,
                        batch=batch, tokens=tokens, context=context, weights=weights, kv=kv,
                        compiler_options=compiler_options)
          for d in depths]
  last = runs[-1]
  if len(runs) == 1:
    fig = {k: v for k, v in last.items() if k not in ('found', 'compile_s')}
    comm_s = _comm_seconds(last['found'], chip, jmesh)
  else:
    (a, b), (da, db) = runs[:2], depths[:2]
    fig = {k: _extrapolate(a[k], b[k], da, db, shape.n_layers) for k in a
           if k not in ('found', 'compile_s', 'comm_bytes', 'temp_bytes')}
    # One step's temporaries do not grow with depth (layers run one after another and
    # reuse them), but a shallow program lets the scheduler prefetch every layer's gathered
    # weights at once: the deeper compile's temp, not an extrapolation.
    fig['temp_bytes'] = b['temp_bytes']
    kinds = set(a['comm_bytes']) | set(b['comm_bytes'])
    fig['comm_bytes'] = {k: _extrapolate(a['comm_bytes'].get(k, 0.0),
                                         b['comm_bytes'].get(k, 0.0), da, db, shape.n_layers)
                         for k in sorted(kinds)}
    comm_s = _extrapolate(_comm_seconds(a['found'], chip, jmesh),
                          _comm_seconds(b['found'], chip, jmesh), da, db, shape.n_layers)
  return CompiledStep(
      model=shape.name, slice=s.name, chip=s.chip,
      mesh=str(cm_mesh), layout=f'{lay.ffn}+{lay.attn}',
      phase=phase, batch=batch, tokens=tokens, context=context, weights=weights, kv=kv,
      n_layers=shape.n_layers, compiled_layers=tuple(depths), comm_s=comm_s,
      hbm_bytes=chip.hbm_bytes, compile_s=sum(r['compile_s'] for r in runs),
      collectives=tuple((c.kind, c.axes, c.nbytes, c.group_size, c.count)
                        for c in last['found']),
      temp_by_depth=tuple(r['temp_bytes'] for r in runs), **fig)
