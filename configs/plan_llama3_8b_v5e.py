r"""Plan Llama 3 8B serving on one v5e-8 slice, and check the plan against the TPU compiler.

Command:
  python -m experiments.plan --config=configs/plan_llama3_8b_v5e.py
  (--config.decode.batch=512 for the high-throughput point; --config.slice='' for the cost
  model alone, ~3 s)

Int8 weights and an int8 KV cache (qjax's serving formats) on 8 TPU v5e chips; prefill of
8 x 2048 tokens, decode at batch 64 with 64 tokens after a 2048-token prompt. Llama 3 has 8
kv heads, so only 'multihead' attention runs (qjax's multiquery layouts replicate one kv
head). Each layout is compiled for a compile-only v5e:2x4 (one and two layers, extrapolated
to 32).

Expected run time: ~20 min on 2 shared CPU cores (five layouts x two depths x two phases of
TPU compiles, a prefill ~3 min a layout; ~3 s without the slice).

Expected output: per phase the cost model's table, then the compiled table: decode B=64
2d_ws / 1d_ws+multihead at 2.16 GB per chip predicted and compiled (ratio ~1.00), collective
bytes within 1%, the cost model's pick (1d_ws or 2d_ws+multihead, 2.8 ms) the compiler's
fastest too (within 1%); the weight-gathered layouts' memory within 1% of the prediction
too (2.29-2.82 GB). table.txt and latency_vs_batch.png in results/plan/llama3_8b_v5e/; the
compiled tables (compile-only predictions) are in docs/costmodel.md.
"""

import ml_collections

from configs.plan_gemma3_h200 import shared


def get_config() -> ml_collections.ConfigDict:
  return shared(
      name='llama3_8b_v5e', model='llama3_8b', chip='tpu_v5e', n_chips=8, slice='v5e:2x4',
      layouts='1d_ws+multihead,2d_ws+multihead,wg_x+multihead,wg_xy+multihead,'
              'wg_xyz+multihead',
      prefill=ml_collections.ConfigDict(dict(
          batch=8, prompt_len=2048, history_len=0, weight_bits=8, act_bits=16, kv_bits=8)),
      decode=ml_collections.ConfigDict(dict(
          batch=64, prompt_len=2048, gen_len=64, history_len=0, weight_bits=8, act_bits=16,
          kv_bits=8)),
      plot_batches=(1, 8, 64, 512))
