"""Published measurements from Pope et al. 2022 (arXiv 2211.05102) to compare against.

All rows: PaLM 540B on 64 TPU v4 chips (a 4x4x4 slice), 2048-token context. These are
measured wall times; the roofline must stay below every one of them.
"""

from __future__ import annotations

import dataclasses

from qjax.costmodel import _layouts
from qjax.costmodel import _roofline


@dataclasses.dataclass(frozen=True)
class PaperRow:
  """One published configuration and what was measured for it."""

  label: str
  phase: str
  layout: _layouts.Layout
  workload: _roofline.Workload
  latency_s: float
  mfu: float
  mesh: _layouts.Mesh = _layouts.Mesh(4, 4, 4)
  model: str = 'palm_540b'
  chip: str = 'tpu_v4'


# Table 2. Prefill uses head-sharded attention (sec. 3.3), which needs the 48 heads padded to
# 64 as the paper did; decode uses batch-sharded multiquery attention. Decode rows generate
# 64 tokens after a 2048-token prompt.
TABLE2 = (
    PaperRow('prefill B=1, 2D WS, int8', 'prefill',
             _layouts.Layout('2d_ws', 'mq_heads', pad_heads=True),
             _roofline.Workload(batch=1, prompt_len=2048, weight_bits=8), 0.29, 0.43),
    PaperRow('decode B=64, 2D WS, batch-sharded attn, int8', 'decode',
             _layouts.Layout('2d_ws', 'mq_batch'),
             _roofline.Workload(batch=64, prompt_len=2048, gen_len=64, weight_bits=8),
             1.82, 0.14),
    PaperRow('prefill B=512, XYZ weight-gathered, bf16', 'prefill',
             _layouts.Layout('wg_xyz', 'mq_heads'),
             _roofline.Workload(batch=512, prompt_len=2048), 85.2, 0.76),
    PaperRow('decode B=512, 2D WS, batch-sharded attn, bf16', 'decode',
             _layouts.Layout('2d_ws', 'mq_batch'),
             _roofline.Workload(batch=512, prompt_len=2048, gen_len=64), 6.0, 0.33),
)

# Sec. 4 / Figure 1: decode at B=64 on 64 chips, seconds per generated token.
DECODE_B64_S_PER_TOKEN = {8: 28.5e-3, 16: 36.9e-3}

# Table 1: longest context with 30% of HBM holding the KV cache, 64 chips, bf16 KV.
# (model variant, attention layout) -> {batch: max context}. The multihead variant has
# 64 heads of 128 so that heads split evenly over 64 chips.
TABLE1_KV_FRACTION = 0.3
TABLE1 = {
    ('multihead_64x128', 'multihead'): {128: 1320, 512: 330},
    ('palm_540b', 'mq_heads'): {128: 660, 512: 165},
    ('palm_540b', 'mq_batch'): {128: 43000, 512: 10700},
}
