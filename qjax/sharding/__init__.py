"""Pope et al. partitioning layouts on `jax.sharding` meshes, and a sharded KV cache.

Layouts are data (`layout_rules('2d_ws+mq_batch')`: logical axis -> mesh axes); the layers
of `qjax.nn` name logical axes and einsum letters only, and `LayoutHooks` runs them under a
layout with the collectives written out (`jax.shard_map`: weight all-gathers, all-gather /
reduce-scatter of activations, all-to-all for batch-sharded multiquery attention).

    mesh = sharding.make_mesh('2x2x2')
    sm = sharding.ShardedTransformer(model, mesh, prefill='wg_xyz+mq_batch',
                                     decode='2d_ws+mq_batch')
    cache = sm.init_cache(batch=8, max_len=64, fmt='int8')   # quantized, batch-split
    logits, cache = sm.prefill(prompt_BT, cache)
    logits, cache = sm.decode(token_B1, cache)
    sharding.count_collectives(sm.lower_block('decode', 0, x_BTD, cache).compile().as_text(),
                               mesh)

Layout names and the analytic costs are those of `qjax.costmodel`. For a TPU pod slice this
machine does not have, `qjax.aot.compile_step` compiles a layout's step with the TPU compiler
and `qjax.aot.compare_layouts` puts its memory, collective bytes and roofline beside the cost
model's (docs/costmodel.md).
"""

from qjax.sharding._hlo import Collective, collectives, count_collectives, sent_bytes
from qjax.sharding._hooks import LayoutHooks, use_layout
from qjax.sharding._inference import (PHASES, ShardedTransformer, default_platform_devices,
                                      make_mesh)
from qjax.sharding._rules import (FFN_TABLES, MESH_AXES, Rules, all_layouts, layout_rules,
                                  same_stored_weights, to_spec)
from qjax.sharding._specs import (bytes_per_device, cache_shardings, leaf_mesh_axes,
                                  qarray_logical, shard_bytes, state_shardings)

__all__ = [
    'Collective', 'FFN_TABLES', 'LayoutHooks', 'MESH_AXES', 'PHASES', 'Rules',
    'ShardedTransformer', 'all_layouts', 'bytes_per_device', 'cache_shardings', 'collectives',
    'count_collectives', 'default_platform_devices', 'layout_rules', 'leaf_mesh_axes',
    'make_mesh', 'qarray_logical',
    'same_stored_weights', 'sent_bytes', 'shard_bytes', 'state_shardings', 'to_spec',
    'use_layout',
]
