"""Analytic inference cost model after Pope et al. 2022, "Efficiently Scaling Transformer
Inference": chip presets, partitioning layouts, a per-phase roofline and a layout planner.

Pure Python: no jax, nothing else from qjax.

  est = costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4', '2d_ws+mq_batch',
                           costmodel.Workload(batch=64, prompt_len=2048, gen_len=64,
                                              weight_bits=8), phase='decode')
  est.step_latency_s, est.mfu, est.regime, est.memory.fits
  best = costmodel.plan('palm_540b', 'tpu_v4', workload, n_chips=64, phase='prefill').best
"""

from qjax.costmodel._chips import CHIPS, Chip, chip_from_spec, critical_batch, get_chip
from qjax.costmodel._collectives import (INTERCONNECTS, Collective, collective_seconds,
                                         group_bandwidth, layer_collectives)
from qjax.costmodel._formulas import (comm_1d_ws, comm_2d_ws, comm_2d_ws_optimal,
                                      comm_weight_gathered, model_flops_utilization,
                                      optimal_2d_x, optimal_gather_n)
from qjax.costmodel._layouts import (ATTN_LAYOUTS, FFN_LAYOUTS, Layout, Mesh, ShardPlan,
                                     as_layout, as_mesh, shard_plan)
from qjax.costmodel._models import MODELS, ModelShape, TotalsShape, get_model, model_from_spec
from qjax.costmodel._paper import TABLE1, TABLE2, PaperRow
from qjax.costmodel._planner import (Plan, all_layouts, max_context_len, mesh_factorizations,
                                     plan)
from qjax.costmodel._training import TrainMemory, train_memory
from qjax.costmodel._roofline import (COMBINE_RULES, COMBINE_TEXT, PHASES, Efficiency, Estimate,
                                      LayerCost, Memory, Workload, estimate)

__all__ = [
    'ATTN_LAYOUTS', 'CHIPS', 'COMBINE_RULES', 'COMBINE_TEXT', 'TotalsShape', 'chip_from_spec',
    'model_from_spec', 'Chip', 'Collective', 'Efficiency', 'Estimate',
    'FFN_LAYOUTS', 'INTERCONNECTS', 'LayerCost', 'Layout', 'MODELS', 'Memory', 'Mesh',
    'ModelShape', 'PHASES', 'PaperRow', 'Plan', 'ShardPlan', 'TABLE1', 'TABLE2', 'Workload',
    'all_layouts', 'as_layout', 'as_mesh', 'collective_seconds', 'comm_1d_ws', 'comm_2d_ws',
    'comm_2d_ws_optimal', 'comm_weight_gathered', 'critical_batch', 'estimate', 'get_chip',
    'get_model', 'group_bandwidth', 'layer_collectives', 'max_context_len', 'mesh_factorizations',
    'model_flops_utilization',
    'optimal_2d_x', 'optimal_gather_n', 'plan', 'shard_plan', 'TrainMemory', 'train_memory',
]
