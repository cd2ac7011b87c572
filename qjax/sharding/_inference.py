"""A Transformer placed on an x*y*z mesh, run under a prefill and a decode layout.

    mesh = sharding.make_mesh('2x2x2')
    sm = sharding.ShardedTransformer(model, mesh, prefill='wg_xyz+mq_batch',
                                     decode='2d_ws+mq_batch')
    cache = sm.init_cache(batch=8, max_len=64, fmt='int8')
    logits_BTV, cache = sm.prefill(prompt_BT, cache)
    logits_BTV, cache = sm.decode(token_B1, cache)

Weights are placed once, as the layouts store them (both layouts must store them alike, as
in Pope et al.; see `same_stored_weights`). The KV cache is resharded between the phases
only when their attention layouts split it differently.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from qjax import costmodel
from qjax.nn import kvcache, shard_hooks
from qjax.sharding import _specs
from qjax.sharding._hooks import LayoutHooks
from qjax.sharding._rules import MESH_AXES, layout_rules, same_stored_weights

PHASES = ('prefill', 'decode')


def default_platform_devices() -> list:
  """Every device of the platform `jax.default_device` names, else of the default backend."""
  default = jax.config.jax_default_device
  if default is None:
    return jax.devices()
  return jax.devices(default if isinstance(default, str) else default.platform)


def make_mesh(shape='2x2x2', devices=None) -> jax.sharding.Mesh:
  """An ('x', 'y', 'z') mesh with Auto axis types (GSPMD propagation between shard_maps).

  Args:
    shape: '2x2x2', (1, 2, 4) or a costmodel Mesh; missing axes are 1.
    devices: the devices to use (default: every device of the default device's platform:
      `jax.default_device(...)` when one is set, e.g. the host CPU's simulated devices on a
      GPU machine; else `jax.devices()`).
  """
  m = costmodel.as_mesh(shape)
  devices = list(default_platform_devices() if devices is None else devices)
  if len(devices) != m.n:
    raise ValueError(f'make_mesh: mesh {m} needs {m.n} devices, {len(devices)} are given. On '
                     'CPU simulate more with XLA_FLAGS=--xla_force_host_platform_device_count='
                     f'{m.n} (set before jax is imported), or pick a mesh of {len(devices)}.')
  return jax.make_mesh((m.x, m.y, m.z), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=devices)


def place(tree, shardings):
  """`jax.device_put`, also for shardings that span other processes' devices.

  A multi-process run gives every process the same host values; each one fills only the
  shards its own devices hold (`jax.make_array_from_callback`).
  """
  def one(x, s):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # global: reshard on device
      return x if x.sharding == s else jax.jit(lambda a: a, out_shardings=s)(x)
    if s.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
  return jax.tree.map(one, tree, shardings)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _step(graphdef, hooks, state, tokens_BT, cache):
  model = nnx.merge(graphdef, state)
  with shard_hooks.use(hooks):
    return model(tokens_BT, cache=cache)


class ShardedTransformer:
  """A `qjax.nn.Transformer` (float or quantized) sharded over a mesh.

  Attributes:
    mesh: the ('x', 'y', 'z') mesh.
    rules: {'prefill': Rules, 'decode': Rules}.
    graphdef, state: the split model; `state` is placed per the stored-weight rules.
    state_shardings: NamedShardings of `state`.
  """

  def __init__(self, model: nnx.Module, mesh, prefill='2d_ws+mq_batch',
               decode: Optional[object] = None):
    self.mesh, self.config = mesh, model.config
    self.rules = {'prefill': layout_rules(prefill),
                  'decode': layout_rules(prefill if decode is None else decode)}
    if not same_stored_weights(self.rules['prefill'], self.rules['decode']):
      raise ValueError(
          f"Prefill layout {self.rules['prefill']} and decode layout "
          f"{self.rules['decode']} store weights differently (1d_ws stores E F_xyz, the "
          'others E_x F_zy), so switching would move every weight. Pair 1d_ws with 1d_ws, '
          'or pick both from 2d_ws / wg_x / wg_xy / wg_xyz.')
    for r in self.rules.values():
      if r.layout.attn != 'multihead' and self.config.num_kv_heads > 1:
        raise ValueError(f'Layout {r}: multiquery attention layouts replicate the single kv '
                         f'head, but the model has num_kv_heads={self.config.num_kv_heads}. '
                         "Use attention layout 'multihead' (kv heads split with the query "
                         'heads).')
    self.graphdef, state = nnx.split(model)
    self.state_shardings = _specs.state_shardings(state, self.rules['prefill'], mesh)
    _specs.state_shardings(state, self.rules['decode'], mesh)  # its own checks
    self.state = place(state, self.state_shardings)
    self._hooks = {p: LayoutHooks(r, mesh) for p, r in self.rules.items()}

  def cache_shardings(self, cache: kvcache.KVCache, phase: str = 'decode') -> kvcache.KVCache:
    """Where `phase`'s attention layout keeps each leaf of `cache`."""
    return _specs.cache_shardings(cache, self.rules[_check_phase(phase)], self.mesh)

  def init_cache(self, batch: int, max_len: Optional[int] = None, fmt=None,
                 phase: str = 'prefill') -> kvcache.KVCache:
    """An empty KV cache (float, or quantized with `fmt`), created already sharded."""
    abstract = jax.eval_shape(lambda: kvcache.init_cache(self.config, batch, max_len, fmt=fmt))
    shardings = self.cache_shardings(abstract, phase)
    make = jax.jit(lambda: kvcache.init_cache(self.config, batch, max_len, fmt=fmt),
                   out_shardings=shardings)
    return make()

  def step(self, phase: str, tokens_BT, cache: kvcache.KVCache):
    """One forward pass of `phase` against `cache` (donated): (logits_BTV, new cache)."""
    hooks = self._hooks[_check_phase(phase)]
    cache = place(cache, self.cache_shardings(cache, phase))  # no-op when in place
    tokens_BT = place(np.asarray(tokens_BT), NamedSharding(self.mesh, PartitionSpec()))
    with jax.set_mesh(self.mesh):
      return _step(self.graphdef, hooks, self.state, tokens_BT, cache)

  def prefill(self, tokens_BT, cache):
    return self.step('prefill', tokens_BT, cache)

  def decode(self, tokens_BT, cache):
    return self.step('decode', tokens_BT, cache)

  def lower_step(self, phase: str, tokens_BT, cache):
    """The jitted step of `phase`, lowered (`.compile().as_text()` gives the HLO)."""
    hooks = self._hooks[_check_phase(phase)]
    with jax.set_mesh(self.mesh):
      return _step.lower(self.graphdef, hooks, self.state, tokens_BT, cache)

  def lower_block(self, phase: str, layer: int, x_BTD, cache):
    """One decoder layer (`layers[layer]`) of `phase` against `cache`, lowered."""
    hooks, graphdef = self._hooks[_check_phase(phase)], self.graphdef

    def block(state, x_BTD, cache):
      model = nnx.merge(graphdef, state)
      positions = kvcache.next_positions(cache, x_BTD.shape[1])
      with shard_hooks.use(hooks):
        return model.layers[layer](x_BTD, positions, cache)
    with jax.set_mesh(self.mesh):
      return jax.jit(block).lower(self.state, x_BTD, cache)

  def weight_bytes_per_device(self) -> int:
    """Bytes of weights each device holds, as the layout predicts them."""
    return _specs.bytes_per_device(self.state, self.state_shardings)

  def kv_bytes_per_device(self, cache: kvcache.KVCache, phase: str = 'decode') -> int:
    """Bytes of `cache` each device holds under `phase`'s layout."""
    return _specs.bytes_per_device(cache, self.cache_shardings(cache, phase))


  def record(self, cache: Optional[kvcache.KVCache] = None) -> dict:
    """Plain facts for a conversion / run record: mesh, layouts, formats, bytes per device."""
    out = {'mesh': 'x'.join(str(self.mesh.shape[a]) for a in MESH_AXES),
           'prefill_layout': str(self.rules['prefill']),
           'decode_layout': str(self.rules['decode']),
           'weight_bytes_per_device': self.weight_bytes_per_device()}
    if cache is not None:
      out.update(kv_format=cache.format, kv_bytes_per_device=self.kv_bytes_per_device(cache))
    return out


def _check_phase(phase: str) -> str:
  if phase not in PHASES:
    raise ValueError(f'Unknown phase {phase!r}; use one of {PHASES}.')
  return phase
